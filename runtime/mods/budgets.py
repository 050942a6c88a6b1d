"""A device's budgets as mods: its round's compute under the round guard (runtime/guard.py: a
memory ceiling, a time budget, checked at every item), and every message it sends up charged to
its owner's uplink budget before it leaves (runtime/uplink.py); at the cloud, what went over a
guard in the round (`Failures`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from splitedge.methods.contract import Message, RoundPlan
from splitedge.runtime.guard import RoundGuard
from splitedge.runtime.mods import Mod
from splitedge.runtime.records import phase_failures
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


class Failures(Mod):
    """The cloud's side of the round guards: the devices (and edge merges) whose training phase
    failed, by reason, as its edges' `done`s say (`failures`), and a merged round whose evaluation
    went over the cloud's own guard (`evaluation_failed`: that round has no accuracy)."""

    def __init__(self, guard: RoundGuard) -> None:
        self.guard, self.failed = guard, {}

    def phase_reports(self, plan: RoundPlan, reports: Sequence[Any]) -> None:
        if plan.phase == "train":
            self.failed = phase_failures(reports)

    def opened(self, plan: RoundPlan) -> list[Message]:
        if plan.phase == "train":  # a round starts with its training phase (a resumed one with none)
            self.failed = {}
        return []

    def held(self, plan: RoundPlan, reports: Sequence[Any]) -> dict[str, Any]:
        if not self.guard.failures:
            return {}
        failed = {"evaluation_failed": dict(self.guard.failures)}  # {reason: 1} (methods/metrics/evaluate.py)
        self.guard.failures.clear()
        return failed

    def record(self, plan: RoundPlan, metrics: Mapping[str, Any]) -> dict[str, Any]:
        return {"failures": self.failed} if self.failed else {}
