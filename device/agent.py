"""The device agent: holds only its own data, runs its method part, talks to its edge and peers.

Reads its edge's downlink (round announcements, models for every device, for this device or
for one of its groups) and its peers' peer topics; publishes `hello` (retained, and a copy
addressed to its edge) and a last-will `status` so the edge knows who is alive. The cloud may move it to another edge, put
it in groups or give it peers with an `assign` message: it then re-subscribes and says hello
to its new edge, without a restart. All learning happens in the method's device part; this
loop only sequences it.

A *virtual* device (`slots`, a simulation's pool of training slots) holds its part only while
it works on a round: between rounds the part's state is kept as bytes (methods.snapshot, float
arrays as float16 when `park_dtype` is "f2") and the torch objects are dropped, so a process
holding thousands of devices needs the memory of only as many parts as it has slots. Messages
for the part that arrive while it is parked wait, in order, until the next round takes it back.

A part that must wait in the middle of a round finds two services in its context:
`request(message, reply_kind, timeout)` (SplitFed: activations up, gradients back) and
`gather(kind, senders, timeout)` (peer messages of this round). Events that arrive meanwhile
are deferred and handled, in order, after the round.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any, Iterable

import numpy as np

from splitedge.methods.data.local import fits_model
from splitedge.methods.registry import create_method
from splitedge.methods.contract import DONE, DevicePart, Message, NodeContext, Placement, RoundPlan
from splitedge.protocol.codec import Envelope
from splitedge.runtime.node import Node, status, topic_kind
from splitedge.protocol.topics import THIN_BACKEND, THIN_DEVICES, parse, pattern
from splitedge.protocol.transport import Transport

log = logging.getLogger(__name__)

REQUEST_POLL_S = 0.5  # how often a waiting `request` or `gather` checks whether the agent was stopped


class DeviceAgent(Node):
    def __init__(self, transport: Transport, *, run: str, node_id: str, edge: str,
                 data: tuple[np.ndarray, np.ndarray], backend: Any = "torch", seed: int = 0,
                 slots: threading.Semaphore | None = None, park_dtype: str = "f4") -> None:
        super().__init__(run=run, tier="device", node_id=node_id)
        self.transport, self.data, self.backend = transport, data, backend
        self.placement = Placement(edge=edge)
        self.rng = self.seeded_rng(seed)
        self.part: DevicePart | None = None
        self.config: tuple[str, dict] | None = None  # (method, wire config) the part was built with
        self.pending: RoundPlan | None = None
        self.last_round = 0
        self.last_attempt = 0  # of the last round done: a resumed cloud announces a done round again, higher
        self.stopped = threading.Event()
        self.deferred: collections.deque[tuple[str, Envelope]] = collections.deque()
        self.stale_replies = 0
        self.peer_box: dict[tuple[int, str], dict[str, Envelope]] = {}  # (round, kind) -> sender -> message
        self.subscribed: set[str] = set()
        self.fatal: str | None = None  # why this device cannot take part in the run (it stops)
        self.slots, self.park_dtype = slots, park_dtype  # virtual device: see the module docstring
        self.parked: bytes | None = None  # the part's state between rounds (virtual device)
        self.held_slot = False
        self.parked_events: list[tuple[str, Envelope]] = []

    @property
    def edge(self) -> str:
        return self.placement.edge

    @property
    def backend_name(self) -> str:
        """What the hello names: "torch", "onnx" (a thin device: it also reads `@thin` graphs) or a
        custom backend's name."""
        return self.backend if isinstance(self.backend, str) else getattr(self.backend, "name", "custom")

    # -- wiring ----------------------------------------------------------------------------
    def _filters(self) -> set[str]:
        """Control topics always; data topics (its edge's downlink for all, for this device, for
        its groups, and its peers') once a method is loaded, so the method's kinds decode."""
        e, me = self.edge, self.node_id
        out = {pattern(self.run_id, "edge", e, "down", "round"), pattern(self.run_id, "edge", e, "down", "assign", to=me),
               pattern(self.run_id, "edge", e, "up", "status")}
        if self.part is not None or self.parked is not None:
            out |= {pattern(self.run_id, "edge", e, "down"), pattern(self.run_id, "edge", e, "down", to=me),
                    *(pattern(self.run_id, "edge", e, "down", to=f"@{g}") for g in self.placement.groups)}
            if self.backend_name == THIN_BACKEND:
                out.add(pattern(self.run_id, "edge", e, "down", to=THIN_DEVICES))
            for p in self.placement.peers:
                out |= {pattern(self.run_id, "device", p, "peer"), pattern(self.run_id, "device", p, "peer", to=me)}
        return out

    def _sync_subscriptions(self, fresh: bool = False) -> None:
        wanted = self._filters()
        stale = self.subscribed if fresh else self.subscribed - wanted
        for f in sorted(stale):
            self.transport.unsubscribe(f)
        for f in sorted(wanted - (set() if fresh else self.subscribed)):
            self.transport.subscribe(f, self.enqueue)
        self.subscribed = wanted

    def start(self) -> None:
        self._sync_subscriptions()
        self._hello()
        self.announce_online(self.transport)
        status.info("device %s: up with %d images (run %s), waiting for edge %s's round", self.node_id,
                    len(self.data[1]), self.run_id, self.edge)

    def _hello(self) -> None:
        classes = np.unique(self.data[1]).astype(np.int64)
        hello = {"role": "device", "parent": self.edge, "samples": int(len(self.data[1])), "backend": self.backend_name,
                 "classes": classes, "groups": list(self.placement.groups)}
        # twice, one message id: on `up/hello`, the latest word on where it is, which only the
        # edges holding it as a member read; and addressed to its edge, which joins it by that
        # copy (on one broker, a wildcard on every hello had every edge read every device's)
        env = self.send(self.transport, "up", "hello", hello, round_=0, retain=True)
        self.transport.publish(self.topic("up", "hello", self.edge), env, qos=1, retain=True)

    def run_forever(self, poll: float = 0.5) -> None:
        """Process events until the cloud announces the end of the run (or stop() is called)."""
        while not self.stopped.is_set():
            self.dispatch(self.next_event(poll))
            if self.held_stop_due():
                self.stopped.set()

    def stop(self) -> None:
        self.stopped.set()

    def next_event(self, timeout: float) -> tuple[str, Envelope] | None:
        """Events deferred during a round's `request`/`gather` calls come first, in arrival order."""
        if self.deferred:
            return self.deferred.popleft()
        return super().next_event(timeout)

    # -- services for parts ------------------------------------------------------------------
    def _wait(self, what: str, timeout: float, take: Any) -> bool:
        """Read the inbox until `take(topic, env)` says it is done (True), or `timeout`; other
        events are deferred for after the round."""
        deadline = time.monotonic() + timeout
        while (remaining := deadline - time.monotonic()) > 0:
            if self.stopped.is_set():
                raise TimeoutError(f"device {self.node_id}: stopped while waiting for {what}")
            event = super().next_event(min(remaining, REQUEST_POLL_S))
            if event is not None and take(*event):
                return True
        return False

    def request(self, msg: Message, reply_kind: str, timeout: float) -> Envelope:
        """Publish `msg` and block until the edge's `reply_kind` for this round (and the same
        `batch`, when the body has one) arrives; TimeoutError otherwise, which fails the round."""
        self.publish(msg)
        batch = msg.body.get("batch")
        found: list[Envelope] = []

        def take(topic: str, env: Envelope) -> bool:
            if env.kind != reply_kind:
                self.deferred.append((topic, env))
            elif env.round != self.round or env.body.get("batch") != batch:
                self.stale_replies += 1
            elif self.accepts(self.part, env, "parent"):
                found.append(env)
                return True
            return False

        if not self._wait(reply_kind, timeout, take):
            raise TimeoutError(f"device {self.node_id}: no {reply_kind} for round {self.round} batch {batch} "
                               f"within {timeout:.1f} s")
        return found[0]

    def gather(self, kind: str, senders: Iterable[str] | None = None, timeout: float = 60.0) -> dict[str, Envelope]:
        """This round's `kind` messages from `senders` (default: every peer), waiting until all
        arrived or `timeout`; a missing peer is left out, never waited for past the timeout."""
        want = set(self.placement.peers if senders is None else senders)
        box = self.peer_box.setdefault((self.round, kind), {})

        def take(topic: str, env: Envelope) -> bool:
            if parse(topic).direction == "peer":
                self._on_peer(env)
            else:
                self.deferred.append((topic, env))
            return want <= set(box)

        if not want <= set(box):
            self._wait(f"{kind} from peers", timeout, take)
        missing = sorted(want - set(box))
        if missing:
            log.info("device %s: round %d without %s from %s", self.node_id, self.round, kind, missing)
        return {s: box[s] for s in sorted(want & set(box))}

    # -- events ----------------------------------------------------------------------------
    def handle(self, topic: str, env: Envelope) -> None:
        where = parse(topic)
        if where.tier == "edge" and where.node_id != self.edge:
            return  # the downlink of an edge we left
        if self.parked is not None and env.kind not in ("status", "round", "assign"):
            self.parked_events.append((topic, env))  # for the part: handled once a round takes it back
            return
        if env.kind == "status" and where.tier == "edge":
            self.on_parent_status(env.body["state"])
        elif env.kind == "round":
            self._on_round(RoundPlan.from_body(env.round, env.body))
        elif env.kind == "assign":
            self._on_assign(env)
        elif where.direction == "peer":
            self._on_peer(env)
        elif self.part is not None and self.current(env) and self.accepts(self.part, env, "parent"):
            self.part.on_message(env)
        if self.pending is not None and self.part is not None and self.part.ready(self.pending):
            plan, self.pending = self.pending, None
            self._run(plan)

    def _on_peer(self, env: Envelope) -> None:
        """Keep a peer's message for the round it belongs to (a fast peer may be a round ahead)."""
        if env.sender not in self.placement.peers or env.round < self.round or not self.current(env):
            return
        if self.part is not None and not self.accepts(self.part, env, "peer"):
            return
        self.peer_box.setdefault((env.round, env.kind), {})[env.sender] = env
        for key in [k for k in self.peer_box if k[0] < self.round]:
            del self.peer_box[key]

    def _on_assign(self, env: Envelope) -> None:
        body = env.body
        new = Placement(edge=body["edge"], groups=tuple(body["groups"]), peers=tuple(body["peers"]))
        if new == self.placement:
            return
        moved = new.edge != self.edge
        status.info("device %s: placed at edge %s, groups %s, %d peer(s)", self.node_id, new.edge, list(new.groups),
                    len(new.peers))
        if moved:  # the old edge's join filter must not find this device there again
            self.transport.publish_raw(self.topic("up", "hello", self.edge), b"", retain=True)
        self.placement = new
        if self.part is not None:
            self.part.ctx.view = new
        self._sync_subscriptions(fresh=moved)  # a new edge: read its retained state from scratch
        self._hello()

    def _on_round(self, plan: RoundPlan) -> None:
        if plan.session and plan.session != self.session and not plan.stop:
            self._new_session(plan.session)
        if plan.stop:
            reason = plan.directives.get("reason")
            if self.last_round == 0 and self.pending is None and not reason:
                self.hold_stop(plan.session)  # the run is over, or a new one with this id is starting
                return
            status.info("device %s: run finished%s", self.node_id,
                        f": {reason}" if reason else f" after round {self.last_round}")
            self.stopped.set()
            return
        self.held_stop = None
        if (plan.round, plan.attempt) <= (self.last_round, self.last_attempt):
            return  # a retained announcement seen again after a reconnect or a move (a resumed cloud's has a higher attempt)
        if self.slots is not None and not self._take_slot():
            return
        if self.parked is not None:
            self._unpark()
        if self._ensure_part(plan):
            self.pending = plan
        elif self.held_slot and self.part is None:
            self._release_slot()

    def _ensure_part(self, plan: RoundPlan) -> bool:
        wanted = (plan.method, dict(plan.config))
        if self.part is not None and self.config == wanted:
            return True
        try:
            method = create_method(plan.method, plan.config)
            misfit = fits_model(self.data[0], self.data[1], method.spec)
            if misfit:  # the data will never fit this run: say so and leave, do not hold rounds open
                self.fatal = f"device {self.node_id}: {misfit}"
                log.error("%s", self.fatal)
                self.stopped.set()
                return False
            if self.part is not None and self.config[0] == plan.method and self.part.spec == method.spec:
                log.info("device %s: %s settings changed at round %d", self.node_id, plan.method, plan.round)
                self.part.reconfigure(method)
            else:
                replaced, self.part = self.part is not None, self._build_part(method)
                self._sync_subscriptions(fresh=replaced)  # another method: its retained data again, with its kinds
        except ValueError as exc:
            self.refused["config.invalid"] += 1
            log.error("device %s: cannot take round %d: %s", self.node_id, plan.round, exc)
            return False
        self.config = wanted
        return True

    def _new_session(self, session: str) -> None:
        """A (re)started cloud: forget the old incarnation's part, rounds and models."""
        if self.session:
            log.info("device %s: new session %s (was %s)", self.node_id, session, self.session)
        self.session, self.part, self.config, self.pending, self.last_round = session, None, None, None, 0
        self.last_attempt, self.parked, self.parked_events = 0, None, []
        self.peer_box.clear()

    def _run(self, plan: RoundPlan) -> None:
        self.round = self.last_round = plan.round
        self.last_attempt = plan.attempt
        self.part.losses = {}
        sent_done, started = False, time.monotonic()
        try:
            for item in self.part.run_round(plan):
                if item is DONE and not sent_done:
                    self.send(self.transport, "up", "done", {"phase": "round", "info": self._done_info()})
                    sent_done = True
                elif item is not DONE:
                    self.publish(item)
        finally:  # even a failed round tells the edge not to wait for us
            if not sent_done:
                self.send(self.transport, "up", "done", {"phase": "round", "info": {"failed": True}})
                status.info("device %s: round %d failed (see the log)", self.node_id, plan.round)
            else:
                status.info("device %s: round %d done in %.1f s", self.node_id, plan.round, time.monotonic() - started)
            if self.slots is not None:
                self._park()

    # -- virtual devices ---------------------------------------------------------------------
    def _park(self) -> None:
        """Keep the part's state as bytes, drop the part, free this device's training slot."""
        from splitedge.methods import snapshot

        state = self.part.resume_state()
        self.parked = snapshot.dumps(snapshot.cast_floats(state, "f2") if self.park_dtype == "f2" else state)
        self.part = state = None
        self._release_slot()
        from splitedge.malloc import trim

        trim()  # the dropped part's memory back to the system, not kept in malloc's arenas

    def _take_slot(self) -> bool:
        """Wait for a training slot of the pool; False when stopped meanwhile."""
        while not self.held_slot:
            if self.slots.acquire(timeout=REQUEST_POLL_S):
                self.held_slot = True
            elif self.stopped.is_set():
                return False
        return True

    def _release_slot(self) -> None:
        if self.held_slot:
            self.held_slot = False
            self.slots.release()

    def _unpark(self) -> None:
        """Rebuild the part, give it its state and, first in the inbox and in their order, the
        messages that arrived while it was parked."""
        from splitedge.methods import snapshot

        rng = self.rng.bit_generator.state  # building a part draws from it (model init): not a round's draw
        self.part = self._build_part(create_method(*self.config))
        self.part.restore_state(snapshot.loads(self.parked))
        self.rng.bit_generator.state = rng
        self.parked = None
        self.deferred.extendleft(reversed(self.parked_events))
        self.parked_events = []

    def _build_part(self, method: Any) -> DevicePart:
        ctx = NodeContext(node_id=self.node_id, method=method, rng=self.rng, view=self.placement,
                          request=self.request, gather=self.gather)
        return method.device_part(ctx, self.data, self.backend)

    def _done_info(self) -> dict[str, Any]:
        info = {**self.part.round_info(), "samples": int(len(self.data[1]))}
        if self.part.losses:
            info["loss"] = dict(self.part.losses)
        if self.refused:
            info["refused"] = dict(self.refused)
        return info

    def publish(self, msg: Message) -> None:
        """Route a part's message: up to its edge, or to its peers (all, or one)."""
        role, node = msg.to.role, msg.to.node
        if role == "up":
            direction, to = "up", None
        elif role == "peers":
            direction, to = "peer", None
        elif role == "peer" and node:
            direction, to = "peer", node
        else:
            raise ValueError(f"a device cannot send to {msg.to}")
        self.send(self.transport, direction, msg.kind, msg.body, retain=msg.slot is not None,
                  topic_kind=topic_kind(msg.kind, msg.slot), to=to)
