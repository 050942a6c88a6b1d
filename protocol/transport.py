"""The Transport interface and an in-process loopback implementation.

Strategies and runtimes talk to a :class:`Transport`, never to MQTT, so the same code runs on
a real broker and in unit tests. The inbound path (count bytes, cap the size, check the
signature, decode, check the sender, drop duplicates, route to the matching handlers, contain
handler errors) is one chain of steps (protocol/inbound.py) that the base class runs for every
implementation, so each rejects and counts exactly alike.

:class:`LoopbackTransport` delivery is SYNCHRONOUS on the publisher's thread: ``publish()``
returns after every matching handler ran. A handler that publishes does not recurse: the new
message is queued and delivered, in order, when the current delivery returns (MQTT-like FIFO).
"""

from __future__ import annotations

import abc
import dataclasses
import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from typing import Any

from splitedge.protocol.accounting import (
    PUBACK_BYTES,
    ByteCounters,
    publish_packet_bytes,
    suback_packet_bytes,
    subscribe_packet_bytes,
    unsubscribe_packet_bytes,
)
from splitedge.protocol.codec import DEFAULT_MAX_BYTES, Envelope, encode, new_msg_id
from splitedge.protocol.errors import ProtocolError
from splitedge.protocol.inbound import WIRE_STEPS, Frame, Step, compose
from splitedge.protocol.signing import TRAILER_LEN, KeyRing, Signer, Verifier
from splitedge.protocol.topics import matches, parse, validate_filter, validate_topic_name

logger = logging.getLogger(__name__)

Handler = Callable[[str, Envelope], None]
SEEN_CACHE = 4096  # recent (topic, msg_id) pairs remembered to drop duplicate copies


def wait_for(predicate: Callable[[], Any], timeout: float = 5.0, interval: float = 0.01) -> bool:
    """Poll ``predicate`` until it is truthy or ``timeout`` passes; True when it held.

    Tests and runtimes use this instead of fixed sleeps, so they are as fast as the network.
    """
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)


def kind_of(topic: str, default: str = "raw") -> str:
    """The message kind named by a splitedge topic, or ``default`` for foreign topics."""
    try:
        return parse(topic).kind
    except ProtocolError:
        return default


class Transport(abc.ABC):
    """Publish/subscribe of validated :class:`Envelope` messages with byte accounting.

    Subscriptions are a map pattern -> (handler, qos): subscribing to the same pattern again
    replaces its handler. A message is routed to every pattern that matches its topic.
    With a ``signer`` every frame sent is signed (protocol/signing.py); with a ``keyring``
    every frame received must carry a valid, fresh signature of the node its topic names.
    """

    def __init__(self, *, role: str, client_id: str, max_bytes: int = DEFAULT_MAX_BYTES,
                 signer: Signer | None = None, keyring: KeyRing | None = None,
                 steps: Sequence[Step] = WIRE_STEPS) -> None:
        if type(max_bytes) is not int or max_bytes < 1:
            raise ValueError(f"max_bytes must be an int >= 1, got {max_bytes!r}")
        self.role = role
        self.client_id = client_id
        self.max_bytes = max_bytes
        self.signer = signer
        self.verifier = Verifier(keyring) if keyring is not None else None
        self.counters = ByteCounters(role)
        self.rejected: dict[str, int] = {}
        self.handler_errors = 0
        self._subs: dict[str, tuple[Handler, int]] = {}
        self._seen: OrderedDict[tuple[str, str], None] = OrderedDict()
        self.duplicates = 0
        self._state_lock = threading.Lock()
        self._births: dict[str, Envelope] = {}
        self._last_word: tuple[str, Envelope] | None = None  # (topic, the node's offline status)
        self._will: tuple[str, bytes] | None = None  # the will armed for the current connection
        self.inbound = compose(steps, self, self._route)

    # -- outbound -------------------------------------------------------------------------
    def publish(self, topic: str, env: Envelope, *, qos: int = 1, retain: bool = False,
                wait: float | None = None) -> None:
        """Encode (validating the body against its kind's schema) and publish.

        ``wait`` (seconds) blocks until the broker acknowledged the message (QoS 1). A frame over
        this node's own cap raises ProtocolError: a federation shares one --max-frame-bytes, so
        every receiver would drop it.
        """
        payload = self._seal(topic, encode(env, max_bytes=self._frame_cap()))
        self._publish_bytes(topic, payload, qos=qos, retain=retain, kind=env.kind, wait=wait)

    def _frame_cap(self) -> int:
        """The longest frame this node may send: its cap, less the signature trailer it adds."""
        return self.max_bytes - (TRAILER_LEN if self.signer is not None else 0)

    def _seal(self, topic: str, frame: bytes, *, will: bool = False) -> bytes:
        """The payload for ``frame`` on ``topic``: signed when this node has a key."""
        return frame if self.signer is None else self.signer.seal(topic, frame, will=will)

    # -- the last word: a will armed per connection, a clean exit's offline said fresh -----
    def _keep_last_word(self, will: tuple[str, Envelope] | None) -> None:
        """Remember the node's offline word (topic, envelope) and arm the first will from it."""
        self._last_word = (validate_topic_name(will[0]), will[1]) if will else None
        self._will = self._mint_will()

    def _mint_will(self) -> tuple[str, bytes] | None:
        """The offline word as a will payload with a msg_id (and signature) of its own. A will
        minted once and fired twice (two blips), or published again at a clean exit, would be
        the same message to every receiver, which drops the repeat as a duplicate: the node
        would stay online to them for ever. So every connection arms a fresh one."""
        if self._last_word is None:
            return None
        topic, env = self._last_word
        return topic, self._seal(topic, encode(dataclasses.replace(env, msg_id=new_msg_id())), will=True)

    def _say_offline(self, wait: float | None) -> None:
        """A clean exit's last word: the offline status, retained, as a new message (not the
        armed will's bytes, which a receiver may already have had from a will that fired)."""
        if self._last_word is not None:
            topic, env = self._last_word
            self.publish(topic, dataclasses.replace(env, msg_id=new_msg_id()), qos=1, retain=True, wait=wait)

    def publish_birth(self, topic: str, env: Envelope) -> None:
        """Publish a retained message (a node's `status: online`) now and again after every
        reconnect: a broker restart fires the node's will (offline), and without this the node
        would stay offline to everyone although it is back. Each copy gets a fresh msg_id, or
        receivers would drop it as a duplicate of the first."""
        with self._state_lock:
            self._births[topic] = env
        self.publish(topic, env, qos=1, retain=True)

    def _republish_births(self) -> None:
        with self._state_lock:
            births = list(self._births.items())
        for topic, env in births:
            self.publish(topic, dataclasses.replace(env, msg_id=new_msg_id()), qos=1, retain=True)

    def publish_raw(self, topic: str, payload: bytes, *, qos: int = 1, retain: bool = False,
                    wait: float | None = None) -> None:
        """Publish bytes as they are: for tests, and for clearing a retained message (b"")."""
        self._publish_bytes(topic, bytes(payload), qos=qos, retain=retain, kind=kind_of(topic), wait=wait)

    def _publish_bytes(self, topic: str, payload: bytes, *, qos: int, retain: bool, kind: str,
                       wait: float | None) -> None:
        validate_topic_name(topic)
        if qos not in (0, 1, 2):
            raise ValueError(f"qos must be 0, 1 or 2, got {qos!r}")
        self._send(topic, payload, qos=qos, retain=retain, wait=wait)
        self.counters.record("out", kind, len(payload), publish_packet_bytes(topic, len(payload), qos))

    @abc.abstractmethod
    def _send(self, topic: str, payload: bytes, *, qos: int, retain: bool, wait: float | None) -> None:
        """Hand one PUBLISH to the network (or the loopback bus)."""

    # -- subscriptions --------------------------------------------------------------------
    def subscribe(self, pattern: str, handler: Handler, *, qos: int = 1) -> None:
        """Route messages matching ``pattern`` to ``handler(topic, envelope)``."""
        validate_filter(pattern)
        with self._state_lock:
            self._subs[pattern] = (handler, qos)
            # retained messages re-sent for this new subscription are not duplicates
            for key in [k for k in self._seen if matches(pattern, k[0])]:
                del self._seen[key]
        if self.verifier is not None:  # ... nor replays
            self.verifier.reopen(pattern)
        self._send_subscribe(pattern, qos)

    def unsubscribe(self, pattern: str) -> None:
        """Stop routing ``pattern``; unknown patterns are ignored."""
        with self._state_lock:
            known = self._subs.pop(pattern, None) is not None
        if known:
            self._send_unsubscribe(pattern)

    @abc.abstractmethod
    def _send_subscribe(self, pattern: str, qos: int) -> None: ...

    @abc.abstractmethod
    def _send_unsubscribe(self, pattern: str) -> None: ...

    @abc.abstractmethod
    def close(self) -> None:
        """Disconnect cleanly; idempotent."""

    def wait_for(self, predicate: Callable[[], Any], timeout: float = 5.0) -> bool:
        """See :func:`wait_for`."""
        return wait_for(predicate, timeout)

    def __enter__(self) -> Transport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- inbound --------------------------------------------------------------------------
    def _on_inbound(self, topic: str, payload: bytes, qos: int) -> None:
        """Run one received PUBLISH through the inbound chain (protocol/inbound.py). Never raises.

        A bad message (too big, malformed, failing its schema, not from its topic's node) is
        logged with its rule and counted in ``rejected``; a handler that raises is logged and
        counted in ``handler_errors``. Neither may kill the network thread.
        """
        try:
            self.inbound(Frame(topic, payload, qos))
        except ProtocolError as exc:
            self._reject(topic, exc.rule, str(exc))

    def _route(self, frame: Frame) -> None:
        """The chain's last step: every handler whose pattern matches, each error contained."""
        for handler in self._handlers_for(frame.topic):
            try:
                handler(frame.topic, frame.env)
            except Exception:
                with self._state_lock:
                    self.handler_errors += 1
                logger.exception("%s: handler for %s (kind %s) raised", self.client_id, frame.topic, frame.env.kind)

    def _seen_before(self, topic: str, msg_id: str) -> bool:
        """True (and counted) for a (topic, msg_id) already routed; remembers SEEN_CACHE of them."""
        key = (topic, msg_id)
        with self._state_lock:
            if key in self._seen:
                self.duplicates += 1
                return True
            self._seen[key] = None
            if len(self._seen) > SEEN_CACHE:
                self._seen.popitem(last=False)
            return False

    def _reject(self, topic: str, rule: str, reason: str) -> None:
        with self._state_lock:
            self.rejected[rule] = self.rejected.get(rule, 0) + 1
        logger.warning("%s: rejected message on %s [%s]: %s", self.client_id, topic, rule, reason[:300])

    def _handlers_for(self, topic: str) -> list[Handler]:
        with self._state_lock:
            return [h for p, (h, _) in self._subs.items() if matches(p, topic)]

    def _subscriptions(self) -> list[tuple[str, int]]:
        with self._state_lock:
            return [(p, q) for p, (_, q) in self._subs.items()]


class LoopbackBus:
    """An in-process broker: wildcard routing, retained messages, last wills.

    Messages are delivered synchronously; re-entrant publishes (from inside a handler) are
    queued per thread and delivered in FIFO order once the outer delivery finishes.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._clients: list[LoopbackTransport] = []
        self._retained: dict[str, tuple[bytes, int]] = {}
        self._local = threading.local()

    def attach(self, client: LoopbackTransport) -> None:
        with self._lock:
            self._clients.append(client)

    def detach(self, client: LoopbackTransport) -> None:
        with self._lock:
            if client in self._clients:
                self._clients.remove(client)

    def publish(self, topic: str, payload: bytes, qos: int, retain: bool) -> None:
        """Route a message to every client with a matching subscription."""
        if retain:
            with self._lock:
                if payload:
                    self._retained[topic] = (payload, qos)
                else:  # MQTT: an empty retained payload clears the retained message
                    self._retained.pop(topic, None)
        with self._lock:
            targets = [c for c in self._clients if c.wants(topic)]
        for client in targets:
            self._enqueue(client, topic, payload, qos)

    def deliver_retained(self, client: LoopbackTransport, pattern: str) -> None:
        """MQTT sends the retained messages matching a new subscription right away."""
        with self._lock:
            hits = [(t, p, q) for t, (p, q) in self._retained.items() if matches(pattern, t)]
        for topic, payload, qos in hits:
            self._enqueue(client, topic, payload, qos)

    def _enqueue(self, client: LoopbackTransport, topic: str, payload: bytes, qos: int) -> None:
        queue: deque | None = getattr(self._local, "queue", None)
        if queue is not None:  # already delivering on this thread: keep FIFO, no recursion
            queue.append((client, topic, payload, qos))
            return
        self._local.queue = queue = deque([(client, topic, payload, qos)])
        try:
            while queue:
                target, t, p, q = queue.popleft()
                target.receive(t, p, q)
        finally:
            self._local.queue = None


class LoopbackTransport(Transport):
    """A Transport on a :class:`LoopbackBus`: same encoding, validation and byte counting as MQTT.

    Packet bytes are counted with the MQTT formulas (including SUBSCRIBE/SUBACK and PUBACK for
    QoS 1) so a strategy's bandwidth can be estimated without a broker.
    """

    def __init__(self, bus: LoopbackBus, *, role: str, client_id: str,
                 will: tuple[str, Envelope] | None = None, max_bytes: int = DEFAULT_MAX_BYTES,
                 signer: Signer | None = None, keyring: KeyRing | None = None,
                 steps: Sequence[Step] = WIRE_STEPS) -> None:
        super().__init__(role=role, client_id=client_id, max_bytes=max_bytes, signer=signer, keyring=keyring,
                         steps=steps)
        self.bus = bus
        self._keep_last_word(will)  # one connection, so one will
        self._closed = False
        bus.attach(self)

    def wants(self, topic: str) -> bool:
        with self._state_lock:
            return not self._closed and any(matches(p, topic) for p in self._subs)

    def receive(self, topic: str, payload: bytes, qos: int) -> None:
        """Called by the bus; QoS 1 costs a PUBACK like on a real broker."""
        if qos > 0:
            self.counters.record_control("out", PUBACK_BYTES, "PUBACK")
        self._on_inbound(topic, payload, qos)

    def _send(self, topic: str, payload: bytes, *, qos: int, retain: bool, wait: float | None) -> None:
        if self._closed:
            raise ConnectionError(f"{self.client_id}: transport is closed")
        if qos > 0:
            self.counters.record_control("in", PUBACK_BYTES, "PUBACK")
        self.bus.publish(topic, payload, qos, retain)

    def _send_subscribe(self, pattern: str, qos: int) -> None:
        self.counters.record_control("out", subscribe_packet_bytes([pattern]), "SUBSCRIBE")
        self.counters.record_control("in", suback_packet_bytes(1), "SUBACK")
        self.bus.deliver_retained(self, pattern)

    def _send_unsubscribe(self, pattern: str) -> None:
        self.counters.record_control("out", unsubscribe_packet_bytes([pattern]), "UNSUBSCRIBE")

    def abort(self) -> None:
        """Simulate a crash: detach without a clean disconnect, so the bus publishes the will."""
        if self._closed:
            return
        self._closed = True
        self.bus.detach(self)
        if self._will:
            topic, payload = self._will
            self.bus.publish(topic, payload, 1, True)

    def close(self, *, offline: bool = False) -> None:
        """Detach cleanly (no will). ``offline=True`` first publishes the offline status, a
        message of its own (not the will's bytes, see ``_mint_will``)."""
        if self._closed:
            return
        if offline:
            self._say_offline(wait=None)
        self._closed = True
        self.bus.detach(self)
