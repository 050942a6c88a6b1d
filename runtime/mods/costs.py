"""What a phase cost the node (runtime/cost.py) in its `done` info, and on an edge its devices'
costs passed up: one by one, or only summed for devices with private reports."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from splitedge.methods.contract import RoundPlan
from splitedge.protocol.done import DoneInfo
from splitedge.runtime.cost import CostMeter, device_costs
from splitedge.runtime.mods import Mod


class Costs(Mod):
    """`cost`: CPU seconds, peak memory and bytes on the node's connections since its last done;
    on an edge, its devices' in `devices.cost` and `devices.private_cost`."""

    writes = ("cost", "devices.cost", "devices.private_cost")

    def __init__(self, transports: Iterable[Any], *, shared_process: bool = False, children: bool = False) -> None:
        self.meter = CostMeter({id(t): t for t in transports}.values(), shared_process=shared_process)
        self.children = children  # an edge: its devices' costs too

    def done(self, plan: RoundPlan, info: DoneInfo, children: Mapping[str, DoneInfo]) -> DoneInfo:
        if self.children and info.devices is not None:
            info = info.but(devices=device_costs(info.devices, children))
        return info.but(cost=self.meter.round())
