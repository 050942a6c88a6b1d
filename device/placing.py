"""Where a device is placed and how it says so: its edge, groups and peers (the cloud's `assign`
moves it), its subscriptions for that placement, and its hello (on `up/hello`, and a copy
addressed to its edge, which joins it by that copy). With private reports the hello names no
class and only a power of two at or above the samples held (coarse_samples)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from splitedge.methods.contract import Placement, coarse_samples
from splitedge.runtime.filters import device_filters
from splitedge.runtime.node import status
from splitedge.runtime.subscriptions import Subscriptions


class Placing:
    def __init__(self, device: Any, edge: str) -> None:
        self.device = device
        self.placement = Placement(edge=edge)
        self.subs = Subscriptions(device.transport, device.enqueue)

    def sync(self, fresh: bool = False) -> None:
        """The device's filters for its placement (its edge's downlink, its groups', its peers')."""
        dev = self.device
        self.subs.sync(device_filters(dev.run_id, dev.node_id, self.placement, loaded=dev.host.loaded), fresh=fresh)

    def hello(self) -> None:
        """Twice, one message id: on `up/hello`, the latest word on where it is, read only by the
        edges holding it as a member; and addressed to its edge, which joins it by that copy."""
        dev, held = self.device, int(len(self.device.data[1]))
        hello = {"role": "device", "parent": self.placement.edge, "backend": dev.backend_name,
                 "samples": coarse_samples(held) if dev.private_reports else held,
                 "groups": list(self.placement.groups)}
        if not dev.hide_classes:
            hello["classes"] = np.unique(dev.data[1]).astype(np.int64)
        env = dev.send(dev.transport, "up", "hello", hello, round_=0, retain=True)
        dev.transport.publish(dev.topic("up", "hello", self.placement.edge), env, qos=1, retain=True)

    def assign(self, body: Mapping[str, Any]) -> None:
        """The cloud's `assign`: another edge, groups or peers; re-subscribe and say hello there."""
        new = Placement(edge=body["edge"], groups=tuple(body["groups"]), peers=tuple(body["peers"]))
        dev, old = self.device, self.placement
        if new == old:
            return
        moved = new.edge != old.edge
        status.info("device %s: placed at edge %s, groups %s, %d peer(s)", dev.node_id, new.edge, list(new.groups),
                    len(new.peers))
        if moved:  # the old edge's join filter must not find this device there again
            dev.transport.publish_raw(dev.topic("up", "hello", old.edge), b"", retain=True)
        self.placement = new
        if dev.part is not None:
            dev.part.ctx.view = new
        self.sync(fresh=moved)  # a new edge: read its retained state from scratch
        self.hello()
