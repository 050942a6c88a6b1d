"""How an edge closes a phase of a round: when it is due, its merge under the edge's round
guard, its devices' `done` infos (a device whose message of the phase was refused counts as
failed), its own `done` up through its mods, its state saved, and one status line.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

from splitedge.methods.contract import RoundFailed, RoundPlan
from splitedge.protocol.codec import Envelope
from splitedge.protocol.done import DoneInfo, dones
from splitedge.runtime import statefile
from splitedge.runtime.guard import OverBudget
from splitedge.runtime.node import status
from splitedge.runtime.records import edge_done_info
from splitedge.runtime.rounds import done_phase

log = logging.getLogger(__name__)


def phase_of(plan: RoundPlan) -> str:
    return f"round {plan.round}" + ("" if plan.phase == "train" else f" {plan.phase}")


class Closer:
    def __init__(self, edge: Any) -> None:
        self.edge = edge
        self.refused_now: dict[str, str] = {}  # device -> rule of its message this phase refused (its phase failed)
        self.closed_with: int | None = None  # devices its last closed training round had a done from

    def opened(self) -> None:
        self.refused_now = {}

    def refused(self, env: Envelope, rule: str | None) -> None:
        """A device's message of the open phase was refused by `rule`: that phase fails for it."""
        rounds = self.edge.rounds
        if rule and rounds.is_open and env.round == rounds.round:
            self.refused_now.setdefault(env.sender, rule)

    def due(self) -> bool:
        """Whether the open phase closes now: every awaited device reported or its deadline
        passed, the models it needs are in (they are retained, so they will be), and no mod is
        still collecting (a secure sum's last shares) before the deadline."""
        edge = self.edge
        if not edge.rounds.is_open or edge.part is None or edge.plan is None:
            return False
        due = edge.rounds.complete(edge.roster.awaited_in(edge.plan)) or edge.rounds.expired()
        return due and edge.part.ready(edge.plan) and not (edge.mods.holds() and not edge.rounds.expired())

    def close(self) -> None:
        edge, plan, started = self.edge, self.edge.plan, time.monotonic()
        expected = set(edge.rounds.expected)  # awaited at the round's opening, and any that reported
        reports = edge.rounds.close() + edge.mods.reports(plan)
        failed = self._merge(plan, reports)
        by_device = self._device_infos(plan, reports)
        info = edge_done_info(edge.part, by_device, reported=len(reports), seconds=time.monotonic() - started,
                              errors=edge.errors, refused=edge.rejections([edge.down, edge.up]),
                              trained=plan.phase == "train")
        for dev, why in info.devices.left.items():
            log.warning("edge %s: device %s left the run: %s", edge.node_id, dev, why)
        info = edge.mods.done(plan, info.but(failed=bool(failed), reason=failed), by_device)
        edge.send(edge.up, "up", "done", {"phase": done_phase(plan.phase), "info": info.to_info()})
        edge.mods.closed(plan)
        edge.mods.step("done", plan.round)
        if plan.phase == "train":
            edge.completed, self.closed_with = edge.completed + 1, len(by_device)
        edge.host.end_round()  # after the round's info is read off the part: a host may swap the part out
        statefile.save(edge.state_file, edge)  # what a restarted edge carries on from
        edge.mods.step("saved", plan.round)
        # of the devices the round expected (those live at its opening, and any that reported), those
        # that reported and did not leave: never more than it expected (not the devices live now)
        left = len(info.devices.left)
        self._line(plan, len(by_device) - left, len(expected | set(by_device)), info.devices.failed, left, started)

    def _merge(self, plan: RoundPlan, reports: list[Any]) -> str:
        """The phase's merge (by phase: runtime/mods/phases.py) under the round guard, published;
        a merge that fails says why in the edge's done (the reason returned: memory or time, or
        failed), and the cloud still hears it is done; "" when it did not fail."""
        edge, what = self.edge, phase_of(plan) + " merge"
        edge.part.losses = {}
        try:
            with edge.host.working(), edge.guard.round(what, plan.deadline_s) as within:
                messages = edge.mods.merge(plan, reports, edge.part.aggregate)
                within.check()  # over its budget: nothing of it leaves
                edge.mods.step("aggregated", plan.round)
                edge.publish_all(messages)
                edge.mods.step("published", plan.round)
        except RoundFailed as exc:  # over its memory ceiling or time budget (runtime/guard.py): one line
            edge.errors += 1
            log.error("edge %s: %s failed: %s", edge.node_id, what, exc)
            return exc.reason if isinstance(exc, OverBudget) else "failed"
        except Exception:
            edge.errors += 1
            log.exception("edge %s: aggregating round %d (%s) failed", edge.node_id, plan.round, plan.phase)
        return ""

    def _device_infos(self, plan: RoundPlan, reports: list[Any]) -> dict[str, DoneInfo]:
        """device -> its `done` info. A device whose message of this phase was refused did not
        take part, whatever its `done` says: it counts as failed ("refused", runtime/records.py),
        with one line naming the rule (a device restarted with another shard is re-admitted by its
        new hello, runtime/membership.py; a lying one is refused every round)."""
        node = self.edge.node_id
        by_device = dones(reports)
        for dev, rule in sorted(self.refused_now.items()):
            if dev in by_device and not by_device[dev].left:
                by_device[dev] = by_device[dev].but(failed=True, reason="refused")
                log.warning("edge %s: device %s's %s does not count: its message was refused [%s]", node, dev,
                            phase_of(plan), rule)
        return by_device  # refused_now starts afresh when the next phase opens

    def _line(self, plan: RoundPlan, took_part: int, expected: int, failed: Mapping[str, int], left: int,
              started: float) -> None:
        """`failed`: its devices' failures by reason (runtime/records.py)."""
        status.info("edge %s: %s closed with %d/%d devices%s%s in %.1f s", self.edge.node_id, phase_of(plan),
                    took_part, expected,
                    f" ({sum(failed.values())} failed: {', '.join(f'{k} {v}' for k, v in sorted(failed.items()))})"
                    if failed else "", f" ({left} left the run)" if left else "", time.monotonic() - started)
