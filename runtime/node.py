"""What every role runtime shares: an inbox fed by transport handlers, the node's inbound
chain, addressed publishing through its router, and the signs of life a person watches.

Transport handlers run on the network thread and must stay short, so they only enqueue; the
runtime's own thread takes events off the inbox and does the work (training may take minutes).
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
import zlib
from typing import Any, Mapping

import numpy as np

from splitedge.methods.contract import Message, RoundFailed
from splitedge.protocol.codec import Envelope
from splitedge.protocol.done import DoneInfo
from splitedge.protocol.topics import topic
from splitedge.protocol.transport import Transport
from splitedge.runtime.allowance import Allowance
from splitedge.runtime.inbound import Inbound, NodeInbound, carries_session
from splitedge.runtime.parts import Misfit, PartHost
from splitedge.runtime.rounds import done_phase
from splitedge.runtime.router import Router

log = logging.getLogger(__name__)
status = logging.getLogger("splitedge.status")
"""Signs of life a person watches (started, joined, round k/N, stopped): the CLI prints them as
plain lines whatever the log level; a library user sees them as ordinary INFO records."""


def topic_kind(kind: str, slot: str | None) -> str:
    """The kind segment of a topic: ``<kind>``, or ``<kind>-<slot>`` for a latest-value message."""
    return kind if slot is None else f"{kind}-{slot}"


INTERRUPTED = "interrupted"
"""The stop directive of a cloud that was interrupted (Ctrl-C, SIGTERM): the last round it
finished. Nodes do not log the run as finished (on_interrupted)."""

EXIT_INTERRUPTED = 75
"""A node's exit status when its cloud was interrupted (EX_TEMPFAIL): not 0, so a unit with
Restart=on-failure starts it again to wait for the resumed cloud."""

QUIET_WARN_S = 8.0
"""How long an edge or device may hear nothing at all before it says, once, what it waits for:
under a broker ACL a wrong --run is silence, not an error (the broker drops what it may not see)."""
WAITING_FOR = {"edge": "its devices' hellos and its cloud's round", "device": "its edge's round or its peers"}

IDLE_WAKE_S = 30.0
"""The longest a loop with nothing timed to do blocks on an empty inbox (idle_wait): a safety
net only, since stop() wakes it."""

WAKE: Any = ("", None)
"""What stop() puts in the inbox to wake a blocked loop; next_event hands back None for it."""


class Node:
    """A named participant of a run, publishing under `splitedge/<run>/<tier>/<id>/...`."""

    router: Router
    host: PartHost

    def __init__(self, *, run: str, tier: str, node_id: str, quiet_warn_s: float | None = QUIET_WARN_S) -> None:
        self.run_id, self.tier, self.node_id = run, tier, node_id
        self.held_stop: str | None = None  # what a node that found a stop before any round waits for (hold_stop)
        self.inbox: "queue.Queue[tuple[str, Envelope]]" = queue.Queue()
        self.round = 0
        self.completed = 0  # training phases an edge or device finished in this process (runtime/metrics_http.py)
        self.errors = 0  # events whose handling raised; logged, counted, the loop goes on
        self.busy = False  # handling an event now (a sim's round snapshot waits for every node to be idle)
        self.session = ""  # the cloud's run incarnation, learnt from the round announcement
        self.inbound = NodeInbound(f"{tier} {node_id}", lambda: self.session)
        self.gate: Any = None  # what head statistics must fit while a calibration phase is open
        self.stopped = threading.Event()
        self.fatal: str | None = None  # why this node cannot take part in the run (it has stopped)
        self.interrupted: int | None = None  # the round after which the cloud was interrupted (on_interrupted)
        self.logs_fatal = True  # False: the caller prints `fatal` itself (a role's CLI: one line, not two)
        self._quiet_since: float | None = 0.0  # 0 before the first wait, then its start; None once heard (or warned)
        self.quiet_warn_s = quiet_warn_s  # None: no such warning (a sim's own broker has no ACL)

    @property
    def part(self) -> Any:
        """The method part this node runs now (its host may rebuild it between rounds)."""
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
        self.inbox.put(WAKE)

    def idle_wait(self, poll: float) -> float:
        """How long a loop with nothing timed to do may block on its inbox: `poll` while the
        quiet warning may still come due, else IDLE_WAKE_S (stop() wakes it at once). Thousands
        of devices in one process each waking every `poll` seconds kept its cores busy switching
        threads: 10,000 devices did not all start."""
        return poll if self._quiet_since is not None and self.quiet_warn_s is not None else IDLE_WAKE_S

    def seeded_rng(self, seed: int) -> np.random.Generator:
        """Per-node randomness that is the same in every process (str hash() is salted per process)."""
        return np.random.default_rng([seed, zlib.crc32(self.node_id.encode())])

    def topic(self, direction: str, kind: str, to: str | None = None) -> str:
        return topic(self.run_id, self.tier, self.node_id, direction, kind, to)

    def enqueue(self, topic_: str, env: Envelope) -> None:
        """Transport handler: hand the message to the runtime thread."""
        self.inbox.put((topic_, env))

    def next_event(self, timeout: float) -> tuple[str, Envelope] | None:
        try:
            event = self.inbox.get(timeout=max(0.0, timeout))
        except queue.Empty:
            self._check_quiet()
            return None
        if event is WAKE:  # stop() woke the loop
            return None
        self._quiet_since = None
        return event

    def _check_quiet(self) -> None:
        """One warning when an edge or device has received nothing QUIET_WARN_S after it started
        waiting, naming the run it uses: the usual cause is a --run that the broker's ACL does not
        grant (it defaults to "default"), which otherwise looks like waiting for ever."""
        if self._quiet_since is None or self.quiet_warn_s is None or self.tier not in WAITING_FOR:
            return
        now = time.monotonic()
        if not self._quiet_since:
            self._quiet_since = now
        elif now - self._quiet_since >= self.quiet_warn_s:
            self._quiet_since = None
            log.warning("%s %s: nothing received %.0f s after connecting; still waiting for %s (as expected while "
                        "they start). If it lasts: under a broker ACL (splitedge data split --acl) a login may use "
                        "only its run's topics: this %s uses run %r, and its --run must match the cloud's",
                        self.tier, self.node_id, self.quiet_warn_s, WAITING_FOR[self.tier], self.tier, self.run_id)

    # -- a retained stop found at start ----------------------------------------------------
    def hold_stop(self, session: str) -> None:
        """A retained stop of a finished run before this node saw any round. A node cannot tell
        whether it came too late for that run or early for a new run under the same id (run ids
        are reused: the broker's ACL names them), so it waits for the new run: its cloud clears
        the old stop and announces its first round, which this node then takes part in, in
        whichever order the nodes started. Leaving instead (exit 0) left a systemd unit stopped
        for good and the new cloud waiting for nodes that had gone."""
        if self.held_stop != "new run":
            self.held_stop = "new run"
            status.info("%s %s: run %s finished earlier (its stop, session %s, is retained); waiting for a new run "
                        "with this id: its cloud clears the stop and announces round 1 (Ctrl-C leaves)", self.tier,
                        self.node_id, self.run_id, session)

    def follow_session(self, plan: Any) -> None:
        """A round of another session: the cloud (re)started, so `_new_session` forgets the old one."""
        if plan.session and plan.session != self.session and not plan.stop:
            if self.session:
                log.info("%s %s: new session %s (was %s)", self.tier, self.node_id, plan.session, self.session)
            self._new_session(plan.session)

    def _new_session(self, session: str) -> None:
        self.session, self.gate = session, None
        self.host.reset()

    def on_stop(self, plan: Any, *, started: bool, done: str) -> str | None:
        """A round announcement that is the run's stop: "finished" (the node stops), "held" (a
        retained stop found before any round: the node waits, see hold_stop), "interrupted" (the cloud was
        interrupted: on_interrupted) or None (a round: any held stop is dropped). `done` ends the
        finished line (e.g. " after round 4")."""
        if not plan.stop:
            self.held_stop = self.interrupted = None
            return None
        reason = plan.directives.get("reason")
        if INTERRUPTED in plan.directives:  # Ctrl-C or SIGTERM on the cloud: the run did not finish
            return self.on_interrupted(int(plan.directives[INTERRUPTED] or 0), started=started)
        if not started and not reason:
            self.hold_stop(plan.session)  # the run is over, or a new one with this id is starting
            return "held"
        status.info("%s %s: run finished%s", self.tier, self.node_id, f": {reason}" if reason else done)
        self.stopped.set()
        return "finished"

    def on_interrupted(self, after: int, *, started: bool) -> str:
        """The cloud's stop after an interrupt (PROTOCOL.md, "The stop announcement"): a node
        that took part leaves with EXIT_INTERRUPTED (a unit with Restart=on-failure starts it
        again); one that finds it before any round (restarted, or started late) waits for the
        cloud to resume, which announces its next round on the same topic."""
        self.interrupted = after
        if not started:
            if self.held_stop != "resume":
                self.held_stop = "resume"  # the resumed cloud's round clears it
                status.info("%s %s: the cloud was interrupted after round %d; waiting for it to resume", self.tier,
                            self.node_id, after)
            return "held"
        status.info("%s %s: the cloud was interrupted after round %d (the run is not over); leaving with exit "
                    "status %d: restart this %s to take part when the cloud resumes (a unit with "
                    "Restart=on-failure does)", self.tier, self.node_id, after, EXIT_INTERRUPTED, self.tier)
        self.stopped.set()
        return "interrupted"

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
