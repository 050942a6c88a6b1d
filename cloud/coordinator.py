"""The cloud coordinator: the cloud's node (its transport, inbox and routing) and what wires its
three parts together: the round driver (cloud/driver.py) runs the schedule over the federation
view (cloud/edges.py: who is there and where) and commits each round through the committer
(cloud/commit.py: state, checkpoints, outputs).
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any, Callable

import numpy as np

from splitedge.cloud import resume
from splitedge.cloud.commit import Committer
from splitedge.cloud.driver import RoundDriver
from splitedge.cloud.edges import CloudEdges
from splitedge.cloud.plans import round_plan
from splitedge.cloud.settings import CloudSettings
from splitedge.methods.contract import DEVICES, CloudContext, CloudPart, FederationView, Message, RoundPlan
from splitedge.protocol.codec import Envelope
from splitedge.protocol.done import done_info
from splitedge.protocol.topics import parse, pattern
from splitedge.protocol.transport import Transport
from splitedge.runtime.downlink import DownlinkEncoder
from splitedge.runtime.guard import RoundGuard
from splitedge.runtime.node import Node
from splitedge.runtime.parts import PartHost
from splitedge.runtime.router import cloud_router
from splitedge.runtime.session import clear_retained
from splitedge.runtime.mods import ModChain, plugin_mods
from splitedge.runtime.mods.budgets import Failures
from splitedge.runtime.mods.costs import CloudCosts
from splitedge.runtime.mods.crash import CrashPoints
from splitedge.runtime.mods.releases import Accounting

__all__ = ["CloudCoordinator", "CloudSettings"]

log = logging.getLogger(__name__)


class CloudCoordinator(Node[CloudPart[Any]]):
    """The cloud's node: it takes the edges' messages and routes the part's, and hands the rest to
    its edges (membership, presence, placement), its driver (rounds) and its committer (state)."""

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
        self.host = host(lambda method: method.cloud_part(CloudContext(
            node_id=node_id, method=method, rng=self.rng, test=test, rounds=settings.rounds,
            out_dir=settings.out_dir, run=run, view=self.view, compute=settings.compute)),
            rng=self.rng, stopped=self.stopped, name="cloud")
        self.host.ensure(settings.method, settings.config.to_wire())  # registers the method's kinds
        self.method = self.part.method
        self.edges = CloudEdges(self.view, settings, self._dispatch_until, self._assign)  # who is there, and where
        # what cuts across its rounds (runtime/mods): costs, privacy spent, failures, the owner's own, crash points
        self.mods = ModChain([CloudCosts(), Accounting(self), Failures(self.guard), *plugin_mods(self, "cloud"),
                              CrashPoints("cloud")])
        self.committer = Committer(self)  # its records, run folder and resume state
        self.driver = RoundDriver(self)  # the rounds, and their calibration phases
        self.calibration = self.driver.calibration
        self.resumed = resume_from
        self.downlink = DownlinkEncoder.of(self.method.config, seed=settings.seed)  # models to every device
        if resume_from is not None:
            self.committer.restore(resume_from)

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

    def handle(self, topic: str, env: Envelope) -> None:
        if parse(topic).tier != "edge" or self.edges.heard(env, self.node_id):  # membership, presence
            return
        if env.sender in self.view.members and self.current(env) and self.accepts(self.part, env, "child"):
            if env.kind == "done":
                self.edges.note_left(env.sender, done_info(env.body.get("info")))
            self.part.on_edge_message(env)
            self.driver.rounds.add(env)

    def _dispatch_until(self, done: Callable[[], bool], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not done() and time.monotonic() < deadline:
            self.dispatch(self.next_event(min(0.5, max(0.0, deadline - time.monotonic()))))

    def _assign(self, device: str, body: dict[str, Any]) -> None:
        self.send(self.transport, "down", "assign", body, retain=True, to=device)

    # -- what callers read (the run, sims, the metrics endpoint, tests) -------------------------
    def run(self) -> list[dict[str, Any]]:
        """All rounds, then the stop announcement; returns the per-round metrics."""
        return self.driver.run()

    def plan(self, r: int, participants: tuple[str, ...] = ()) -> RoundPlan:
        return round_plan(self, r, participants)

    def online_devices(self) -> set[str]:
        return self.edges.online_devices()

    live = property(lambda self: self.edges.live)
    left = property(lambda self: self.edges.left, doc="Node -> why it left the run (for the run's summary).")
    history = property(lambda self: self.committer.history, doc="The committed rounds' records.")

