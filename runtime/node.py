"""What every role runtime shares: an inbox fed by transport handlers (runtime/inbox.py), the
node's inbound chain, its reading of stop announcements (runtime/stopping.py), addressed
publishing through its router, and the signs of life a person watches.
"""

from __future__ import annotations

import collections
import logging
import threading
import zlib
from typing import Any, Generic, Mapping

import numpy as np

from splitedge.methods.contract import Message, RoundFailed
from splitedge.protocol.codec import Envelope
from splitedge.protocol.done import DoneInfo
from splitedge.protocol.topics import topic
from splitedge.protocol.transport import Transport
from splitedge.runtime.allowance import Allowance
from splitedge.runtime.inbound import Inbound, NodeInbound, carries_session
from splitedge.runtime.inbox import QUIET_WARN_S, Inbox
from splitedge.runtime.parts import Misfit, P, PartHost
from splitedge.runtime.rounds import done_phase
from splitedge.runtime.router import Router
from splitedge.runtime.stopping import Stops

log = logging.getLogger(__name__)
status = logging.getLogger("splitedge.status")
"""Signs of life a person watches (started, joined, round k/N, stopped): the CLI prints them as
plain lines whatever the log level; a library user sees them as ordinary INFO records."""


def topic_kind(kind: str, slot: str | None) -> str:
    """The kind segment of a topic: ``<kind>``, or ``<kind>-<slot>`` for a latest-value message."""
    return kind if slot is None else f"{kind}-{slot}"


class Node(Generic[P]):
    """A named participant of a run, publishing under `splitedge/<run>/<tier>/<id>/...`; `P` the
    part its tier runs (DevicePart, EdgePart, CloudPart)."""

    router: Router
    host: PartHost[P]

    def __init__(self, *, run: str, tier: str, node_id: str, quiet_warn_s: float | None = QUIET_WARN_S) -> None:
        self.run_id, self.tier, self.node_id = run, tier, node_id
        self.inbox = Inbox(tier, node_id, run, quiet_warn_s)
        self.stops = Stops(self)  # the run's stop announcements: finished, held, interrupted
        self.round = 0
        self.completed = 0  # training phases an edge or device finished in this process (runtime/metrics_http.py)
        self.errors = 0  # events whose handling raised; logged, counted, the loop goes on
        self.busy = False  # handling an event now (a sim's round snapshot waits for every node to be idle)
        self.session = ""  # the cloud's run incarnation, learnt from the round announcement
        self.inbound = NodeInbound(f"{tier} {node_id}", lambda: self.session)
        self.gate: Any = None  # what head statistics must fit while a calibration phase is open
        self.stopped = threading.Event()
        self.fatal: str | None = None  # why this node cannot take part in the run (it has stopped)
        self.logs_fatal = True  # False: the caller prints `fatal` itself (a role's CLI: one line, not two)

    @property
    def part(self) -> P | None:
        """The method part this node runs now (its host may rebuild it between rounds); None
        before a round announcement named a method."""
        return self.host.part

    @property
    def refused(self) -> collections.Counter[str]:
        """rule -> messages refused before they reached the part (runtime/inbound.py)."""
        return self.inbound.refused

    @property
    def foreign(self) -> int:
        """Messages of another incarnation of the run, dropped."""
        return self.inbound.foreign

    def current(self, env: Envelope) -> bool:
        """False (and counted) for stateful messages of another incarnation of this run."""
        return self.inbound.current(env)

    def accepts(self, part: Any, env: Envelope, source: str, *, announced: Allowance | None = None) -> bool:
        """Whether `part` takes a message from its "parent", a "child" or a "peer" (the node's
        inbound chain: session, what the child may count, the part's own check)."""
        return self.inbound.admit(Inbound(env, source, part, announced, self.gate))

    def handle(self, topic_: str, env: Envelope) -> None:
        raise NotImplementedError

    def dispatch(self, event: tuple[str, Envelope] | None) -> None:
        """Handle one inbox event; an exception is logged and counted, never kills the runtime."""
        if event is None:
            return
        self.busy = True
        try:
            self.handle(*event)
        except RoundFailed as exc:  # a known failure (e.g. training diverged): its message says it all
            self.errors += 1
            log.error("%s %s: handling %s from %s failed: %s", self.tier, self.node_id, event[1].kind,
                      event[1].sender, exc)
        except Exception:
            self.errors += 1
            log.exception("%s %s: handling %s from %s failed", self.tier, self.node_id, event[1].kind,
                          event[1].sender)
        finally:
            self.busy = False

    @property
    def idle(self) -> bool:
        """Nothing queued and nothing being handled (a sim's round snapshot waits for this)."""
        return not self.busy and (self.inbox.empty() or self.stopped.is_set())

    def stop(self) -> None:
        """From any thread: the loop ends, woken at once if it is blocked on an empty inbox."""
        self.stopped.set()
        self.inbox.wake()

    def idle_wait(self, poll: float) -> float:
        """How long a loop with nothing timed to do may block on its inbox (runtime/inbox.py)."""
        return self.inbox.idle_wait(poll)

    def seeded_rng(self, seed: int) -> np.random.Generator:
        """Per-node randomness that is the same in every process (str hash() is salted per process)."""
        return np.random.default_rng([seed, zlib.crc32(self.node_id.encode())])

    def topic(self, direction: str, kind: str, to: str | None = None) -> str:
        return topic(self.run_id, self.tier, self.node_id, direction, kind, to)

    def enqueue(self, topic_: str, env: Envelope) -> None:
        """Transport handler: hand the message to the runtime thread."""
        self.inbox.put(topic_, env)

    def next_event(self, timeout: float) -> tuple[str, Envelope] | None:
        return self.inbox.get(timeout)

    def follow_session(self, plan: Any) -> None:
        """A round of another session: the cloud (re)started, so `_new_session` forgets the old one."""
        if plan.session and plan.session != self.session and not plan.stop:
            if self.session:
                log.info("%s %s: new session %s (was %s)", self.tier, self.node_id, plan.session, self.session)
            self._new_session(plan.session)

    def _new_session(self, session: str) -> None:
        self.session, self.gate = session, None
        self.host.reset()

    def ensure_part(self, plan: Any) -> str | None:
        """The host's part for the announced method and config (runtime/parts.py): its outcome,
        or None (counted as `config.invalid`, logged) when the announcement cannot be used. On
        a Misfit (data that never fits the model, a backend or install without the method's
        part) the node says why once in `fatal` and stops: holding rounds open for it helps no one."""
        try:
            outcome = self.host.ensure(plan.method, plan.config)
        except Misfit as exc:
            self.fatal = f"{self.tier} {self.node_id}: {exc}"
            (log.error if self.logs_fatal else log.info)("%s", self.fatal)
            self.stopped.set()
            return None
        except ValueError as exc:
            self.refused["config.invalid"] += 1
            log.error("%s %s: cannot take round %d: %s", self.tier, self.node_id, plan.round, exc)
            return None
        if outcome == "reconfigured":
            log.info("%s %s: %s settings changed at round %d", self.tier, self.node_id, plan.method, plan.round)
        return outcome

    # -- sending ---------------------------------------------------------------------------
    def announce_online(self, transport: Transport) -> None:
        """Retained `status: online`, published again by the transport after every reconnect."""
        env = Envelope(kind="status", run=self.run_id, round=0, sender=self.node_id,
                       body={"state": "online", "role": self.tier})
        transport.publish_birth(self.topic("up", "status"), env)

    def say_left(self, transport: Transport, plan: Any) -> None:
        """After a Misfit (`fatal`): the round's `done` with the reason (`info.left`), so the
        parent stops waiting for this node at once and can say why it left."""
        if self.fatal:
            self.send(transport, "up", "done", {"phase": done_phase(plan.phase),
                                                "info": DoneInfo(failed=True, left=self.fatal[:300]).to_info()},
                      round_=plan.round)

    def send(self, transport: Transport, direction: str, kind: str, body: Mapping[str, Any], *,
             round_: int | None = None, retain: bool = False, topic_kind: str | None = None,
             to: str | None = None) -> Envelope:
        """Wrap `body` in an envelope from this node and publish it (QoS 1) on this node's topic
        for `direction`, addressed to node or group `to` when given."""
        if self.session and "session" not in body and carries_session(kind):
            body = {**body, "session": self.session}
        env = Envelope(kind=kind, run=self.run_id, round=self.round if round_ is None else round_,
                       sender=self.node_id, body=body)
        transport.publish(self.topic(direction, topic_kind or kind, to), env, qos=1, retain=retain)
        return env

    def publish(self, msg: Message, round_: int | None = None) -> Envelope:
        """Send a part's message where its address says (the tier's router), a slot's latest
        value retained for nodes that join later."""
        route = self.router.route(msg.to)
        return self.send(route.transport, route.direction, msg.kind, msg.body, round_=round_,
                         retain=msg.slot is not None, topic_kind=topic_kind(msg.kind, msg.slot), to=route.to)

    def publish_all(self, messages: list[Message], round_: int | None = None) -> None:
        for msg in messages:
            self.publish(msg, round_=round_)

    def rejections(self, transports: list[Transport]) -> dict[str, int]:
        """Messages this node dropped so far, by rule: malformed on any of its transports,
        refused before they reached its part."""
        out = collections.Counter(self.refused)
        for transport in {id(t): t for t in transports}.values():
            out.update(transport.rejected)
        return dict(out)
