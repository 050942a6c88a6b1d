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
from typing import Any, Callable, Mapping

import numpy as np

from splitedge.methods.calibration import calibrates
from splitedge.methods.config import RunConfig
from splitedge.methods.losslog import tier_losses
from splitedge.methods.privacy.accountant import privacy_spent
from splitedge.methods.metrics.plateau import plateaued
from splitedge.methods.compute import CPU, Compute
from splitedge.methods.contract import DEVICES, FederationView, Message, NodeContext, Placement, RoundPlan, To
from splitedge.cloud import resume
from splitedge.cloud.calibration_phase import CloudCalibration
from splitedge.cloud.commit import RunWriter
from splitedge.cloud.edges import CloudEdges
from splitedge.exporters.checkpoint import model_metadata
from splitedge.methods import budget, snapshot
from splitedge.protocol.codec import Envelope
from splitedge.runtime.cost import add_costs, phase_costs
from splitedge.runtime.downlink import DownlinkEncoder
from splitedge.runtime.faults import crash_point
from splitedge.runtime.guard import RoundGuard
from splitedge.runtime.node import INTERRUPTED, Node, status
from splitedge.runtime.parts import PartHost
from splitedge.runtime.records import phase_failures, phase_privacy, round_rejections, wire_metrics
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
        self.edges = CloudEdges(self.view, settings, self._dispatch_until)  # who is there (cloud/edges.py)
        self.writer = RunWriter(settings.out_dir)  # what the run folder gets (cloud/commit.py)
        self.rounds = RoundCollector()
        self.history: list[dict[str, Any]] = []
        self.costs: tuple[dict, dict] = ({}, {})  # this round's, per device and per edge (runtime/cost.py)
        self.pending: dict[str, Any] | None = None  # the round merged but not yet written (resume.CloudState)
        self.outbox: list[Message] = []  # what that round published since its merge, committed first
        self.resumed = resume_from
        self.calibration = CloudCalibration(self)  # the rounds' calibration and evaluation phases
        self.downlink = DownlinkEncoder.of(self.method.config, seed=settings.seed)  # models to every device
        if resume_from is not None:
            self._restore(resume_from)

    def _restore(self, saved: resume.CloudState) -> None:
        """Carry on the run of `saved` (its session, round, part and randomness)."""
        self.session, self.round, self.attempt = saved.session, saved.round, saved.attempt + 1
        self.edges.enough = saved.enough_edges
        self.view.placements = snapshot.from_plain(saved.placements)
        self.part.restore_state(saved.part)
        self.rng.bit_generator.state = snapshot.from_plain(saved.rng).bit_generator.state
        if self.settings.out_dir is not None:
            self.history = resume.committed_history(self.settings.out_dir, saved.round)
        self.pending = snapshot.from_plain(saved.pending) if saved.pending else None
        if saved.calibration:
            inputs, metrics = snapshot.from_plain(saved.calibration)
            self.calibration.last = (inputs, metrics)
        if saved.downlink:
            self.downlink.load_state_dict(snapshot.from_plain(saved.downlink))
        if self.pending is not None:
            self.outbox = [Message(m["kind"], m["body"], To(*m["to"]), m["slot"]) for m in self.pending["outbox"]]
        status.info("cloud: resuming run %s (session %s) after round %d%s", self.run_id, self.session, saved.round,
                    f" (round {saved.round + 1} merged: finishing it)" if self.pending else "")

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
        if parse(topic).tier != "edge":
            return
        if env.kind == "hello" and env.body["parent"] == self.node_id:
            self.edges.hello(env.sender, env.body["members"])
        elif env.kind == "status":
            self.edges.status(env.sender, env.body["state"])
        elif env.sender in self.view.members and self.current(env) and self.accepts(self.part, env, "child"):
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

    def place(self, moves: Mapping[str, Placement]) -> None:
        """Send each moved device its placement (through its current edge) and wait until the new
        edges report them (CloudEdges.wait_placed)."""
        for dev, where in moves.items():
            self.view.placements[dev] = where
            body = {"edge": where.edge, "groups": list(where.groups), "peers": list(where.peers)}
            self.send(self.transport, "down", "assign", body, retain=True, to=dev)
        self.edges.wait_placed(moves)

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
        self._save_state(finished=True)
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
            self.place(moves)
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
        self.pending = {"round": r, "plan": plan.to_body(), "metrics": metrics, "edges": len(reports),
                        "devices": devices_reported(reports), "losses": tier_losses(reports, self.part.losses)}
        self.outbox = []
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
        if messages and self.pending is not None and self.settings.out_dir is not None:
            self.outbox.extend(messages)
            self._save_state(last_round=self.pending["round"] - 1)
            crash_point("cloud.committed", self.pending["round"])
        self.publish_all(messages, round_=round_)

    def finish_round(self, plan: RoundPlan, reports: list[Any], started: float) -> dict[str, Any]:
        """Calibrate the merged round (when due), write its record, checkpoint and commit."""
        r, pending = plan.round, self.pending
        metrics = dict(pending["metrics"])
        failed = phase_failures(reports)  # devices (and edge merges) whose training phase failed, by reason
        if failed:
            metrics["failures"] = failed
        if calibrates(self.method.config, r, self.settings.rounds):
            calibration, reports = self.calibration.run(plan, reports)  # the edges' latest word on what they refused
            metrics.update(calibration)
            crash_point("cloud.calibrated", r)
        losses = pending["losses"]
        taking_part = len(plan.participants) if plan.participants else len(self.online_devices())
        metrics.update(privacy_spent(self.method.config, self.history[-1] if self.history else {}, metrics))
        if pending.get("devices") is not None:  # the devices whose training phase reached the cloud
            metrics["devices_reported"] = pending["devices"]
        metrics["served_head"] = self.served_head()  # what the checkpoint of this round carries
        record = {"round": r, **metrics, "edges": pending["edges"], "participants": taking_part,
                  "round_seconds": time.monotonic() - started, "versions": dict(plan.versions),
                  "directives": dict(plan.directives), "loss": losses, "rounds": dict(self.rounds.counts),
                  "rejected": round_rejections(self.rejections([self.transport]), reports),
                  "bytes": self.transport.counters.snapshot(), "device_costs": self.costs[0],
                  "edge_costs": self.costs[1]}
        self.host.end_round()  # after the round's losses are read off the part: a host may swap the part out
        self.pending, self.outbox = None, []
        self._persist(record)
        self.send(self.transport, "up", "metrics", wire_metrics(record), round_=r, retain=True)  # for watchers
        self.history.append(record)
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
            directives[INTERRUPTED] = self.last_finished_round()
        plan = RoundPlan(round=self.round + 1, method=self.method.name, deadline_s=1.0,
                         config=self.method.run_config.to_wire(), session=self.session, stop=True,
                         directives=directives)
        self.send(self.transport, "down", "round", plan.to_body(), round_=plan.round, retain=reason is None)

    def last_finished_round(self) -> int:
        """The last round whose record was written (0 before round 1 finished)."""
        return int(self.history[-1]["round"]) if self.history else 0

    def served_head(self) -> str:
        """Which head the served (checkpointed, exported) model carries: "calibrated" when the
        last calibration's head held every class (methods/calibration/serving.py), else "own"."""
        return "calibrated" if getattr(self.part, "calibrated", None) is not None else "own"

    def _persist(self, record: dict[str, Any]) -> None:
        self.writer.round(record, self.part.state_for_checkpoint, lambda: self._checkpoint_metadata(record),
                          self._state)

    def _checkpoint_metadata(self, record: dict[str, Any]) -> dict[str, str]:
        """The round and method, and what `splitedge export` rebuilds and feeds the network from,
        so it needs nothing but the file (exporters/checkpoint.py reads it back)."""
        spec = self.method.spec
        return {"round": str(record["round"]), "method": self.settings.method,
                **model_metadata(model=spec.model, dataset=self.settings.dataset, channels=spec.channels,
                                 image_size=spec.image_size, num_classes=spec.num_classes, mean=spec.mean,
                                 std=spec.std),
                **self.part.served_metadata()}

    def _save_state(self, finished: bool = False, last_round: int | None = None) -> None:
        """Commit the run as it stands (cloud/commit.py); with a merged round pending, `last_round`
        is the one before it and its outbox is saved too."""
        self.writer.commit(lambda: self._state(finished, last_round))

    def _state(self, finished: bool = False, last_round: int | None = None) -> resume.CloudState:
        """What a restarted cloud carries on from (cloud/resume.py)."""
        s = self.settings
        pending = None if self.pending is None else snapshot.to_plain({
            **self.pending, "outbox": [{"kind": m.kind, "body": m.body, "to": [m.to.role, m.to.node], "slot": m.slot}
                                       for m in self.outbox]})
        return resume.CloudState(
            run=self.run_id, method=s.method, config=self.method.run_config.to_wire(), seed=s.seed,
            session=self.session, round=self.round if last_round is None else last_round, attempt=self.attempt,
            enough_edges=self.edges.enough, placements=snapshot.to_plain(dict(self.view.placements)),
            rng=snapshot.to_plain(self.rng), part=self.part.resume_state(), finished=finished, pending=pending,
            calibration=None if self.calibration.last is None else snapshot.to_plain(list(self.calibration.last)),
            downlink=snapshot.to_plain(self.downlink.state_dict()) if self.downlink.slots else None)


def devices_reported(reports: list[Any]) -> int:
    """The devices whose training phase reached the cloud through their edges' `done` (the
    devices each edge heard from, less those that left the run: runtime/records.py)."""
    total = 0
    for rep in reports:
        done = rep.get("done")
        info = (done.body.get("info") or {}) if done is not None else {}
        total += max(0, int(info.get("devices") or 0) - len(info.get("left_devices") or {}))
    return total
