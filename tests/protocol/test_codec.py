"""Codec tests: envelope round trips, array ext type, frame-level rejections, exact bytes."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest

from splitedge.protocol import (
    DEFAULT_MAX_BYTES, PROTOCOL_VERSION, Envelope, ProtocolError, decode, encode, registered_kinds,
)
from splitedge.protocol.arrays import DTYPE_CODES, MAX_NDIM, pack_array, unpack_array
from splitedge.protocol.examples import EXAMPLE_MSG_ID, example_envelope, worked_example

PROTOCOL_MD = Path(__file__).resolve().parents[2] / "PROTOCOL.md"
NP_DTYPES = {"bool": "?", "u1": "u1", "i1": "i1", "i2": "<i2", "i4": "<i4", "i8": "<i8",
             "f2": "<f2", "f4": "<f4", "f8": "<f8"}


def _weights_env(weights: dict[str, np.ndarray]) -> Envelope:
    body = {"part": "model", "version": 0, "samples": 1, "weights": weights}
    return Envelope(kind="weights", run="r1", round=0, sender="cloud", body=body)


def _random_array(rng: np.random.Generator, name: str, shape: tuple[int, ...]) -> np.ndarray:
    if name == "bool":
        return np.asarray(rng.random(shape) < 0.5)
    if name.startswith("f"):
        return np.asarray(rng.normal(size=shape)).astype(NP_DTYPES[name])
    info = np.iinfo(NP_DTYPES[name])
    return np.asarray(rng.integers(info.min, info.max, size=shape, dtype=NP_DTYPES[name], endpoint=True))


def _roundtrip_array(arr: np.ndarray) -> np.ndarray:
    return decode(encode(_weights_env({"a": arr}))).body["weights"]["a"]


def test_dtype_whitelist_is_the_documented_one():
    assert set(DTYPE_CODES) == set(NP_DTYPES)


@pytest.mark.parametrize("name", sorted(NP_DTYPES))
@pytest.mark.parametrize("shape", [(), (0,), (3,), (2, 0, 4), (2, 3, 4)])
def test_every_whitelisted_dtype_round_trips(name, shape):
    # Prepare
    arr = _random_array(np.random.default_rng(42), name, shape)
    # Execute
    out = _roundtrip_array(arr)
    # Assert
    assert out.dtype == np.dtype(NP_DTYPES[name]) and out.shape == shape
    np.testing.assert_array_equal(out, arr)
    assert not out.flags.writeable


def test_weight_map_round_trip_preserves_order_and_values():
    # Prepare
    rng = np.random.default_rng(0)
    names = [f"layer{i}.{p}" for i in (3, 1, 2, 0) for p in ("weight", "bias")]
    weights = {n: rng.normal(size=(i + 1, 2)).astype("f4") for i, n in enumerate(names)}
    weights["bn.num_batches_tracked"] = np.array(11, dtype="i8")
    # Execute
    out = decode(encode(_weights_env(weights))).body["weights"]
    # Assert
    assert list(out) == list(weights)
    for name, arr in weights.items():
        np.testing.assert_array_equal(out[name], arr)


@pytest.mark.parametrize("make", [
    lambda a: a.astype(">f4"),
    lambda a: np.asfortranarray(a),
    lambda a: a[:, ::2],
    lambda a: a.T.astype(">f8"),
])
def test_big_endian_and_strided_arrays_are_normalised(make):
    # Prepare
    arr = make(np.arange(24, dtype="f4").reshape(4, 6))
    # Execute
    out = _roundtrip_array(arr)
    # Assert
    assert out.dtype.byteorder in "<=|" and out.flags.c_contiguous
    np.testing.assert_array_equal(out, arr)


def test_array_ext_payload_layout_is_exact():
    # Prepare
    arr = np.array([[1, 2, 3]], dtype="<i2")
    # Execute
    ext = pack_array(arr)
    # Assert
    assert ext.code == 1
    assert ext.data == bytes([DTYPE_CODES["i2"], 2]) + b"\x01\0\0\0\x03\0\0\0" + b"\x01\0\x02\0\x03\0"


@pytest.mark.parametrize("arr", [
    np.array([1 + 2j]), np.array(["a"]), np.array([object()], dtype=object),
    np.zeros(2, dtype=[("a", "f4")]), np.zeros(2, dtype="u4"), np.zeros((1,) * (MAX_NDIM + 1)),
])
def test_unsupported_arrays_raise_a_value_error_at_encode(arr):
    # Execute / Assert: with or without schema validation it is a ProtocolError (a ValueError)
    with pytest.raises(ProtocolError) as err:
        encode(_weights_env({"a": arr}), validate=False)
    assert err.value.rule in {"array.dtype", "array.ndim"}
    with pytest.raises(ValueError):
        encode(_weights_env({"a": arr}))


@pytest.mark.parametrize("payload, rule", [
    (b"", "array.header"),
    (bytes([0, 1, 1, 0, 0, 0, 0]), "array.dtype"),
    (bytes([DTYPE_CODES["f8"], 9]) + b"\1\0\0\0" * 9 + b"\0" * 8, "array.ndim"),
    (bytes([DTYPE_CODES["f4"], 2, 1, 0, 0]), "array.header"),
    (bytes([DTYPE_CODES["f4"], 1, 2, 0, 0, 0]) + b"\0" * 7, "array.size"),
    (bytes([DTYPE_CODES["u1"], 2]) + b"\xff\xff\xff\xff" * 2 + b"\0", "array.size"),
])
def test_bad_array_payloads_are_rejected(payload, rule):
    with pytest.raises(ProtocolError) as err:
        unpack_array(payload)
    assert err.value.rule == rule


def test_protocol_error_is_a_value_error_with_a_rule():
    err = ProtocolError("frame.truncated", "short")
    assert isinstance(err, ValueError) and err.rule == "frame.truncated"
    assert str(err) == "frame.truncated: short"


def test_envelope_defaults_give_unique_ids_and_current_version():
    a, b = (Envelope("status", "r", 0, "d1", {"state": "online", "role": "device"}) for _ in "ab")
    assert a.msg_id != b.msg_id and len(a.msg_id) == 32
    assert a.version == PROTOCOL_VERSION == 2
    assert DEFAULT_MAX_BYTES == 64 * 1024 * 1024


def _shipped_examples() -> dict[str, Any]:
    """Every kind the protocol and the shipped methods register, each with its example body (None
    when it has none). Read from their declarations, not from the registry, whose content
    depends on which test modules happened to be imported before this one (a test's own method
    may register kinds of its own)."""
    import importlib
    import importlib.util

    from splitedge.methods.registry import get_method, list_methods
    from splitedge.protocol.examples import EXAMPLES
    from splitedge.protocol.kinds import BUILTIN_KINDS

    shipped = {k: EXAMPLES.get(k) for k in BUILTIN_KINDS}
    for name in list_methods():
        package = get_method(name).__module__.rpartition(".")[0]
        if package.startswith("splitedge.methods.") and importlib.util.find_spec(f"{package}.kinds") is not None:
            kinds = importlib.import_module(f"{package}.kinds")
            shipped.update({k: getattr(kinds, "EXAMPLES", {}).get(k) for k in kinds.KINDS})
    return shipped


SHIPPED = _shipped_examples()


@pytest.mark.parametrize("kind", sorted(SHIPPED))
def test_every_registered_kind_has_an_example_that_round_trips(kind):
    # Prepare
    assert SHIPPED[kind] is not None and kind in registered_kinds(), f"kind {kind!r}: no example, or not registered"
    env = Envelope(kind=kind, run="demo", round=3, sender="d1", body=SHIPPED[kind](), msg_id=EXAMPLE_MSG_ID)
    # Execute
    data = encode(env)
    out = decode(data)
    # Assert
    assert (out.kind, out.run, out.round, out.sender, out.msg_id) == ("%s" % kind, "demo", 3, "d1",
                                                                     env.msg_id)
    assert encode(out) == data


def _frame(**overrides) -> bytes:
    doc = {"v": PROTOCOL_VERSION, "k": "status", "r": "r", "n": 0, "s": "d1", "i": "x",
           "b": {"state": "online", "role": "device"}}
    doc.update(overrides)
    return msgpack.packb({k: v for k, v in doc.items() if v is not ...}, use_bin_type=True)


@pytest.mark.parametrize("data, rule", [
    (b"", "frame.truncated"),
    (_frame()[:-3], "frame.truncated"),
    (_frame() + b"\x00", "frame.trailing"),
    (msgpack.packb([1, 2]), "envelope.type"),
    (_frame(v=1), "envelope.version"),  # version 1 (before addressed topics and neutral rounds)
    (_frame(v=3), "envelope.version"),
    (_frame(v="1"), "envelope.version"),
    (_frame(v=...), "envelope.version"),
    (_frame(k="nope"), "envelope.kind_unknown"),
    (_frame(k=7), "envelope.kind_unknown"),
    (_frame(n=-1), "envelope.field"),
    (_frame(n=True), "envelope.field"),
    (_frame(s=""), "envelope.field"),
    (_frame(i=...), "envelope.keys"),
    (_frame(x=1), "envelope.keys"),
    (_frame(b=[1]), "schema.type"),
    (msgpack.packb({1: 2}), "frame.invalid"),
    (msgpack.packb(msgpack.ExtType(5, b"x")), "frame.ext_type"),
    (b"\xa2\xff\xfe", "frame.utf8"),
    (b"\xc1", "frame.invalid"),
    (b"\x91" * 5000 + b"\x00", "frame.depth"),
])
def test_malformed_frames_name_the_rule_they_break(data, rule):
    with pytest.raises(ProtocolError) as err:
        decode(data)
    assert err.value.rule == rule


def test_frames_over_the_cap_are_refused_before_parsing():
    data = encode(example_envelope("weights"))
    with pytest.raises(ProtocolError) as err:
        decode(data, max_bytes=len(data) - 1)
    assert err.value.rule == "frame.too_large"
    assert decode(data, max_bytes=len(data)).kind == "weights"


def test_element_bombs_are_refused():
    # Prepare: a small frame that would inflate into ~a million empty maps
    data = msgpack.packb([[{}] * 1000] * 1000)
    # Execute / Assert
    with pytest.raises(ProtocolError) as err:
        decode(data)
    assert err.value.rule == "frame.too_many_elements"


@pytest.mark.parametrize("kind", ["weights", "moments"])
def test_wire_overhead_of_a_64_kib_float32_array_is_below_one_percent(kind):
    # Prepare
    from splitedge.bench.wire_overhead import overhead
    # Execute
    row = overhead(kind, 64 * 1024)
    # Assert
    assert row["ratio"] <= 1.01, row


def _doc_block(name: str) -> str:
    text = PROTOCOL_MD.read_text(encoding="utf-8")
    match = re.search(rf"<!-- {name}:begin -->\n```[a-z]*\n(.*?)```\n<!-- {name}:end -->", text, re.S)
    assert match, f"PROTOCOL.md lost its {name} block"
    return match.group(1)


def test_worked_example_bytes_are_exact():
    # Prepare: the exact-byte fixture (also printed in PROTOCOL.md)
    expected = bytes.fromhex("".join(_doc_block("example-hex").split()))
    # Execute
    data = encode(worked_example())
    # Assert
    assert data == expected
    assert decode(data).body["space"] == "wc"


def test_annotated_example_in_protocol_md_matches_the_encoder():
    # Prepare: hex column = everything before the first "|" of each annotated line
    lines = _doc_block("example-annotated").splitlines()
    hex_text = "".join(line.split("|")[0] for line in lines)
    # Execute / Assert
    assert bytes.fromhex("".join(hex_text.split())) == encode(worked_example())


def test_kinds_table_in_protocol_md_matches_the_registry():
    from splitedge.protocol.kinds import kinds_markdown

    assert _doc_block("kinds-table").strip() == kinds_markdown().strip()
