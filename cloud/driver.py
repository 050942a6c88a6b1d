"""The cloud's round driver: the schedule of a run. It waits for the edges, then drives each round
(placement, announcement, the edges' reports, the part's merge, its commit and publication,
calibration, the record) and ends with the stop announcement.

It holds the schedule only: who is there is the federation view's (cloud/edges.py), what is
committed the committer's (cloud/commit.py), and the transport and inbox the coordinator's
(cloud/coordinator.py), whose event loop runs while a phase is open.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

from splitedge.cloud import plans
from splitedge.cloud.calibration_phase import CloudCalibration
from splitedge.methods import budget
from splitedge.methods.calibration import calibrates
from splitedge.methods.contract import Message, RoundPlan
from splitedge.methods.losslog import tier_losses
from splitedge.methods.metrics.plateau import plateaued
from splitedge.runtime.node import status
from splitedge.runtime.records import wire_metrics
from splitedge.runtime.rounds import RoundCollector

log = logging.getLogger(__name__)


class RoundDriver:
    """Runs the rounds of `cloud` (the coordinator: its node, part, settings, edges and committer)."""

    def __init__(self, cloud: Any) -> None:
        self.cloud = cloud
        self.rounds = RoundCollector()  # the open phase: who reported, quorum and deadline
        self.calibration = CloudCalibration(self)  # the rounds' calibration and evaluation phases

    # what the phases read of the cloud (cloud/calibration_phase.py, PhaseDriver)
    part = property(lambda self: self.cloud.part)
    method = property(lambda self: self.cloud.method)
    view = property(lambda self: self.cloud.view)
    awaited = property(lambda self: self.cloud.edges.awaited)
    gate = property(lambda self: self.cloud.gate, lambda self, gate: setattr(self.cloud, "gate", gate))

    def run(self) -> list[dict[str, Any]]:
        """All rounds, then the stop announcement; returns the per-round metrics."""
        c = self.cloud
        c.start()
        self.join()
        try:
            if c.committer.pending is not None:
                self.resume_round()
            for r in range(c.round + 1, c.settings.rounds + 1):
                if c.stopped.is_set() or self.plateaued():
                    break
                self.run_round(r)
                if self.plateaued():
                    status.info("cloud: accuracy plateaued at round %d of at most %d; stopping", r, c.settings.rounds)
                    break
        except KeyboardInterrupt:  # the operator stopped the cloud: its nodes hear that the run is not over
            self.announce_stop(interrupted=True)
            raise
        except Exception:  # a crash (a full disk, a damaged file): no stop, the nodes wait for the restarted cloud
            log.error("cloud: stopped by an error; edges and devices keep waiting: restart the cloud with the same "
                      "arguments to resume after its last committed round")
            raise
        self.announce_stop()
        c.committer.save(finished=True)
        return c.committer.history

    def join(self) -> None:
        """Until enough edges, with devices, joined; past the join timeout a stop to those listening."""
        c = self.cloud
        try:
            c.edges.wait_for_edges(c.run_id, None if c.resumed is None else c.resumed.round)
        except TimeoutError:
            self.announce_stop(reason="the cloud's join timeout passed")  # nobody waits for a round that never comes
            raise
        empty = sorted(e for e in c.edges.live if not c.view.members.get(e))
        if empty:
            log.warning("cloud: edge(s) %s joined with no device; their rounds carry nothing", ", ".join(empty))

    def plateaued(self) -> bool:
        """With --until-plateau, whether the committed rounds' accuracy has stopped moving."""
        history = self.cloud.committer.history
        return self.cloud.settings.until_plateau and bool(history) and plateaued(history)

    def run_round(self, r: int) -> dict[str, Any]:
        c, started = self.cloud, time.monotonic()
        c.edges.wait_for_live_edges(r)
        moves = self.part.placement(r)
        if moves:
            c.edges.place(moves)
        for msg in self.part.before_round(r):
            c.publish(msg, round_=r)
        plan = plans.round_plan(c, r, c.settings.sampling.draw(r, c.edges.online_devices()))
        c.round = r
        c.mods.opened(plan)  # the round's mods start afresh (what its phases cost, ...)
        reports = self.run_phase(plan)
        messages, metrics = self.merge(plan, reports)
        c.mods.step("aggregated", r)
        c.committer.hold(plan, metrics, reports, tier_losses(reports, self.part.losses))
        self.commit_and_publish(messages)  # the new models leave only once a restart would send them again
        c.mods.step("published", r)
        return self.finish_round(plan, reports, started)

    def merge(self, plan: RoundPlan, reports: list[Any]) -> tuple[list[Message], dict[str, Any]]:
        """The part's merge of the round's reports (an evaluation over the guard's bounds is
        skipped), with what the mods hold with it (privacy, an evaluation that failed)."""
        c = self.cloud
        self.part.losses = {}
        with budget.evaluations(lambda: c.guard.round(f"round {plan.round}'s evaluation", plan.deadline_s)):
            messages, metrics = self.part.aggregate(plan, reports)
        return messages, {**metrics, **c.mods.held(plan, reports)}

    def resume_round(self) -> dict[str, Any]:
        """The round a crash interrupted after its merge: its outbox again (the same models, the
        same versions, so no node holds one this cloud does not know), then the rest of it."""
        c, pending = self.cloud, self.cloud.committer.pending
        r = int(pending["round"])
        plan = dataclasses.replace(RoundPlan.from_body(r, pending["plan"]), attempt=c.attempt)
        c.round = r
        c.mods.opened(plan)
        c.edges.wait_for_live_edges(r)
        c.publish_all(c.committer.outbox)
        return self.finish_round(plan, [], time.monotonic())

    def commit_and_publish(self, messages: list[Message], round_: int | None = None) -> None:
        """Publish `messages` of the merged round once committed with the part's state, so that
        what leaves the cloud is never forgotten by a restart."""
        self.cloud.committer.commit(messages)
        self.cloud.publish_all(messages, round_=round_)

    def finish_round(self, plan: RoundPlan, reports: list[Any], started: float) -> dict[str, Any]:
        """Calibrate the merged round (when due), write its record, checkpoint and commit."""
        c, r = self.cloud, plan.round
        metrics = dict(c.committer.pending["metrics"])
        if calibrates(self.method.config, r, c.settings.rounds):
            calibration, reports = self.calibration.run(plan, reports)  # the edges' latest word on what they refused
            metrics.update(calibration)
            c.mods.step("calibrated", r)
        metrics = c.mods.record(plan, metrics)  # costs, failures, the privacy spent
        record = c.committer.record(plan, reports, metrics, started, self.rounds.counts)
        c.host.end_round()  # after the round's losses are read off the part: a host may swap the part out
        c.committer.write(record)
        c.send(c.transport, "up", "metrics", wire_metrics(record), round_=r, retain=True)  # for watchers
        if c.settings.on_round:
            c.settings.on_round(record)
        return record

    def run_phase(self, plan: RoundPlan) -> list[Any]:
        """Announce `plan` (a round, its calibration or its evaluation) and collect the edges'
        reports until every awaited edge is done or the deadline passes."""
        c = self.cloud
        self.rounds.open(plan.round, plan.deadline_s, self.awaited, phase=plan.phase)
        c.send(c.transport, "down", "round", plans.with_members(c, plan).to_body(), retain=True)
        while not (self.rounds.complete(self.awaited) or self.rounds.expired()):
            c.dispatch(c.next_event(0.2))
        reports = self.rounds.close()
        c.mods.phase_reports(plan, reports)
        return reports

    def announce_stop(self, reason: str | None = None, interrupted: bool = False) -> None:
        """The run's end (cloud/plans.py), retained so that a node (re)joining later still stops,
        unless the run never started (`reason`)."""
        c = self.cloud
        plan = plans.stop(c, reason, interrupted)
        c.send(c.transport, "down", "round", plan.to_body(), round_=plan.round, retain=reason is None)
