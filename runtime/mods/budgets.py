"""A device's budgets as mods: its round's compute under the round guard (runtime/guard.py: a
memory ceiling, a time budget, checked at every item), and every message it sends up charged to
its owner's uplink budget before it leaves (runtime/uplink.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from splitedge.methods.contract import Message, RoundPlan
from splitedge.runtime.guard import RoundGuard
from splitedge.runtime.mods import Mod
from splitedge.runtime.uplink import UplinkBudget


def phase_name(plan: RoundPlan) -> str:
    return f"round {plan.round}" + ("" if plan.phase == "train" else f" {plan.phase}")


class Guarded(Mod):
    def __init__(self, guard: RoundGuard) -> None:
        self.guard = guard

    def work(self, plan: RoundPlan, call_next: Callable[[RoundPlan], Iterator[Any]]) -> Iterator[Any]:
        with self.guard.round(phase_name(plan), plan.deadline_s) as within:
            for item in call_next(plan):
                within.check()
                yield item


class Uplink(Mod):
    def __init__(self, budget: UplinkBudget, who: str) -> None:
        self.budget, self.who = budget, who

    def opened(self, plan: RoundPlan) -> list[Message]:
        self.budget.start(f"{self.who} {phase_name(plan)}")
        return []

    def leaving(self, direction: str, kind: str, body: Mapping[str, Any]) -> None:
        if direction != "down":
            self.budget.charge(kind, body)
