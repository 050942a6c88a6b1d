"""Frame limits (issue 30, item 8): PROTOCOL.md's limits table is the codec's constants; the
encoder refuses, naming the limit, every frame a decoder would refuse (just under a cap a frame
round-trips, just over it raises on encode, and the decoder refuses the same bytes); and lists
longer than one msgpack array (an edge's members, a round's participants) travel as pages."""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np
import pytest

from splitedge.protocol import codec
from splitedge.protocol.arrays import ext_default
from splitedge.protocol.codec import (
    DEFAULT_MAX_BYTES, MAX_ARRAY_LEN, MAX_DEPTH, MAX_ELEMENTS, MAX_STR_BYTES, Envelope, decode, encode,
)
from splitedge.protocol.errors import ProtocolError
from splitedge.protocol.schema import List, Paged, Str
from splitedge.protocol.signing import TRAILER_LEN, Signer
from splitedge.protocol.transport import LoopbackBus, LoopbackTransport

from protocol_doc import DOC, ProtocolDoc, Violation, block, check_message, table

ENVELOPE_ELEMENTS = 8  # the envelope map: 7 entries + 1 (limits.py counts like the decoder)


def envelope(kind: str, body: dict[str, Any], sender: str = "e0") -> Envelope:
    return Envelope(kind=kind, run="r", round=1, sender=sender, body=body, msg_id="0" * 32)


def raw_frame(env: Envelope) -> bytes:
    """The bytes `encode` would write without its checks: what a careless sender would send."""
    doc = {"v": env.version, "k": env.kind, "r": env.run, "n": env.round, "s": env.sender, "i": env.msg_id,
           "b": env.body}
    return msgpack.packb(doc, default=ext_default, use_bin_type=True)


def refused(data: bytes, **kw: Any) -> str:
    with pytest.raises(ProtocolError) as err:
        decode(data, **kw)
    return err.value.rule


def done(entries: dict[str, Any]) -> Envelope:
    """A `done` whose info carries `entries` where free-form data may go: its method's section."""
    return envelope("done", {"phase": "round", "info": {"method": entries}})


def hello(members: list[str]) -> Envelope:
    return envelope("hello", {"role": "edge", "parent": "cloud", "samples": len(members), "backend": "torch",
                              "classes": np.zeros(0, dtype=np.int64), "members": members, "groups": []})


def ids(n: int) -> list[str]:
    return [f"d{i:05d}" for i in range(n)]


# -- PROTOCOL.md's limits table is the codec's ---------------------------------------------------

def test_protocol_md_limits_table_is_the_codec_constants() -> None:
    rows = table(block(DOC.read_text(encoding="utf-8"), "limits"))
    documented = {r["constant"]: int(r["value"]) for r in rows}
    assert documented == {name: getattr(codec, name) for name in
                          ("DEFAULT_MAX_BYTES", "MAX_ARRAY_LEN", "MAX_ELEMENTS", "MAX_STR_BYTES", "MAX_DEPTH")}
    assert {r["constant"]: r["encoder raises"] for r in rows} == {
        "DEFAULT_MAX_BYTES": "frame.too_large", "MAX_ARRAY_LEN": "frame.array_len",
        "MAX_ELEMENTS": "frame.too_many_elements", "MAX_STR_BYTES": "frame.str_len", "MAX_DEPTH": "frame.depth"}


def test_max_depth_is_the_depth_msgpack_decodes() -> None:
    """MAX_DEPTH is msgpack-python's fixed stack, not ours to set: check the constant tracks it."""
    assert refused(b"\x91" * MAX_DEPTH + b"\x00") == "envelope.type"  # decoded, then judged
    assert refused(b"\x91" * (MAX_DEPTH + 1) + b"\x00") == "frame.depth"


# -- the encoder refuses what the decoder refuses, and no more ----------------------------------

def test_a_list_of_max_array_len_items_round_trips_and_one_more_is_refused_on_encode() -> None:
    assert decode(encode(done({"l": [0] * MAX_ARRAY_LEN}))).body["info"]["method"]["l"] == [0] * MAX_ARRAY_LEN
    over = done({"l": [0] * (MAX_ARRAY_LEN + 1)})
    with pytest.raises(ProtocolError, match="MAX_ARRAY_LEN 1024") as err:
        encode(over)
    assert err.value.rule == "frame.array_len" and isinstance(err.value, ValueError)
    assert refused(raw_frame(over)) == "frame.invalid"


def test_a_str_of_max_str_bytes_round_trips_and_one_byte_more_is_refused_on_encode() -> None:
    text = "x" * MAX_STR_BYTES
    assert decode(encode(done({"s": text}))).body["info"]["method"]["s"] == text
    for over in ("x" * (MAX_STR_BYTES + 1), "é" * (MAX_STR_BYTES // 2 + 1)):  # the cap counts UTF-8 bytes
        with pytest.raises(ProtocolError, match="MAX_STR_BYTES") as err:
            encode(done({"s": over}))
        assert err.value.rule == "frame.str_len"
        assert refused(raw_frame(done({"s": over}))) == "frame.invalid"


def test_a_long_map_key_is_a_str_too() -> None:
    with pytest.raises(ProtocolError, match="key") as err:
        encode(done({"k" * (MAX_STR_BYTES + 1): 1}))
    assert err.value.rule == "frame.str_len"


def test_a_frame_of_max_elements_round_trips_and_one_element_more_is_refused_on_encode() -> None:
    # a metrics body is one map of any number of keys: envelope 8 + body (n + 1) elements
    n = MAX_ELEMENTS - ENVELOPE_ELEMENTS - 1
    body = {f"m{i}": i for i in range(n)}
    assert len(decode(encode(envelope("metrics", body))).body) == n
    over = envelope("metrics", {**body, "one_more": 0})
    with pytest.raises(ProtocolError, match="MAX_ELEMENTS") as err:
        encode(over)
    assert err.value.rule == "frame.too_many_elements"
    assert refused(raw_frame(over)) == "frame.too_many_elements"


def nested(levels: int) -> Any:
    value: Any = 0
    for _ in range(levels):
        value = [value]
    return value


def test_nesting_of_max_depth_is_sent_and_one_level_more_is_refused_on_encode() -> None:
    # envelope map (1) > body map (2) > `levels` lists: no schema allows it, so validate=False
    under = envelope("done", {"x": nested(MAX_DEPTH - 2)})
    assert refused(encode(under, validate=False)).startswith("schema.")  # past every frame limit
    with pytest.raises(ProtocolError, match="MAX_DEPTH 1024") as err:
        encode(envelope("done", {"x": nested(MAX_DEPTH - 1)}), validate=False)
    assert err.value.rule == "frame.depth"


def test_a_map_key_a_decoder_cannot_read_is_refused_on_encode() -> None:
    bad = envelope("done", {"info": {1: 2}})
    with pytest.raises(ProtocolError) as err:
        encode(bad, validate=False)
    assert err.value.rule == "frame.map_key"
    assert refused(raw_frame(bad)) == "frame.invalid"


def arrays_frame(size: int) -> Envelope:
    """An arrays record whose frame is exactly `size` bytes."""
    def record(n: int) -> Envelope:
        return envelope("arrays", {"name": "x", "version": 0, "arrays": {"x": np.zeros(n, dtype=np.uint8)}}, "d0")
    first = len(encode(record(size)))
    return record(2 * size - first)


def test_a_frame_of_the_cap_round_trips_and_one_byte_more_is_refused_on_encode() -> None:
    cap = 5000
    exact = encode(arrays_frame(cap), max_bytes=cap)
    assert len(exact) == cap and decode(exact, max_bytes=cap).body["arrays"]["x"].size > 4800
    with pytest.raises(ProtocolError, match="cap of 5000") as err:
        encode(arrays_frame(cap + 1), max_bytes=cap)
    assert err.value.rule == "frame.too_large"
    assert refused(encode(arrays_frame(cap + 1), max_bytes=cap + 1), max_bytes=cap) == "frame.too_large"
    assert encode.__kwdefaults__["max_bytes"] == DEFAULT_MAX_BYTES


@pytest.mark.parametrize("signed", [False, True])
def test_a_transport_sends_up_to_its_own_cap_less_the_signature_trailer(signed: bool) -> None:
    from cryptography.hazmat.primitives.asymmetric import ed25519

    cap = 4096
    bus, got = LoopbackBus(), []
    receiver = LoopbackTransport(bus, role="edge", client_id="e0", max_bytes=cap)
    receiver.subscribe("splitedge/r/device/d0/up/#", lambda t, e: got.append(e))
    signer = Signer(ed25519.Ed25519PrivateKey.generate()) if signed else None
    sender = LoopbackTransport(bus, role="device", client_id="d0", max_bytes=cap, signer=signer)
    fits = cap - (TRAILER_LEN if signed else 0)
    sender.publish("splitedge/r/device/d0/up/arrays", arrays_frame(fits))
    with pytest.raises(ProtocolError) as err:
        sender.publish("splitedge/r/device/d0/up/arrays", arrays_frame(fits + 1))
    assert err.value.rule == "frame.too_large"
    assert len(got) == 1 and receiver.rejected == {}


# -- lists past one msgpack array: pages -----------------------------------------------------------

def wire_members(env: Envelope) -> list:
    return msgpack.unpackb(encode(env), raw=False, ext_hook=lambda c, d: d)["b"]["members"]


def test_up_to_1024_members_are_the_bytes_of_a_plain_list() -> None:
    members = ids(MAX_ARRAY_LEN)
    assert encode(hello(members)) == raw_frame(hello(members))  # as before paging existed
    assert wire_members(hello(members)) == members


@pytest.mark.parametrize("n", [MAX_ARRAY_LEN + 1, 5000, 65536])
def test_longer_member_lists_travel_as_full_pages_and_decode_flat(n: int) -> None:
    members = ids(n)
    pages = wire_members(hello(members))
    assert all(len(p) == MAX_ARRAY_LEN for p in pages[:-1]) and 0 < len(pages[-1]) <= MAX_ARRAY_LEN
    assert [d for p in pages for d in p] == members
    assert decode(encode(hello(members))).body["members"] == members


def test_more_members_than_the_schema_allows_are_refused_on_encode_and_on_decode() -> None:
    with pytest.raises(ProtocolError, match="more than 65536 items") as err:
        encode(hello(ids(65537)))
    assert err.value.rule == "schema.bounds"
    members = ids(65537)
    paged = hello([members[i:i + MAX_ARRAY_LEN] for i in range(0, len(members), MAX_ARRAY_LEN)])
    assert refused(raw_frame(paged)) == "schema.bounds"


@pytest.mark.parametrize("members, rule", [
    ([["d0"], []], "schema.bounds"),  # an empty page
    ([["d0"], "d1"], "schema.type"),  # pages and ids mixed
    ([["d/0"]], "schema.pattern"),  # each id is checked as in a flat list
])
def test_a_receiver_validates_every_page(members: list, rule: str) -> None:
    assert refused(raw_frame(hello(members))) == rule


def test_a_receiver_takes_the_paged_form_at_any_length() -> None:
    assert decode(raw_frame(hello([["d0", "d1"], ["d2"]]))).body["members"] == ["d0", "d1", "d2"]


def test_a_round_with_5000_participants_round_trips() -> None:
    body = {"method": "fedavg", "deadline_s": 1.0, "versions": {}, "config": {}, "participants": tuple(ids(5000))}
    assert decode(encode(envelope("round", body, sender="cloud"))).body["participants"] == ids(5000)


def test_a_list_field_cannot_promise_more_than_one_msgpack_array_holds() -> None:
    with pytest.raises(ValueError, match="use Paged"):
        List(items=Str(), max_items=MAX_ARRAY_LEN + 1)
    with pytest.raises(ValueError, match="lists"):
        Paged(items=List())


def test_protocol_md_alone_reads_a_paged_hello() -> None:
    doc = ProtocolDoc.load()
    topic = "splitedge/r/edge/e0/up/hello"
    env = check_message(doc, topic, encode(hello(ids(5000))), True)
    assert sum(len(p) for p in env["b"]["members"]) == 5000
    with pytest.raises(Violation, match="page"):
        check_message(doc, topic, raw_frame(hello([["d0"], []])), True)
