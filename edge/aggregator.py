"""The edge aggregator: tracks its devices, relays the cloud's commands, closes rounds, reports up.

With one broker, `down` and `up` are the same transport. With `--upstream`, devices sit on the
edge-site broker (`down`) and the cloud on another (`up`); the edge is the only bridge.
Membership comes from the devices' retained `hello` (parent == this edge) and liveness from
their `status` (a last will turns it "offline"), so a dead device stops holding rounds open.
"""

from __future__ import annotations

import logging
import threading
import time

import numpy as np

from splitedge.methods.registry import get_method
from splitedge.methods.strategy import EdgePart, Message, NodeContext, RoundPlan
from splitedge.protocol.codec import Envelope
from splitedge.protocol.node import Node, clear_retained
from splitedge.protocol.rounds import RoundCollector
from splitedge.protocol.topics import parse, pattern, topic
from splitedge.protocol.transport import Transport

log = logging.getLogger(__name__)

EDGE_DEADLINE_FRACTION = 0.8  # an edge closes its round before the cloud's deadline


class EdgeAggregator(Node):
    def __init__(self, down: Transport, up: Transport | None = None, *, run: str, node_id: str,
                 cloud: str = "cloud", seed: int = 0) -> None:
        super().__init__(run=run, tier="edge", node_id=node_id)
        self.down, self.up, self.cloud = down, up or down, cloud
        self.rng = self.seeded_rng(seed)
        self.part: EdgePart | None = None
        self.method: str | None = None
        self.plan: RoundPlan | None = None
        self.members: dict[str, int] = {}  # device -> samples
        self.online: set[str] = set()
        self.early: list[Envelope] = []
        self.rounds = RoundCollector()
        self.stopped = threading.Event()

    # -- wiring ----------------------------------------------------------------------------
    def start(self) -> None:
        clear_retained(self.down, pattern(self.run_id, "edge", self.node_id, "down"))
        self.up.subscribe(pattern(self.run_id, "cloud", self.cloud, "down"), self.enqueue)
        self.down.subscribe(pattern(self.run_id, "device", "+", "up", "hello"), self.enqueue)
        self.down.subscribe(pattern(self.run_id, "device", "+", "up", "status"), self.enqueue)
        self._announce()

    def _announce(self) -> None:
        hello = {"role": "edge", "parent": self.cloud, "samples": sum(self.members.values()),
                 "backend": "torch", "classes": np.zeros(0, dtype=np.int64), "members": len(self.live)}
        self.send(self.up, "up", "hello", hello, round_=0, retain=True)
        self.send(self.up, "up", "status", {"state": "online", "role": "edge"}, round_=0, retain=True)

    def run_forever(self, poll: float = 0.2) -> None:
        while not self.stopped.is_set():
            self.dispatch(self.next_event(poll))
            self._maybe_close_round()

    def stop(self) -> None:
        self.stopped.set()

    # -- events ----------------------------------------------------------------------------
    def handle(self, topic: str, env: Envelope) -> None:
        tier = parse(topic).tier
        if tier == "cloud":
            self._from_cloud(env)
        elif env.kind == "hello":
            self._on_hello(env)
        elif env.kind == "status":
            self._on_status(env)
        elif env.sender in self.members:
            self._from_device(env)

    def _on_hello(self, env: Envelope) -> None:
        if env.body["parent"] != self.node_id or env.sender in self.members:
            return
        self.members[env.sender] = int(env.body["samples"])
        self.down.subscribe(pattern(self.run_id, "device", env.sender, "up"), self.enqueue)
        log.info("edge %s: device %s joined (%d samples)", self.node_id, env.sender, env.body["samples"])
        self._announce()

    def _on_status(self, env: Envelope) -> None:
        """Kept for every device: a status may arrive before the hello that makes it a member."""
        was = env.sender in self.online
        (self.online.add if env.body["state"] == "online" else self.online.discard)(env.sender)
        if env.sender in self.members and was != (env.sender in self.online):
            if not was:
                log.info("edge %s: device %s is online", self.node_id, env.sender)
            else:
                log.warning("edge %s: device %s went offline", self.node_id, env.sender)
            self._announce()  # the cloud waits for live devices before round 1

    @property
    def live(self) -> set[str]:
        """Members whose last status is online."""
        return {d for d in self.members if d in self.online}

    def _from_cloud(self, env: Envelope) -> None:
        if env.kind != "round":
            if not self.current(env):
                return
            if self.part is None:
                self.early.append(env)
            else:
                self._relay(self.part.on_message(env))
            return
        plan = RoundPlan.from_body(env.round, env.body)
        session = str(plan.config.get("session", ""))
        if session and session != self.session and not plan.stop:
            self._new_session(session)
        if plan.stop:
            if self.plan is not None:  # else: a retained stop left over from an earlier run
                self.send(self.down, "down", "round", env.body, round_=env.round, retain=True)
                self.stopped.set()
            return
        if self.plan is not None and plan.round <= self.plan.round:
            return  # seen already (a retained announcement delivered again)
        self._ensure_part(plan)
        self.plan, self.round = plan, plan.round
        self._relay(self.part.on_round_open(plan, set(self.live)))
        self.send(self.down, "down", "round", env.body, round_=env.round, retain=True)
        self.rounds.open(plan.round, plan.deadline_s * EDGE_DEADLINE_FRACTION, set(self.live))

    def _new_session(self, session: str) -> None:
        """A (re)started cloud: forget the old incarnation's part, round and cached state."""
        if self.session:
            log.info("edge %s: new session %s (was %s)", self.node_id, session, self.session)
        self.session, self.part, self.method, self.plan = session, None, None, None
        self.early = [env for env in self.early if self.current(env)]
        if self.rounds.is_open:
            self.rounds.close()

    def _ensure_part(self, plan: RoundPlan) -> None:
        if self.part is not None and self.method == plan.method:
            return
        ctx = NodeContext(node_id=self.node_id, config=plan.config, rng=self.rng)
        self.part = get_method(plan.method).edge_part(ctx)
        self.method = plan.method
        for env in self.early:
            self._relay(self.part.on_message(env))
        self.early.clear()

    def _from_device(self, env: Envelope) -> None:
        if not self.current(env):
            return
        if self.part is not None:
            replies = self.part.on_device_message(env)
            if replies:
                self._relay(replies)
                return
        self.rounds.add(env)

    def _maybe_close_round(self) -> None:
        if not self.rounds.is_open or self.part is None or self.plan is None:
            return
        if not (self.rounds.complete(self.live) or self.rounds.expired()):
            return
        if not self.part.ready(self.plan):
            return  # the global W_e has not arrived yet; it is retained, so it will
        started = time.monotonic()
        reports = self.rounds.close()
        try:
            for msg in self.part.aggregate(self.plan, reports):
                self.send(self.up, "up", msg.kind, msg.body, retain=msg.retain, topic_kind=msg.topic_kind)
        except Exception:  # the cloud still hears that this edge is done, so the run goes on
            self.errors += 1
            log.exception("edge %s: aggregating round %d failed", self.node_id, self.plan.round)
        info = {**self.part.round_info(), "devices": len(reports),
                "seconds": round(time.monotonic() - started, 3), "errors": self.errors}
        self.send(self.up, "up", "done", {"phase": "round", "info": info})

    def _relay(self, messages: list[Message]) -> None:
        for msg in messages:
            if msg.target is not None:
                env = Envelope(kind=msg.kind, run=self.run_id, round=self.round, sender=self.node_id, body=msg.body)
                self.down.publish(topic(self.run_id, "device", msg.target, "down", msg.topic_kind or msg.kind),
                                  env, retain=msg.retain)
            else:
                self.send(self.down, "down", msg.kind, msg.body, retain=msg.retain, topic_kind=msg.topic_kind)
