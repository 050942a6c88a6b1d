"""Envelope dataclass and the one encode/decode pair of the wire format.

On the wire an envelope is a msgpack map with short keys
``{"v": version, "k": kind, "r": run, "n": round, "s": sender, "i": msg_id, "b": body}``;
arrays anywhere in the body are msgpack ext type 1 (arrays.py).

``decode`` treats its input as hostile: it checks the size first, bounds every length msgpack
reads, caps the number of decoded containers/elements by what the frame's length pays for
(limits.element_budget: its work is linear in its bytes), and turns every failure into
ProtocolError, so a transport can count and drop a bad frame without a try/except zoo.
``encode`` checks the same limits (limits.py), so a node never sends what every receiver drops.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any, Mapping

import msgpack

from .arrays import ext_default, ext_hook
from .errors import ProtocolError
from .limits import (
    ARRAY_COST, DEFAULT_MAX_BYTES, MAX_ARRAY_LEN, MAX_DEPTH, MAX_ELEMENTS, MAX_STR_BYTES, check_density, check_frame,
    element_budget, over_budget,
)
from .schema import get_schema, validate_body

__all__ = ["PROTOCOL_VERSION", "DEFAULT_MAX_BYTES", "MAX_ARRAY_LEN", "MAX_DEPTH", "MAX_ELEMENTS", "MAX_STR_BYTES",
           "Envelope", "encode", "decode"]

PROTOCOL_VERSION = 2
_MAX_ID_LEN = 128
_KEYS = ("v", "k", "r", "n", "s", "i", "b")


def new_msg_id() -> str:
    return uuid.uuid4().hex


@dataclass(frozen=True)
class Envelope:
    """One message: routing metadata plus a body validated against ``kind``'s schema."""

    kind: str
    run: str
    round: int
    sender: str
    body: Mapping[str, Any]
    msg_id: str = field(default_factory=new_msg_id)
    version: int = PROTOCOL_VERSION


def _check_id(name: str, value: Any) -> str:
    if not isinstance(value, str) or not 0 < len(value) <= _MAX_ID_LEN:
        raise ProtocolError("envelope.field", f"{name} must be a str of 1..{_MAX_ID_LEN} chars")
    return value


def _check_envelope(version: Any, kind: Any, run: Any, rnd: Any, sender: Any, msg_id: Any) -> None:
    """Header checks shared by encode and decode; version first, since it governs the rest."""
    if type(version) is not int or version != PROTOCOL_VERSION:
        raise ProtocolError("envelope.version", f"version {version!r:.40} != {PROTOCOL_VERSION}")
    if not isinstance(kind, str):
        raise ProtocolError("envelope.kind_unknown", f"kind {kind!r:.80} is not a str")
    _check_id("run", run)
    _check_id("sender", sender)
    _check_id("msg_id", msg_id)
    if type(rnd) is not int or not 0 <= rnd < 2**63:
        raise ProtocolError("envelope.field", f"round must be an int in [0, 2**63), got {rnd!r:.40}")


def encode(env: Envelope, *, validate: bool = True, max_bytes: int = DEFAULT_MAX_BYTES) -> bytes:
    """Serialise ``env``; with ``validate`` a bad envelope/body raises ProtocolError (a ValueError).

    Always (``validate`` or not) a frame a decoder with cap ``max_bytes`` would refuse raises
    ProtocolError naming the limit (limits.py) instead of being sent to be dropped."""
    body = env.body
    if validate:
        _check_envelope(env.version, env.kind, env.run, env.round, env.sender, env.msg_id)
        schema = get_schema(env.kind)
        body = schema.wire(schema.validate(body, env.kind))
    doc = {"v": env.version, "k": env.kind, "r": env.run, "n": env.round,
           "s": env.sender, "i": env.msg_id, "b": body}
    elements = check_frame(doc)
    try:
        data = msgpack.packb(doc, default=ext_default, use_bin_type=True)
    except ProtocolError:
        raise
    except (TypeError, ValueError, OverflowError) as exc:
        raise ProtocolError("encode.type", f"cannot encode envelope: {exc}") from exc
    if len(data) > max_bytes:
        raise ProtocolError("frame.too_large", f"{len(data)} bytes > the frame cap of {max_bytes}")
    check_density(elements, len(data))
    return data


class _Budget:
    """list_hook/object_hook/ext_hook counting decoded elements against the frame's budget
    (limits.element_budget): a list or map counts its items + 1 once it is built, an array
    ext value ARRAY_COST before it is decoded; past the budget the frame is refused at once."""

    def __init__(self, frame_bytes: int) -> None:
        self.frame_bytes = frame_bytes
        self.limit = element_budget(frame_bytes)
        self.used = 0

    def _spend(self, n: int) -> None:
        self.used += n
        if self.used > self.limit:
            raise over_budget(self.used, self.frame_bytes)

    def on_list(self, value: list) -> list:
        self._spend(len(value) + 1)
        return value

    def on_map(self, value: dict) -> dict:
        self._spend(len(value) + 1)
        return value

    def on_ext(self, code: int, payload: bytes) -> Any:
        self._spend(ARRAY_COST)
        return ext_hook(code, payload)


def _unpack(data: bytes, max_bytes: int) -> Any:
    """One msgpack object from ``data`` with every length bounded; ProtocolError on anything.

    A map header announcing more entries than the frame's budget is refused at the header, before
    msgpack sizes a dict for them (``max_map_len`` is the budget)."""
    budget = _Budget(len(data))
    unpacker = msgpack.Unpacker(
        None, max_buffer_size=max(max_bytes, 1), raw=False, strict_map_key=True,
        use_list=True, ext_hook=budget.on_ext, list_hook=budget.on_list, object_hook=budget.on_map,
        max_str_len=min(MAX_STR_BYTES, max_bytes), max_bin_len=max_bytes, max_ext_len=max_bytes,
        max_array_len=MAX_ARRAY_LEN, max_map_len=budget.limit,
    )
    try:
        unpacker.feed(data)
        obj = unpacker.unpack()
    except ProtocolError:
        raise
    except msgpack.OutOfData as exc:
        raise ProtocolError("frame.truncated", "frame ends inside a msgpack object") from exc
    except msgpack.StackError as exc:
        raise ProtocolError("frame.depth", f"msgpack nesting deeper than MAX_DEPTH {MAX_DEPTH}") from exc
    except UnicodeDecodeError as exc:
        raise ProtocolError("frame.utf8", f"invalid UTF-8 in a str: {exc.reason}") from exc
    except ValueError as exc:
        if "max_map_len" in str(exc):  # a map header past the budget: refused as the budget refuses
            raise over_budget(budget.limit + 1, len(data)) from exc
        raise ProtocolError("frame.invalid", f"malformed msgpack: {exc}") from exc
    except Exception as exc:  # noqa: BLE001 - FormatError, ValueError (limits, map keys), ...
        raise ProtocolError("frame.invalid", f"malformed msgpack: {exc}") from exc
    if unpacker.tell() != len(data):
        raise ProtocolError("frame.trailing", f"{len(data) - unpacker.tell()} bytes after the envelope")
    return obj


def decode(data: bytes, *, max_bytes: int = DEFAULT_MAX_BYTES) -> Envelope:
    """Parse and validate one frame from an untrusted peer. Raises ProtocolError only."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ProtocolError("frame.type", f"expected bytes, got {type(data).__name__}")
    if len(data) > max_bytes:
        raise ProtocolError("frame.too_large", f"{len(data)} bytes > cap of {max_bytes}")
    if len(data) == 0:
        raise ProtocolError("frame.truncated", "empty frame")
    doc = _unpack(bytes(data), max_bytes)
    if not isinstance(doc, dict):
        raise ProtocolError("envelope.type", f"envelope must be a map, got {type(doc).__name__}")
    _check_version(doc)
    if set(doc) != set(_KEYS):
        raise ProtocolError("envelope.keys", f"envelope keys {sorted(map(str, doc))} != {sorted(_KEYS)}")
    _check_envelope(doc["v"], doc["k"], doc["r"], doc["n"], doc["s"], doc["i"])
    body = validate_body(doc["k"], doc["b"])
    return Envelope(kind=doc["k"], run=doc["r"], round=doc["n"], sender=doc["s"],
                    body=body, msg_id=doc["i"], version=doc["v"])


def _check_version(doc: dict) -> None:
    """A frame from another protocol version is refused before its other keys are judged."""
    version = doc.get("v")
    if type(version) is not int or version != PROTOCOL_VERSION:
        raise ProtocolError("envelope.version", f"version {version!r:.40} != {PROTOCOL_VERSION}")
