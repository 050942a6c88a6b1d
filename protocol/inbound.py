"""The inbound path of a transport as an ordered chain of small steps (Flower's "mods").

Every received PUBLISH becomes a `Frame` and passes the steps of `WIRE_STEPS` in order: count
its bytes, skip a retained-clear notice, cap its size, check its signature, decode it, check
that its envelope names the node its topic names, drop a copy already routed, and finally hand
it to the subscribed handlers. A step takes `(frame, transport, next)` and either calls `next`
or stops the frame; a step that refuses one raises ProtocolError naming its rule, which the
transport logs and counts in `rejected`. A step is a plain function, so a transport (or a
test) can add one, e.g. a tap that times or records frames, without touching the others.

Only the wire is judged here: what a frame may do to a node's state (its session, the samples
its sender announced, whether the method's part takes it) is the node's chain
(runtime/inbound.py), which runs on the node's own thread.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from splitedge.protocol.accounting import publish_packet_bytes
from splitedge.protocol.codec import Envelope, decode
from splitedge.protocol.errors import ProtocolError
from splitedge.protocol.signing import split_trailer
from splitedge.protocol.topics import parse


class Wire(Protocol):
    """What the steps read of the transport that runs them (protocol/transport.py's Transport)."""

    counters: Any
    max_bytes: int
    verifier: Any
    duplicates: int
    _state_lock: threading.Lock

    def _seen_before(self, topic: str, msg_id: str) -> bool: ...


@dataclass
class Frame:
    """One received PUBLISH on its way through the chain; `env` is set once it is decoded."""

    topic: str
    payload: bytes
    qos: int
    env: Envelope | None = None


Next = Callable[[Frame], None]
Step = Callable[[Frame, Wire, Next], None]


def counted_kind(topic: str) -> str:
    """The kind a frame's bytes are counted under: the message kind its topic names (which a
    valid envelope must carry), or "raw" on a foreign topic."""
    try:
        return parse(topic).message_kind
    except ProtocolError:
        return "raw"


def count_bytes(frame: Frame, t: Wire, nxt: Next) -> None:
    """Payload and MQTT packet bytes, whatever becomes of the frame (it crossed the wire)."""
    packet = publish_packet_bytes(frame.topic, len(frame.payload), frame.qos)
    t.counters.record("in", counted_kind(frame.topic), len(frame.payload), packet)
    nxt(frame)


def skip_cleared(frame: Frame, t: Wire, nxt: Next) -> None:
    """An empty payload is MQTT's "retained message cleared" notice, not a message."""
    if frame.payload:
        nxt(frame)


def cap_size(frame: Frame, t: Wire, nxt: Next) -> None:
    """Refuse a frame over the cap before anything parses it."""
    if len(frame.payload) > t.max_bytes:
        raise ProtocolError("frame.too_large", f"{len(frame.payload)} bytes > cap of {t.max_bytes}")
    nxt(frame)


def open_frame(frame: Frame, t: Wire, nxt: Next) -> None:
    """Check the signature (with a keyring: a frame not from its topic's node is refused
    before it is decoded) and decode. A signed copy of the newest frame on its topic (the
    broker re-sent it) is dropped and counted as a duplicate. Without a keyring a signature
    trailer is skipped unchecked. A codec bug is a refusal too, never an escape."""
    try:
        frame.env = _decode(frame, t)
    except ProtocolError:
        raise
    except Exception as exc:
        raise ProtocolError("decode.internal", repr(exc)) from None
    if frame.env is None:
        with t._state_lock:
            t.duplicates += 1
        return
    nxt(frame)


def _decode(frame: Frame, t: Wire) -> Envelope | None:
    if t.verifier is not None:
        opened = t.verifier.open(frame.topic, frame.payload)
        return None if opened is None else decode(opened, max_bytes=t.max_bytes)
    parts = split_trailer(frame.payload)
    if parts is not None:
        try:
            return decode(parts[0], max_bytes=t.max_bytes)
        except ProtocolError:
            pass  # an unsigned frame that merely ends like a trailer: judge it whole
    return decode(frame.payload, max_bytes=t.max_bytes)


def check_sender(frame: Frame, t: Wire, nxt: Next) -> None:
    """The topic names the publisher (a broker ACL can pin it to a login), so an envelope that
    claims another sender, run or kind is forged or misrouted. Foreign topics are not checked."""
    mismatch = topic_mismatch(frame.topic, frame.env)
    if mismatch:
        raise ProtocolError(*mismatch)
    nxt(frame)


def topic_mismatch(topic: str, env: Envelope) -> tuple[str, str] | None:
    """(rule, reason) when a splitedge topic and its envelope disagree, else None."""
    try:
        parts = parse(topic)
    except ProtocolError:
        return None
    if env.sender != parts.node_id:
        return "envelope.sender", f"sender {env.sender!r:.80} published on {parts.node_id!r}'s topic"
    if env.run != parts.run:
        return "envelope.run", f"run {env.run!r:.80} on a topic of run {parts.run!r}"
    if env.kind != parts.message_kind:
        return "envelope.kind_topic", f"kind {env.kind!r} on a {parts.kind!r} topic"
    return None


def drop_duplicates(frame: Frame, t: Wire, nxt: Next) -> None:
    """A copy already routed is dropped: MQTT 3.1.1 lets a broker (amqtt does) send one copy
    per overlapping subscription, and QoS 1 may redeliver; handlers run once per message."""
    if not t._seen_before(frame.topic, frame.env.msg_id):
        nxt(frame)


WIRE_STEPS: tuple[Step, ...] = (count_bytes, skip_cleared, cap_size, open_frame, check_sender, drop_duplicates)
"""The order every transport judges a received frame in; routing to the handlers comes last."""


def compose(steps: Sequence[Step], t: Wire, last: Next) -> Next:
    """One callable running `steps` in order, then `last`."""
    handler = last
    for step in reversed(steps):
        handler = (lambda s, n: lambda frame: s(frame, t, n))(step, handler)
    return handler
