"""Seeded fuzzing of decode(): every input either decodes to an Envelope that re-validates
or raises ProtocolError -- never any other exception, never a hang.

The generator covers truncation, byte flips, wrong types in every envelope and body field,
crafted array ext payloads (dtype off the whitelist, shape/byte-count mismatch, huge dims,
ndim too large), NaN/Inf where finite is required, frames over the cap, depth and width bombs,
unknown kinds, wrong versions and non-str map keys.
"""

from __future__ import annotations

import collections
import math
import random
import struct
from typing import Any, Callable, Iterator

import msgpack
import numpy as np
from hypothesis import given, settings, strategies as st

from splitedge.protocol import DEFAULT_MAX_BYTES, ProtocolError, decode, encode, validate_body
from splitedge.protocol.arrays import DTYPE_CODES, ext_default
from splitedge.protocol.examples import EXAMPLES, example_envelope

MIN_CASES = 10_000
KINDS = sorted(EXAMPLES)
ENVELOPE_KEYS = ("v", "k", "r", "n", "s", "i", "b")
Case = tuple[str, bytes, int]  # (label, frame, max_bytes)


def _ext(code: int, ndim: int, dims: list[int], data: bytes) -> msgpack.ExtType:
    return msgpack.ExtType(1, struct.pack(f"<BB{len(dims)}I", code, ndim, *dims) + data)


def _weird_values(rng: random.Random) -> list[Any]:
    """Values of every msgpack type, including ones no schema accepts."""
    return [
        None, True, False, 0, -1, 1, 2**63, 2**64 - 1, -(2**63), 1.5, math.nan, math.inf, -math.inf,
        "", "x" * rng.randint(1, 300), "ünï", b"", b"\x00\xff", [], [1, "a"], {}, {"a": 1},
        msgpack.ExtType(7, b"abc"), msgpack.Timestamp(1, 2),
        _ext(DTYPE_CODES["f4"], 1, [2], b"\x00" * 8), _ext(DTYPE_CODES["i8"], 1, [1], b"\x01" * 8),
        _ext(DTYPE_CODES["f4"], 2, [1, 2], struct.pack("<2f", math.nan, math.inf)),
        _ext(DTYPE_CODES["f8"], 0, [], struct.pack("<d", -1.0)),
    ]


def _bad_exts(rng: random.Random) -> list[msgpack.ExtType]:
    """Crafted array payloads that must all be refused (or decode to a consistent array)."""
    code = rng.choice(list(DTYPE_CODES.values()))
    return [
        _ext(rng.choice([0, 10, 11, 127, 255]), 1, [1], b"\x00" * 8),          # dtype off list
        _ext(code, 1, [rng.randint(2, 100)], b"\x00" * rng.randint(0, 7)),      # size mismatch
        _ext(code, 2, [0xFFFFFFFF, 0xFFFFFFFF], b"\x00" * 8),                    # huge dims
        _ext(code, 1, [2**31 + rng.randint(0, 100)], b""),                       # "negative" int32
        _ext(code, rng.randint(9, 255), [1] * 9, b"\x00" * 8),                   # ndim too large
        msgpack.ExtType(1, bytes([code, 3, 1, 0])),                              # header cut short
        msgpack.ExtType(1, b""), msgpack.ExtType(1, bytes([code])),
    ]


def _pack(doc: Any) -> bytes:
    return msgpack.packb(doc, default=ext_default, use_bin_type=True, strict_types=False)


def _doc(kind: str) -> dict[str, Any]:
    env = example_envelope(kind)
    return {"v": env.version, "k": env.kind, "r": env.run, "n": env.round, "s": env.sender,
            "i": env.msg_id, "b": env.body}


_HOLE = msgpack.ExtType(99, b"<splice-here>")


def _with_raw(doc: dict[str, Any], raw: bytes) -> bytes:
    """Pack ``doc`` whose body holds _HOLE, then splice ``raw`` msgpack bytes in its place
    (the packer itself refuses to nest deeper than 511, an attacker does not)."""
    return _pack(doc).replace(_pack(_HOLE), raw)


def _nest_bytes(depth: int, as_map: bool) -> bytes:
    return (b"\x81\xa1a" if as_map else b"\x91") * depth + b"\x00"


def _field_mutations(rng: random.Random) -> Iterator[Case]:
    """Wrong values in every envelope field and every body field of every kind."""
    for kind in KINDS:
        for key in ENVELOPE_KEYS:
            for value in _weird_values(rng):
                yield f"env.{key}", _pack({**_doc(kind), key: value}), DEFAULT_MAX_BYTES
        for field in _doc(kind)["b"]:
            for value in _weird_values(rng) + _bad_exts(rng):
                doc = _doc(kind)
                doc["b"][field] = value
                yield f"body.{kind}.{field}", _pack(doc), DEFAULT_MAX_BYTES


def _structural(rng: random.Random) -> Iterator[Case]:
    """Unknown kinds, versions, non-str keys, NaN/Inf, bombs, oversize, missing keys."""
    for kind in KINDS:
        doc = _doc(kind)
        yield "kind.unknown", _pack({**doc, "k": f"{kind}_x"}), DEFAULT_MAX_BYTES
        for v in (0, 2, -1, 255, 2**32):
            yield "version", _pack({**doc, "v": v}), DEFAULT_MAX_BYTES
        for bad_key in (1, -1, b"b", 1.5, None, True):
            yield "key.env", msgpack.packb({bad_key: 1, **{k: 0 for k in "vk"}}), DEFAULT_MAX_BYTES
            yield "key.body", _pack({**doc, "b": {**doc["b"], bad_key: 1}}), DEFAULT_MAX_BYTES
        for key in ENVELOPE_KEYS:
            yield "env.missing", _pack({k: v for k, v in doc.items() if k != key}), DEFAULT_MAX_BYTES
        data = _pack(doc)
        yield "cap", data, rng.randint(1, len(data) - 1)
        for depth in (10, 100, 1000, 1100, 5000):
            bomb = _nest_bytes(depth, as_map=rng.random() < 0.5)
            yield "depth.body", _with_raw({**doc, "b": {**doc["b"], "x": _HOLE}}, bomb), DEFAULT_MAX_BYTES
            yield "depth.field", _with_raw({**doc, "s": _HOLE}, bomb), DEFAULT_MAX_BYTES
            if kind == "done":  # the one free-form field: Data(max_depth=8)
                yield "depth.info", _with_raw({**doc, "b": {**doc["b"], "info": _HOLE}}, bomb), DEFAULT_MAX_BYTES
    yield "depth.raw", b"\x91" * 100_000 + b"\xc0", DEFAULT_MAX_BYTES
    yield "depth.raw_map", b"\x81\xa1a" * 50_000 + b"\xc0", DEFAULT_MAX_BYTES
    yield "width.header", b"\xdd\xff\xff\xff\xff", DEFAULT_MAX_BYTES                  # array32
    yield "width.map", b"\xdf\xff\xff\xff\xff", DEFAULT_MAX_BYTES                     # map32
    yield "width.str", b"\xdb\xff\xff\xff\xff", DEFAULT_MAX_BYTES
    yield "width.bin", b"\xc6\x7f\xff\xff\xff", DEFAULT_MAX_BYTES
    yield "width.ext", b"\xc9\x7f\xff\xff\xff\x01", DEFAULT_MAX_BYTES
    yield "width.elements", _pack([[{}] * 1000] * 200), DEFAULT_MAX_BYTES
    yield "deep.headers", b"\xdc\x03\xff" * 2000, DEFAULT_MAX_BYTES
    yield "oversize", b"\x00" * 1025, 1024
    yield "timestamp.bad", b"\xc7\x03\xff\x00\x00\x00", DEFAULT_MAX_BYTES


def _nonfinite(rng: random.Random) -> Iterator[Case]:
    """NaN/Inf in every float array of every example body."""
    for kind in KINDS:
        for field, value in _doc(kind)["b"].items():
            arrays = value.items() if isinstance(value, dict) else [(None, value)]
            for sub, arr in arrays:
                if not (isinstance(arr, np.ndarray) and arr.dtype.kind == "f" and arr.size):
                    continue
                for bad in (math.nan, math.inf, -math.inf):
                    doc, poisoned = _doc(kind), arr.copy()
                    poisoned.flat[rng.randrange(arr.size)] = bad
                    target = doc["b"][field] if sub is not None else doc["b"]
                    target[sub if sub is not None else field] = poisoned
                    yield f"nonfinite.{kind}.{field}", _pack(doc), DEFAULT_MAX_BYTES


def _byte_level(rng: random.Random, per_kind: int) -> Iterator[Case]:
    """Truncations and random byte flips of valid frames, plus random garbage."""
    for kind in KINDS:
        data = encode(example_envelope(kind))
        for _ in range(per_kind):
            yield "truncate", data[: rng.randrange(len(data))], DEFAULT_MAX_BYTES
            flipped = bytearray(data)
            for _ in range(rng.randint(1, 4)):
                flipped[rng.randrange(len(data))] = rng.randrange(256)
            yield "flip", bytes(flipped), DEFAULT_MAX_BYTES
            cut = rng.randrange(len(data))
            yield "splice", data[:cut] + rng.randbytes(rng.randint(0, 8)) + data[cut:], DEFAULT_MAX_BYTES
        yield "trailing", data + b"\x00", DEFAULT_MAX_BYTES
    for _ in range(per_kind * 2):
        yield "random", rng.randbytes(rng.randint(0, 64)), DEFAULT_MAX_BYTES


def generate_cases(seed: int = 20240601, per_kind: int = 400) -> Iterator[Case]:
    rng = random.Random(seed)
    generators: list[Callable[[random.Random], Iterator[Case]]] = [
        _field_mutations, _structural, _nonfinite, lambda r: _byte_level(r, per_kind)]
    for make in generators:
        yield from make(rng)


def _check(data: bytes, max_bytes: int) -> str:
    """Decode; a success must survive re-validation and re-encoding. Returns the outcome."""
    try:
        env = decode(data, max_bytes=max_bytes)
    except ProtocolError as err:
        return err.rule
    validate_body(env.kind, env.body)
    assert decode(encode(env)).kind == env.kind
    return "ok"


def test_seeded_fuzz_only_raises_protocol_error():
    # Prepare
    outcomes: collections.Counter[str] = collections.Counter()
    failures: list[str] = []
    # Execute
    for label, data, max_bytes in generate_cases():
        try:
            outcomes[_check(data, max_bytes)] += 1
        except Exception as exc:  # noqa: BLE001 - this is exactly what the test hunts for
            failures.append(f"{label}: {type(exc).__name__}: {exc!s:.200} <- {data[:60].hex()}")
    # Assert
    assert failures == [], "\n".join(failures[:20])
    assert sum(outcomes.values()) >= MIN_CASES, outcomes
    expected_rules = {"frame.truncated", "frame.trailing", "frame.too_large", "frame.depth",
                      "frame.invalid", "envelope.version", "envelope.kind_unknown", "array.dtype",
                      "array.size", "array.ndim", "schema.finite", "schema.type", "ok"}
    assert expected_rules <= set(outcomes), sorted(outcomes)


_VALID = [encode(example_envelope(kind)) for kind in KINDS]


@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.binary(max_size=256))
def test_hypothesis_random_bytes(data):
    _check(data, DEFAULT_MAX_BYTES)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.sampled_from(_VALID),
       st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), max_size=6))
def test_hypothesis_mutated_valid_frames(frame, edits):
    data = bytearray(frame)
    for pos, byte in edits:
        data[pos % len(data)] = byte
    _check(bytes(data), DEFAULT_MAX_BYTES)
