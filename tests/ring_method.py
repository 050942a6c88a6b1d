"""A method that exists only in the test tree ("ring-test"), registered on import: the cloud
sends a message to ONE device (through that device's edge), devices on a ring exchange messages
with their two neighbours over device-to-device topics, and the cloud moves a device to another
edge between rounds. tests/methods/test_contract_method.py runs it over a real Mosquitto; other
tests import it for a method that reports no accuracy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import numpy as np

from splitedge.methods.config import MethodConfig
from splitedge.methods.registry import register_method
from splitedge.methods.contract import (
    DONE, PEERS, CloudPart, DevicePart, EdgePart, Kept, Message, Method, Placement, RoundPlan, RoundSpec, device,
)
from splitedge.protocol.done import done_info, dones


@dataclass(frozen=True)
class RingConfig(MethodConfig):
    secret_device: str = "d1"
    mover: str = "d0"
    gather_timeout_s: float = 20.0


def token(node: str, round_: int) -> int:
    return int(node[1:]) * 1000 + round_


class RingDevice(DevicePart[RingConfig]):
    """Sends its token to both ring neighbours, gathers theirs, and keeps any secret the cloud sent it."""

    secrets: Kept[list[int]]  # `heard` is the round's

    def __init__(self, ctx: Any, data: Any, backend: Any) -> None:
        super().__init__(ctx, data, backend)
        self.secrets = []
        self.heard: dict[str, int] = {}

    def on_message(self, env: Any) -> None:
        if env.kind == "arrays" and env.body["name"] == "secret":
            self.secrets.append(int(env.body["arrays"]["v"][0]))

    def run_round(self, plan: RoundPlan) -> Iterator[Message | object]:
        body = {"name": "token", "version": plan.round,
                "arrays": {"v": np.array([token(self.ctx.node_id, plan.round)], np.int64)}}
        yield Message("arrays", body, to=PEERS, slot="token")  # latest value: a late subscriber still gets it
        got = self.ctx.gather("arrays", timeout=self.cfg.gather_timeout_s)
        self.heard = {p: int(e.body["arrays"]["v"][0]) for p, e in got.items()}
        yield DONE

    def round_info(self) -> dict[str, Any]:
        return {"heard": self.heard, "secrets": list(self.secrets), "edge": self.ctx.view.edge}


class RingEdge(EdgePart):
    """Passes its devices' round infos up (what the test reads), nothing else."""

    def aggregate(self, plan: RoundPlan, reports: Sequence[Any]) -> list[Message]:
        self.infos = {dev: info.method for dev, info in dones(reports).items()}
        return []

    def round_info(self) -> dict[str, Any]:
        return {"members": getattr(self, "infos", {})}


class RingCloud(CloudPart):
    """Round 1: a ring of peers. After round 1: a secret for one device, and one device moved."""

    def placement(self, round_: int) -> dict[str, Placement] | None:
        devices = sorted(self.ctx.view.devices, key=lambda d: int(d[1:]))
        ring = {d: (devices[i - 1], devices[(i + 1) % len(devices)]) for i, d in enumerate(devices)}
        if round_ == 1:
            return {d: Placement(self.ctx.view.devices[d], peers=ring[d]) for d in devices}
        if round_ == 2:
            mover = self.cfg.mover
            edges = sorted(self.ctx.view.members)
            other = next(e for e in edges if e != self.ctx.view.devices[mover])
            return {mover: Placement(other, peers=ring[mover])}
        return None

    def plan(self, round_: int) -> RoundSpec:
        return RoundSpec(directives={"ring": True})

    def aggregate(self, plan: RoundPlan, reports: Sequence[Any]) -> tuple[list[Message], dict[str, Any]]:
        seen = {}
        for r in reports:
            for dev, info in done_info(r.get("done").body["info"]).method.get("members", {}).items():
                seen[dev] = {**info, "reported_by": r.sender}
        secret = {"name": "secret", "version": plan.round,
                  "arrays": {"v": np.array([100 * plan.round + 1], np.int64)}}
        return [Message("arrays", secret, to=device(self.cfg.secret_device))], {"devices": seen}


class Ring(Method):
    name = "ring-test"
    Config = RingConfig
    parts = {"device": f"{__name__}:RingDevice", "edge": f"{__name__}:RingEdge", "cloud": f"{__name__}:RingCloud"}


register_method("ring-test", Ring)
