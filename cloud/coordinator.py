"""The cloud coordinator: owns the round schedule and placement (its edges: cloud/edges.py), closes rounds on
quorum or deadline, runs the method's cloud part, writes metrics (JSON lines) and checkpoints
(safetensors).
"""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from splitedge.methods.calibration import calibrates
from splitedge.methods.config import RunConfig
from splitedge.methods.losslog import tier_losses
from splitedge.methods.metrics.plateau import plateaued
from splitedge.methods.compute import CPU, Compute
from splitedge.methods.contract import DEVICES, FederationView, Message, NodeContext, RoundPlan
from splitedge.cloud import resume
from splitedge.cloud.calibration_phase import CloudCalibration
from splitedge.cloud.commit import Committer, RunWriter
from splitedge.cloud.edges import CloudEdges
from splitedge.methods import budget
from splitedge.protocol.codec import Envelope
from splitedge.runtime.cost import add_costs, phase_costs
from splitedge.runtime.downlink import DownlinkEncoder
from splitedge.runtime.faults import crash_point
from splitedge.runtime.guard import RoundGuard
from splitedge.runtime.node import INTERRUPTED, Node, status
from splitedge.runtime.parts import PartHost
from splitedge.runtime.records import phase_failures, phase_privacy, wire_metrics
from splitedge.runtime.router import cloud_router
from splitedge.runtime.session import clear_retained
from splitedge.runtime.presence import REJOIN_GRACE_S
from splitedge.runtime.rounds import RoundCollector
from splitedge.runtime.sampling import Sampling
from splitedge.protocol.topics import parse, pattern
from splitedge.protocol.transport import Transport

log = logging.getLogger(__name__)


@dataclass
class CloudSettings:
    method: str
    rounds: int
    config: RunConfig
    deadline_s: float = 300.0
    min_edges: int = 1
    min_devices: int = 0
    join_timeout_s: float = 60.0
    rejoin_timeout_s: float = 120.0  # before a round, wait this long for edges that went offline
    rejoin_grace_s: float = REJOIN_GRACE_S  # ... when some are online: this long for the others
    out_dir: Path | None = None
    seed: int = 0
    sampling: Sampling = field(default_factory=Sampling)  # which online devices train each round
    until_plateau: bool = False  # stop before `rounds` once the accuracy has plateaued (methods/metrics/plateau.py)
    dataset: str = ""  # the data set's name, written into the checkpoint so export finds its test images
    compute: Compute = CPU  # the torch device its part trains and evaluates on (--device, methods/compute.py)
    on_round: Callable[[dict[str, Any]], None] | None = field(default=None, repr=False)


class CloudCoordinator(Node):
    def __init__(self, transport: Transport, settings: CloudSettings, *, run: str,
                 test: tuple[np.ndarray, np.ndarray], node_id: str = "cloud",
                 resume_from: resume.CloudState | None = None, host: Callable[..., PartHost] = PartHost,
                 guard: RoundGuard | None = None) -> None:
        super().__init__(run=run, tier="cloud", node_id=node_id)
        self.guard = guard or RoundGuard(who="cloud")  # what an evaluation may take (runtime/guard.py)
        self.session = uuid.uuid4().hex[:16]
        self.attempt = 0  # how many times this session was resumed: nodes redo a round of a higher attempt
        self.transport, self.settings = transport, settings
        self.view = FederationView()
        self.router = cloud_router(transport)
        # the part's randomness is the node's, so a part the host rebuilds carries on with it
        self.rng = np.random.default_rng(settings.seed)
        self.host = host(lambda method: method.cloud_part(NodeContext(
            node_id=node_id, method=method, rng=self.rng, test=test, rounds=settings.rounds,
            out_dir=settings.out_dir, run=run, view=self.view, compute=settings.compute)), rng=self.rng, stopped=self.stopped, name="cloud")
        self.host.ensure(settings.method, settings.config.to_wire())  # registers the method's kinds
        self.method = self.part.method
        self.edges = CloudEdges(self.view, settings, self._dispatch_until, self._assign)  # who is there, and where
        self.committer = Committer(self)  # its records, run folder and resume state (cloud/commit.py)
        self.rounds = RoundCollector()
        self.costs: tuple[dict, dict] = ({}, {})  # this round's, per device and per edge (runtime/cost.py)
        self.resumed = resume_from
        self.calibration = CloudCalibration(self)  # the rounds' calibration and evaluation phases
        self.downlink = DownlinkEncoder.of(self.method.config, seed=settings.seed)  # models to every device
        if resume_from is not None:
            self.committer.restore(resume_from)

    @property
    def history(self) -> list[dict[str, Any]]:
        """The committed rounds' records."""
        return self.committer.history

    @property
    def pending(self) -> dict[str, Any] | None:
        return self.committer.pending

    @property
    def outbox(self) -> list[Message]:
        return self.committer.outbox

    @property
    def writer(self) -> RunWriter:
        return self.committer.writer

    def start(self) -> None:
        """Clear a previous incarnation's downlink and publish the initial models; a resumed
        cloud keeps its downlink instead: the retained models are its session's latest."""
        if self.resumed is None:
            clear_retained(self.transport, pattern(self.run_id, "cloud", self.node_id, "down", "#"))
            self.transport.publish_raw(self.topic("up", "metrics"), b"", retain=True)  # an earlier run's last round
        self.transport.subscribe(pattern(self.run_id, "edge", "+", "up"), self.enqueue)
        self.announce_online(self.transport)
        if self.resumed is None:
            for msg in self.part.initial_messages():
                self.publish(msg, round_=0)
        else:  # the compressed downlink's bases again: a broker that restarted too has lost them
            for msg in self.downlink.bases(DEVICES):
                super().publish(msg, round_=self.round)

    # -- routing ----------------------------------------------------------------------------
    def publish(self, msg: Message, round_: int | None = None) -> Envelope | None:
        """Route a part's message (runtime/router.py); one for a device no edge reports is kept
        for it when it has a slot (retained), else dropped. A model for every device goes as
        the downlink codec has it (runtime/downlink.py: its base when due, its compressed form)."""
        if msg.to.role == "device" and msg.to.node and msg.to.node not in self.view.devices:
            log.warning("cloud: %s for device %s, which no edge reports; it waits for it (retained)" if msg.slot
                        else "cloud: %s for unknown device %s is dropped", msg.kind, msg.to.node)
            if not msg.slot:
                return None
        env = None
        for out in self.downlink.encode(msg):
            env = super().publish(out, round_=round_)
        if self.downlink.codes(msg):  # the part holds what devices decode (its merge's rest is the codec's residual)
            self.part.adopt_sent(msg.slot, self.downlink.held(msg.slot))
        return env

    # -- membership -------------------------------------------------------------------------
    def handle(self, topic: str, env: Envelope) -> None:
        if parse(topic).tier != "edge" or self.edges.heard(env, self.node_id):  # membership, presence
            return
        if env.sender in self.view.members and self.current(env) and self.accepts(self.part, env, "child"):
            if env.kind == "done":
                self.edges.note_left(env.sender, env.body.get("info") or {})
            self.part.on_edge_message(env)
            self.rounds.add(env)

    @property
    def live(self) -> set[str]:
        return self.edges.live

    @property
    def awaited(self) -> set[str]:
        return self.edges.awaited

    def online_devices(self) -> set[str]:
        return self.edges.online_devices()

    @property
    def left(self) -> dict[str, str]:
        """Node -> why it left the run (for the run's summary)."""
        return self.edges.left

    def _dispatch_until(self, done: Callable[[], bool], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not done() and time.monotonic() < deadline:
            self.dispatch(self.next_event(min(0.5, max(0.0, deadline - time.monotonic()))))

    def _assign(self, device: str, body: dict[str, Any]) -> None:
        self.send(self.transport, "down", "assign", body, retain=True, to=device)

    # -- rounds -----------------------------------------------------------------------------
    def run(self) -> list[dict[str, Any]]:
        """All rounds, then the stop announcement; returns the per-round metrics."""
        self.start()
        try:
            self.edges.wait_for_edges(self.run_id, None if self.resumed is None else self.resumed.round)
            empty = sorted(e for e in self.live if not self.view.members.get(e))
            if empty:
                log.warning("cloud: edge(s) %s joined with no device; their rounds carry nothing", ", ".join(empty))
        except TimeoutError:
            self._announce_stop(reason="the cloud's join timeout passed")  # nobody waits for a round that never comes
            raise
        try:
            if self.pending is not None:
                self.resume_round()
            for r in range(self.round + 1, self.settings.rounds + 1):
                if self.stopped.is_set() or (self.settings.until_plateau and self.history and plateaued(self.history)):
                    break
                self.run_round(r)
                if self.settings.until_plateau and plateaued(self.history):
                    status.info("cloud: accuracy plateaued at round %d of at most %d; stopping", r, self.settings.rounds)
                    break
        except KeyboardInterrupt:  # the operator stopped the cloud: its nodes hear that the run is not over
            self._announce_stop(interrupted=True)
            raise
        except Exception:  # a crash (a full disk, a damaged file): no stop, the nodes wait for the restarted cloud
            log.error("cloud: stopped by an error; edges and devices keep waiting: restart the cloud with the same "
                      "arguments to resume after its last committed round")
            raise
        self._announce_stop()
        self.committer.save(finished=True)
        return self.history

    def plan(self, r: int, participants: tuple[str, ...] = ()) -> RoundPlan:
        spec = self.part.plan(r)
        return RoundPlan(round=r, method=self.method.name, deadline_s=self.settings.deadline_s,
                         config=self.method.run_config.to_wire(), versions=dict(spec.versions),
                         directives=dict(spec.directives), session=self.session, attempt=self.attempt,
                         participants=participants)

    def run_round(self, r: int) -> dict[str, Any]:
        started = time.monotonic()
        self.edges.wait_for_live_edges(r)
        moves = self.part.placement(r)
        if moves:
            self.edges.place(moves)
        for msg in self.part.before_round(r):
            self.publish(msg, round_=r)
        plan = self.plan(r, self.settings.sampling.draw(r, self.online_devices()))
        self.round, self.costs = r, ({}, {})  # what each device and edge reports its phases cost
        reports = self.run_phase(plan)
        self.part.losses = {}
        with budget.evaluations(lambda: self.guard.round(f"round {r}'s evaluation", plan.deadline_s)):
            messages, metrics = self.part.aggregate(plan, reports)  # an evaluation over its bounds is skipped
        metrics = {**metrics, **phase_privacy(reports)}
        if self.guard.failures:  # {reason: 1}: this round has no accuracy (methods/metrics/evaluate.py)
            metrics["evaluation_failed"] = dict(self.guard.failures)
            self.guard.failures.clear()
        crash_point("cloud.aggregated", r)
        self.committer.hold(plan, metrics, reports, tier_losses(reports, self.part.losses))
        self.commit_and_publish(messages)  # the new models leave only once a restart would send them again
        crash_point("cloud.published", r)
        return self.finish_round(plan, reports, started)

    def resume_round(self) -> dict[str, Any]:
        """The round a crash interrupted after its merge: its outbox again (the same models, the
        same versions, so no node holds one this cloud does not know), then the rest of it."""
        pending = self.pending
        r = int(pending["round"])
        plan = dataclasses.replace(RoundPlan.from_body(r, pending["plan"]), attempt=self.attempt)
        self.round, self.costs = r, ({}, {})
        self.edges.wait_for_live_edges(r)
        self.publish_all(self.outbox)
        return self.finish_round(plan, [], time.monotonic())

    def commit_and_publish(self, messages: list[Message], round_: int | None = None) -> None:
        """Publish `messages` of the merged round after committing them (with the part's state)
        in the resume state, so that what leaves the cloud is never forgotten by a restart."""
        self.committer.commit(messages)
        self.publish_all(messages, round_=round_)

    def finish_round(self, plan: RoundPlan, reports: list[Any], started: float) -> dict[str, Any]:
        """Calibrate the merged round (when due), write its record, checkpoint and commit."""
        r = plan.round
        metrics = dict(self.pending["metrics"])
        failed = phase_failures(reports)  # devices (and edge merges) whose training phase failed, by reason
        if failed:
            metrics["failures"] = failed
        if calibrates(self.method.config, r, self.settings.rounds):
            calibration, reports = self.calibration.run(plan, reports)  # the edges' latest word on what they refused
            metrics.update(calibration)
            crash_point("cloud.calibrated", r)
        record = self.committer.record(plan, reports, metrics, started, self.rounds.counts, self.costs)
        self.host.end_round()  # after the round's losses are read off the part: a host may swap the part out
        self.committer.write(record)
        self.send(self.transport, "up", "metrics", wire_metrics(record), round_=r, retain=True)  # for watchers
        if self.settings.on_round:
            self.settings.on_round(record)
        return record

    def run_phase(self, plan: RoundPlan) -> list[Any]:
        """Announce `plan` (a round, its calibration or its evaluation) and collect the edges'
        reports until every awaited edge is done or the deadline passes."""
        self.rounds.open(plan.round, plan.deadline_s, self.awaited, phase=plan.phase)
        self.send(self.transport, "down", "round", self.with_members(plan).to_body(), retain=True)
        while not (self.rounds.complete(self.awaited) or self.rounds.expired()):
            self.dispatch(self.next_event(0.2))
        reports = self.rounds.close()
        for into, more in zip(self.costs, phase_costs(reports)):
            add_costs(into, more)
        return reports

    def with_members(self, plan: RoundPlan) -> RoundPlan:
        """With secure sums on, `plan` naming each edge's devices for its secure sums (those the
        edge lists as live, drawn when sampling), signed with the cloud's key in a signed
        federation: the edge relays it and cannot choose its devices' rosters
        (methods/privacy/roster.py)."""
        cfg = self.method.config
        if getattr(cfg, "secagg", "off") == "off":
            return plan
        from splitedge.methods.privacy import roster

        drawn = set(plan.participants)
        members = {e: [d for d in self.view.members.get(e, ()) if not drawn or d in drawn] for e in sorted(self.awaited)}
        signed = roster.directive(self.run_id, plan, cfg.secagg, roster.minimum(cfg), members,
                                  getattr(self.transport, "signer", None))
        return dataclasses.replace(plan, directives={**plan.directives, roster.ROSTER: signed})

    def _announce_stop(self, reason: str | None = None, interrupted: bool = False) -> None:
        """The end of the run: retained, so a node that (re)joins later still stops. A stop with
        a `reason` (the run never started) goes only to nodes listening now: as a retained
        message it would stop the next run's nodes at once. An `interrupted` cloud's stop
        (Ctrl-C, SIGTERM) names the last round it finished (INTERRUPTED): nodes do not take it
        for the run's end (Node.on_interrupted), and its restart resumes the run."""
        directives: dict[str, Any] = {"reason": reason} if reason else {}
        if interrupted:
            directives[INTERRUPTED] = self.committer.last_finished_round()
        plan = RoundPlan(round=self.round + 1, method=self.method.name, deadline_s=1.0,
                         config=self.method.run_config.to_wire(), session=self.session, stop=True,
                         directives=directives)
        self.send(self.transport, "down", "round", plan.to_body(), round_=plan.round, retain=reason is None)
