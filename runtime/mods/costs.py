"""What a phase cost the node (runtime/cost.py) in its `done` info, and on an edge its devices'
costs passed up: one by one, or only summed for devices with private reports; at the cloud,
each node's costs in the round's record."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from splitedge.methods.contract import RoundPlan
from splitedge.protocol.done import DoneInfo
from splitedge.runtime.cost import CostMeter, add_costs, device_costs, phase_costs
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


class CloudCosts(Mod):
    """The cloud's side: what each device and edge reported a round's phases cost (their edges'
    `done`s), summed over the round's phases, as the record's `device_costs` and `edge_costs`."""

    def __init__(self) -> None:
        self.costs: tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]]] = ({}, {})

    def opened(self, plan: RoundPlan) -> list:
        if plan.phase == "train":  # a round starts with its training phase (a resumed one with none)
            self.costs = ({}, {})
        return []

    def phase_reports(self, plan: RoundPlan, reports: Sequence[Any]) -> None:
        for into, more in zip(self.costs, phase_costs(reports)):
            add_costs(into, more)

    def record(self, plan: RoundPlan, metrics: Mapping[str, Any]) -> dict[str, Any]:
        return {"device_costs": self.costs[0], "edge_costs": self.costs[1]}
