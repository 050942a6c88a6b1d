"""Which devices an edge holds, decided from their hellos.

A device joins an edge by the copy of its hello addressed to that edge; from then on its
latest unaddressed hello (which the edge reads through the member's own topics) says whether
it stays, changed its groups or moved to another edge. Two retained copies addressed to two
edges cannot be ordered (a device restarted at another edge leaves one behind); the
unaddressed one can. So when a member's hello names another edge, the id of the copy that
made it join here is remembered as refuted: read again, it cannot make the device join again
(else the old edge would take the device back and drop it in a loop).
"""

from __future__ import annotations

import logging
from typing import Any, Mapping

import numpy as np

from splitedge.protocol.codec import Envelope
from splitedge.protocol.topics import pattern
from splitedge.runtime.allowance import Allowance
from splitedge.runtime.presence import Presence
from splitedge.runtime.subscriptions import Subscriptions

log = logging.getLogger(__name__)
status = logging.getLogger("splitedge.status")


class Members:
    """An edge's devices (from their hellos) and which of them are alive (from their status).
    With `subs` (the edge's site transport), each member's own topics are read while it is one.
    With `listed` (the operator's manifest, runtime/allowance.py), only the devices it lists may
    join, each bounded by its entry."""

    def __init__(self, edge: str, run: str = "", subs: Subscriptions | None = None,
                 listed: Mapping[str, Allowance] | None = None) -> None:
        self.edge, self.run, self.subs, self.listed = edge, run, subs, listed
        self.presence = Presence()  # which devices are online, and who went offline a moment ago
        self.samples: dict[str, int] = {}  # device -> samples it may count (its hello's, within its entry)
        self.allowances: dict[str, Allowance] = {}  # device -> what it may count in what it sends
        # device -> the group addresses it reads: "@<g>" per group (the edge reads each from the
        # cloud while a member needs it)
        self.addresses: dict[str, set[str]] = {}
        self.joined_by: dict[str, str] = {}  # device -> msg_id of the hello that made it join
        self.refuted: dict[str, str] = {}

    def __contains__(self, device: object) -> bool:
        return device in self.samples

    def __iter__(self) -> Any:
        return iter(self.samples)

    def admits(self, device: str) -> bool:
        """Whether `device` may join at all: any id, or with a manifest only those it lists."""
        return self.listed is None or device in self.listed

    def hello(self, env: Envelope, *, addressed: bool) -> bool:
        """Take a hello; True when the members or what they read changed."""
        if env.sender == self.edge:
            log.warning("edge %s: a device with this edge's own id cannot join it", self.edge)
            return False
        if not self.admits(env.sender):
            return False
        before = self.samples.get(env.sender)
        change = self._change(env, addressed=addressed)
        if change in ("joined", "left"):
            status.info("edge %s: device %s %s", self.edge, env.sender, f"joined ({env.body['samples']} samples)"
                        if change == "joined" else "left for another edge")
        elif change == "reshard":
            status.info("edge %s: device %s came back with another shard: %d samples (was %d)%s", self.edge,
                        env.sender, self.samples[env.sender], before,
                        "" if self.listed is None else ", within its manifest entry")
        if change is not None and self.subs is not None:  # a member's status, hellos and data
            self.subs.sync({pattern(self.run, "device", d, "up", "#") for d in self.samples})
        return change is not None

    def _change(self, env: Envelope, *, addressed: bool) -> str | None:
        """"joined", "changed" (groups or backend), "reshard" (the same groups, another sample
        count or classes: a device restarted with a corrected shard is bounded by its new hello,
        within its manifest entry), "left" (moved to another edge), or None."""
        dev, parent = env.sender, env.body["parent"]
        if addressed:
            if parent != self.edge or dev in self or self.refuted.get(dev) == env.msg_id:
                return None  # another edge's copy, a member's (its unaddressed one counts), or stale
        elif parent != self.edge:
            if dev not in self:
                return None
            self.refuted[dev] = self.joined_by.pop(dev, "")
            self.drop(dev)
            return "left"
        self.joined_by[dev] = env.msg_id
        addresses = {f"@{g}" for g in env.body["groups"]}
        allowance = Allowance.of_hello(env.body).within(None if self.listed is None else self.listed[dev])
        if dev in self and self.addresses.get(dev) == addresses:
            if self.allowances.get(dev) == allowance:
                return None
            change = "reshard"
        else:
            change = "changed" if dev in self else "joined"
        self.samples[dev], self.allowances[dev], self.addresses[dev] = allowance.samples, allowance, addresses
        return change

    def status(self, env: Envelope) -> bool:
        """Take a status (retained: it arrives when the member's filter opens, and on change);
        True when a member went online or offline."""
        if not (self.presence.update(env.sender, env.body["state"]) and env.sender in self):
            return False
        online = env.sender in self.presence.online
        (log.info if online else log.warning)("edge %s: device %s %s", self.edge, env.sender,
                                              "is online" if online else "went offline")
        return True

    @property
    def live(self) -> set[str]:
        """Members whose last status is online."""
        return self.presence.live(self.samples)

    @property
    def awaited(self) -> set[str]:
        """Members a round waits for: online, or gone so recently they may be back (Presence)."""
        return self.presence.awaited(self.samples)

    def awaited_in(self, plan: Any) -> set[str]:
        """The members round `plan` waits for: `awaited`, and when the cloud sampled, drawn."""
        awaited = self.awaited
        return awaited & set(plan.participants) if plan is not None and plan.participants else awaited

    def hello_body(self, cloud: str) -> dict[str, Any]:
        """The edge's own hello: its parent, its devices' samples and the live ones."""
        return {"role": "edge", "parent": cloud, "samples": sum(self.samples.values()), "backend": "torch",
                "classes": np.zeros(0, dtype=np.int64), "members": sorted(self.live)}

    def drop(self, dev: str) -> None:
        self.samples.pop(dev, None)
        self.allowances.pop(dev, None)
        self.addresses.pop(dev, None)

    def group_addresses(self) -> set[str]:
        """Every group address some member reads."""
        return {a for mine in self.addresses.values() for a in mine}
