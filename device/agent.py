"""The device agent: holds only its own data, runs its method part, talks to its edge.

Subscribes to its edge's downlink (round announcements, global models) and to its own
per-device topic; publishes `hello` (retained) and a last-will `status` so the edge knows who
is alive. All learning happens in the method's device part; this loop only sequences it.

A part that must wait for its edge in the middle of a round (SplitFed: activations up,
gradients back) finds `request` in `ctx.extra["request"]`; events that arrive meanwhile are
deferred and handled, in order, after the round.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any

import numpy as np

from splitedge.methods.registry import get_method
from splitedge.methods.strategy import DONE, DevicePart, Message, NodeContext, RoundPlan
from splitedge.protocol.codec import Envelope
from splitedge.protocol.node import Node
from splitedge.protocol.topics import pattern
from splitedge.protocol.transport import Transport

log = logging.getLogger(__name__)

REQUEST_POLL_S = 0.5  # how often a waiting `request` checks whether the agent was stopped


class DeviceAgent(Node):
    def __init__(self, transport: Transport, *, run: str, node_id: str, edge: str,
                 data: tuple[np.ndarray, np.ndarray], backend: Any = "torch", seed: int = 0) -> None:
        super().__init__(run=run, tier="device", node_id=node_id)
        self.transport, self.edge, self.data, self.backend = transport, edge, data, backend
        self.rng = self.seeded_rng(seed)
        self.part: DevicePart | None = None
        self.method: str | None = None
        self.pending: RoundPlan | None = None
        self.early: list[Envelope] = []  # models that arrived before the first round created the part
        self.last_round = 0
        self.stopped = threading.Event()
        self.deferred: collections.deque[tuple[str, Envelope]] = collections.deque()
        self.stale_replies = 0

    def start(self) -> None:
        self.transport.subscribe(pattern(self.run_id, "edge", self.edge, "down"), self.enqueue)
        self.transport.subscribe(pattern(self.run_id, "device", self.node_id, "down"), self.enqueue)
        classes = np.unique(self.data[1]).astype(np.int64)
        backend = self.backend if isinstance(self.backend, str) else getattr(self.backend, "name", "custom")
        hello = {"role": "device", "parent": self.edge, "samples": int(len(self.data[1])),
                 "backend": backend, "classes": classes}
        self.send(self.transport, "up", "hello", hello, round_=0, retain=True)
        self.send(self.transport, "up", "status", {"state": "online", "role": "device"}, round_=0, retain=True)

    def run_forever(self, poll: float = 0.5) -> None:
        """Process events until the cloud announces the end of the run (or stop() is called)."""
        while not self.stopped.is_set():
            self.dispatch(self.next_event(poll))

    def stop(self) -> None:
        self.stopped.set()

    def next_event(self, timeout: float) -> tuple[str, Envelope] | None:
        """Events deferred during a round's `request` calls come first, in arrival order."""
        if self.deferred:
            return self.deferred.popleft()
        return super().next_event(timeout)

    def request(self, msg: Message, reply_kind: str, timeout: float) -> Envelope:
        """Publish `msg` and block until the edge's `reply_kind` for this round (and the same
        `batch`, when the body has one) arrives; TimeoutError otherwise, which fails the round.

        Runs on the agent thread inside `run_round`, so it reads the inbox itself: any other
        event is deferred for after the round, and a reply to an earlier (timed-out) request
        is dropped and counted.
        """
        self._publish(msg)
        batch = msg.body.get("batch")
        deadline = time.monotonic() + timeout
        while (remaining := deadline - time.monotonic()) > 0:
            if self.stopped.is_set():
                raise TimeoutError(f"device {self.node_id}: stopped while waiting for {reply_kind}")
            event = super().next_event(min(remaining, REQUEST_POLL_S))
            if event is None:
                continue
            env = event[1]
            if env.kind != reply_kind:
                self.deferred.append(event)
            elif env.round == self.round and env.body.get("batch") == batch:
                return env
            else:
                self.stale_replies += 1
        raise TimeoutError(f"device {self.node_id}: no {reply_kind} for round {self.round} batch {batch} "
                           f"within {timeout:.1f} s")

    def handle(self, topic: str, env: Envelope) -> None:
        if env.kind == "round":
            self._on_round(RoundPlan.from_body(env.round, env.body))
        elif not self.current(env):
            pass
        elif self.part is None:
            self.early.append(env)
        else:
            self.part.on_message(env)
        if self.pending is not None and self.part is not None and self.part.ready(self.pending):
            plan, self.pending = self.pending, None
            self._run(plan)

    def _on_round(self, plan: RoundPlan) -> None:
        session = str(plan.config.get("session", ""))
        if session and session != self.session and not plan.stop:
            self._new_session(session)
        if plan.stop:
            if self.last_round == 0 and self.pending is None:
                return  # a retained stop left over from an earlier run with this run id
            log.info("device %s: run finished at round %d", self.node_id, plan.round)
            self.stopped.set()
            return
        if plan.round <= self.last_round:
            return  # a retained announcement seen again after a reconnect
        if self.part is None or self.method != plan.method:
            ctx = NodeContext(node_id=self.node_id, config=plan.config, rng=self.rng,
                              extra={"request": self.request})
            self.part = get_method(plan.method).device_part(ctx, self.data, self.backend)
            self.method = plan.method
            for env in self.early:
                self.part.on_message(env)
            self.early.clear()
        self.pending = plan

    def _new_session(self, session: str) -> None:
        """A (re)started cloud: forget the old incarnation's part, rounds and models."""
        if self.session:
            log.info("device %s: new session %s (was %s)", self.node_id, session, self.session)
        self.session, self.part, self.method, self.pending, self.last_round = session, None, None, None, 0
        self.early = [env for env in self.early if self.current(env)]

    def _run(self, plan: RoundPlan) -> None:
        self.round = self.last_round = plan.round
        sent_done = False
        try:
            for item in self.part.run_round(plan):
                if item is DONE and not sent_done:
                    self.send(self.transport, "up", "done", {"phase": "round", "info": self.part.round_info()})
                    sent_done = True
                elif item is not DONE:
                    self._publish(item)
        finally:  # even a failed round tells the edge not to wait for us
            if not sent_done:
                self.send(self.transport, "up", "done", {"phase": "round", "info": {"failed": True}})

    def _publish(self, msg: Message) -> None:
        self.send(self.transport, "up", msg.kind, msg.body, retain=msg.retain, topic_kind=msg.topic_kind)
