"""What the project serves holds under floods (issue 57, item 5).

The embedded broker (`splitedge broker`, amqtt) closes connections that send no CONNECT within
its deadline and those whose peer went away (descriptors return to baseline), ends a
connection whose packet is over max_packet_size when its header arrives and keeps serving the
others, and caps the connections it holds. The decoder's work is bounded by a frame's length:
hostile frames are refused by rule before the expensive part (counted here in elements and in
arrays decoded, never in wall-clock time: bench/floods.py measures the speed)."""

from __future__ import annotations

import re
import socket
import time
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest

from splitedge.protocol import codec
from splitedge.protocol.broker import CONNECT_TIMEOUT_S, MAX_PACKET_SIZE, EmbeddedBroker
from splitedge.protocol.codec import Envelope, decode, encode
from splitedge.protocol.errors import ProtocolError
from splitedge.protocol.limits import (
    ARRAY_COST, BYTES_PER_ELEMENT, DEFAULT_MAX_BYTES, FREE_ELEMENTS, MAX_ELEMENTS, check_frame, element_budget,
)
from splitedge.protocol.transport import LoopbackBus, LoopbackTransport

from brokers import wait_until
from splitedge.bench.floods import mqtt_connect_packet, varint
from protocol_doc import DOC, block, table

REPO = Path(__file__).resolve().parents[2]


# -- the embedded broker --------------------------------------------------------------------------

def server_sockets(port: int) -> list[str]:
    """States of the broker's side of its TCP connections (this process holds both sides)."""
    import psutil

    return [c.status for c in psutil.Process().net_connections("tcp")
            if c.laddr and c.laddr.port == port and c.raddr]


def mqtt_connect(port: int, client_id: str) -> socket.socket:
    """A raw MQTT 3.1.1 client: CONNECT sent, CONNACK (accepted) read."""
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(mqtt_connect_packet(client_id))
    assert s.recv(4) == b"\x20\x02\x00\x00"
    return s


def send(s: socket.socket, data: bytes) -> None:
    """Send what the broker may refuse part-way (it closes the connection: not this test's error)."""
    try:
        s.sendall(data)
    except OSError:
        pass


def closed_by_peer(s: socket.socket, timeout: float) -> bool:
    s.settimeout(timeout)
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True
    except socket.timeout:
        return False


@pytest.fixture()
def amqtt() -> None:
    pytest.importorskip("amqtt")


def test_the_default_packet_cap_is_the_deploy_brokers(amqtt: None) -> None:
    for conf in ("cloud.conf", "edge-site.conf"):
        text = (REPO / "deploy" / "mosquitto" / conf).read_text()
        assert re.findall(r"^max_packet_size\s+(\d+)\s*$", text, flags=re.M) == [str(MAX_PACKET_SIZE)]
    assert MAX_PACKET_SIZE > DEFAULT_MAX_BYTES  # a frame of the receivers' default cap crosses it
    assert 0 < CONNECT_TIMEOUT_S <= 10
    with pytest.raises(ValueError, match="max_packet_size"):
        EmbeddedBroker(max_packet_size=10)


def test_connections_without_connect_are_closed_and_descriptors_return_to_baseline(amqtt: None) -> None:
    with EmbeddedBroker(connect_timeout=0.5) as broker:
        assert server_sockets(broker.port) == []
        # Execute: 60 connections closed by their peer at once (amqtt left these in CLOSE_WAIT) ...
        for _ in range(60):
            socket.create_connection(("127.0.0.1", broker.port), timeout=5).close()
        # ... closed by the broker straight away, not at the deadline
        assert wait_until(lambda: server_sockets(broker.port) == [], 3), server_sockets(broker.port)
        # Execute: 60 that stay open and send nothing
        idle = [socket.create_connection(("127.0.0.1", broker.port), timeout=5) for _ in range(60)]
        try:
            assert wait_until(lambda: broker.guard_stats()["pending"] == 60, 5), broker.guard_stats()
            # Assert: the broker closes each one at its deadline, and keeps serving
            assert all(closed_by_peer(s, 10) for s in idle)
            assert wait_until(lambda: server_sockets(broker.port) == [], 3), server_sockets(broker.port)
            # each connection's handler counts itself closed once amqtt's coroutine for it returns, just
            # after its socket is gone (on a loaded box, later): wait for the count as for the sockets
            assert wait_until(lambda: broker.guard_stats()["open"] == 0, 3), broker.guard_stats()
            stats = broker.guard_stats()
            assert stats["no_connect"] == 60 and stats["open"] == 0 and stats["pending"] == 0, stats
            mqtt_connect(broker.port, "legit").close()
        finally:
            for s in idle:
                s.close()


def test_a_connection_sending_its_connect_bytes_slowly_gets_one_more_deadline_only(amqtt: None) -> None:
    with EmbeddedBroker(connect_timeout=0.5) as broker:
        s = socket.create_connection(("127.0.0.1", broker.port), timeout=5)
        try:
            s.sendall(b"\x10\x7f")  # a CONNECT header announcing 127 bytes, then nothing
            assert closed_by_peer(s, 10)
            stats = broker.guard_stats()
            assert stats["extended"] == 1 and stats["no_connect"] == 1, stats  # its bytes had started: once more
        finally:
            s.close()


def test_an_oversized_publish_is_refused_at_its_header_and_the_broker_keeps_serving(amqtt: None) -> None:
    import paho.mqtt.client as paho
    from paho.mqtt.enums import CallbackAPIVersion

    cap = 64 * 1024
    with EmbeddedBroker(max_packet_size=cap) as broker:
        got: list[bytes] = []
        sub = paho.Client(CallbackAPIVersion.VERSION2, client_id="sub")
        sub.on_message = lambda c, u, msg: got.append(msg.payload)
        sub.connect("127.0.0.1", broker.port)
        sub.loop_start()
        try:
            subscribed: list[int] = []
            sub.on_subscribe = lambda *a: subscribed.append(1)
            sub.subscribe("f/#", qos=1)
            assert wait_until(lambda: subscribed, 5)
            # Execute: a PUBLISH header announcing 100 MB, then a few bytes of it
            big = mqtt_connect(broker.port, "big")
            topic = b"f/big"
            send(big, b"\x30" + varint(2 + len(topic) + 100 * 1024 * 1024) + len(topic).to_bytes(2, "big") + topic
                 + b"x" * 4096)
            # Assert: that connection is closed, before its body came, and counted
            assert closed_by_peer(big, 10)
            big.close()
            assert broker.guard_stats().get("oversize") == 1, broker.guard_stats()
            # ... and the others are served: a packet of exactly the cap passes, one byte more does not
            pub = paho.Client(CallbackAPIVersion.VERSION2, client_id="pub")
            pub.connect("127.0.0.1", broker.port)
            pub.loop_start()
            try:
                overhead = 1 + len(varint(cap)) + 2 + len("f/ok") + 2  # fixed header, topic, packet id
                pub.publish("f/ok", b"a" * (cap - overhead), qos=1).wait_for_publish(10)
                assert wait_until(lambda: len(got) == 1, 10)
                assert len(got[0]) == cap - overhead
            finally:
                pub.loop_stop()
                pub.disconnect()
            over = mqtt_connect(broker.port, "over")
            send(over, b"\x30" + varint(cap) + b"\x00\x04f/no" + b"b" * 100)  # a packet of cap + 4 bytes, begun
            assert closed_by_peer(over, 10)
            over.close()
            assert broker.guard_stats()["oversize"] == 2
            mqtt_connect(broker.port, "legit").close()
            assert len(got) == 1
        finally:
            sub.loop_stop()
            sub.disconnect()


def test_a_packet_hidden_inside_a_longer_connect_cannot_outgrow_it(amqtt: None) -> None:
    """A CONNECT's fields need not fill the length its header gives; amqtt then reads what follows
    them as a new packet. Here that is a PUBLISH header announcing 100 MB: amqtt's read of its body
    would cross the end of the CONNECT, and is refused before it is made."""
    with EmbeddedBroker() as broker:
        fields = b"\x00\x04MQTT\x04\x02\x00\x3c\x00\x01a"
        hidden = b"\x30" + varint(3 + 100 * 1024 * 1024) + b"\x00\x01t"
        s = socket.create_connection(("127.0.0.1", broker.port), timeout=10)
        try:
            send(s, b"\x10" + varint(len(fields) + len(hidden) + 64) + fields + hidden + b"x" * 64)
            assert s.recv(4) == b"\x20\x02\x00\x00"  # CONNACK: amqtt took the CONNECT ...
            assert closed_by_peer(s, 10)  # ... and the connection ended at the hidden body
            assert broker.guard_stats().get("malformed") == 1, broker.guard_stats()
            mqtt_connect(broker.port, "legit").close()
        finally:
            s.close()


def test_at_the_connection_cap_an_idle_connection_makes_room_and_connected_ones_are_kept(amqtt: None) -> None:
    with EmbeddedBroker(max_connections=5, connect_timeout=30) as broker:
        connected = [mqtt_connect(broker.port, f"c{i}") for i in range(3)]
        idle = [socket.create_connection(("127.0.0.1", broker.port), timeout=5) for _ in range(2)]
        try:
            assert wait_until(lambda: broker.guard_stats()["open"] == 5, 5), broker.guard_stats()
            # Execute: a sixth client, at the cap: the oldest idle connection is closed for it
            connected.append(mqtt_connect(broker.port, "c3"))
            assert closed_by_peer(idle[0], 5)
            assert broker.guard_stats()["evicted"] == 1
            # Execute: a seventh: the last idle one goes; an eighth: nothing left to evict, refused
            connected.append(mqtt_connect(broker.port, "c4"))
            assert closed_by_peer(idle[1], 5)
            refused = socket.create_connection(("127.0.0.1", broker.port), timeout=5)
            assert closed_by_peer(refused, 5)
            refused.close()
            stats = broker.guard_stats()
            assert stats["full"] == 1 and stats["evicted"] == 2 and stats["open"] == 5, stats
            # Assert: the connected clients were kept
            for s in connected:
                s.sendall(b"\xc0\x00")  # PINGREQ
                assert s.recv(2) == b"\xd0\x00"  # PINGRESP
        finally:
            for s in connected + idle:
                s.close()


# -- the decoder ----------------------------------------------------------------------------------

def raw(kind: str, body: Any) -> bytes:
    """An envelope as a careless or hostile sender packs it (no encoder checks)."""
    return msgpack.packb({"v": 2, "k": kind, "r": "r", "n": 1, "s": "d0", "i": "0" * 32, "b": body}, use_bin_type=True)


def tiny_array() -> msgpack.ExtType:
    return msgpack.ExtType(1, b"\x08\x00" + bytes(4))  # a 0-d float32 zero


def refused(data: bytes) -> str:
    with pytest.raises(ProtocolError) as err:
        decode(data)
    return err.value.rule


@pytest.fixture()
def work(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Counts what a decode spent: arrays decoded and bodies validated (the expensive parts)."""
    spent = {"arrays": 0, "bodies": 0}
    ext_hook, validate_body = codec.ext_hook, codec.validate_body

    def counting_ext(code: int, payload: bytes) -> Any:
        spent["arrays"] += 1
        return ext_hook(code, payload)

    def counting_body(kind: str, body: Any) -> Any:
        spent["bodies"] += 1
        return validate_body(kind, body)

    monkeypatch.setattr(codec, "ext_hook", counting_ext)
    monkeypatch.setattr(codec, "validate_body", counting_body)
    return spent


def test_the_issues_done_of_small_int_lists_is_refused_before_its_body_is_validated(work: dict[str, int]) -> None:
    # the issue's frame: 130 kB holding 130,316 elements, one byte each (accepted before)
    data = raw("done", {"phase": "round", "info": {"method": {"x": [[1] * 1024 for _ in range(127)]}}})
    assert 130_000 < len(data) < 131_000
    assert refused(data) == "frame.too_dense"
    assert work["bodies"] == 0


def test_the_issues_map_of_tiny_arrays_is_refused_after_at_most_its_budget_of_arrays(work: dict[str, int]) -> None:
    data = raw("weights", {"part": "p", "version": 0, "samples": 1,
                           "weights": {f"w{i:06d}": tiny_array() for i in range(131_000)}})
    assert refused(data) == "frame.too_many_elements"
    assert work["arrays"] <= MAX_ELEMENTS // ARRAY_COST  # 16,384 of 131,000 decoded, then refused
    assert work["bodies"] == 0


def test_a_short_frame_of_tiny_arrays_is_refused_within_its_own_budget(work: dict[str, int]) -> None:
    data = raw("weights", {"part": "p", "version": 0, "samples": 1,
                           "weights": {f"w{i}": tiny_array() for i in range(5000)}})
    assert refused(data) == "frame.too_dense"
    assert work["arrays"] <= element_budget(len(data)) // ARRAY_COST < 5000


def test_a_map_header_past_the_budget_is_refused_at_the_header() -> None:
    data = raw("metrics", {})[:-1] + b"\xdf\x00\x02\x00\x00"  # a body map announcing 131,072 entries
    assert refused(data) == "frame.too_dense"
    assert refused(b"\xdf\xff\xff\xff\xff") == "frame.too_dense"


def test_short_ids_by_the_ten_thousand_are_refused_and_realistic_ones_pass() -> None:
    hello = {"role": "edge", "parent": "cloud", "samples": 1, "backend": "torch", "groups": []}

    def members(ids: list[str]) -> list[list[str]]:
        return [ids[i:i + 1024] for i in range(0, len(ids), 1024)]

    one_char = [chr(ord("a") + i % 26) for i in range(20_000)]
    assert refused(raw("hello", {**hello, "members": members(one_char)})) == "frame.too_dense"
    ids = [f"d{i}" for i in range(20_000)]  # as a sim names its devices
    assert len(decode(raw("hello", {**hello, "members": members(ids)})).body["members"]) == 20_000


def test_deep_nesting_is_refused_by_depth_and_costs_its_levels() -> None:
    assert refused(raw("done", {"phase": "round", "info": {"method": {"x": [[[[[[[[[[0]]]]]]]]]]}}})) == "schema.depth"
    assert refused(b"\x91" * 5000 + b"\x00") == "frame.depth"
    # 100 nests of 1,000 levels in one frame: each level is an element its bytes must pay for
    nests = b"\x91" * 1000 + b"\x00"
    assert refused(b"\xdc\x00\x64" + nests * 100) == "frame.too_dense"


def test_the_budget_is_linear_in_the_frame_and_the_encoder_refuses_what_decoders_refuse() -> None:
    assert element_budget(0) == FREE_ELEMENTS
    assert element_budget(4000 * BYTES_PER_ELEMENT) == FREE_ELEMENTS + 4000
    assert element_budget(DEFAULT_MAX_BYTES) == MAX_ELEMENTS

    def body(pad: int) -> dict[str, Any]:  # 8 lists of 1,000 zeros: about 8,000 elements in 8 kB
        return {"phase": "round", "info": {"method": {"x": [[0] * 1000] * 8, "pad": "p" * pad}}, "session": ""}

    def frame(pad: int) -> tuple[dict[str, Any], bytes]:
        doc = {"v": 2, "k": "done", "r": "r", "n": 1, "s": "d0", "i": "0" * 32, "b": body(pad)}
        return doc, msgpack.packb(doc, use_bin_type=True)

    doc, data = frame(0)
    elements = check_frame(doc)  # counted as the decoder counts them
    need = (elements - FREE_ELEMENTS) * BYTES_PER_ELEMENT  # the shortest frame that pays for them
    pad = need - len(data)
    pad += need - len(frame(pad)[1])  # the pad's own str header
    exact, short = frame(pad)[1], frame(pad - 1)[1]
    assert len(exact) == need and len(short) == need - 1
    # Assert: the frame that pays for its elements round-trips, one byte shorter is refused, by both
    env = Envelope(kind="done", run="r", round=1, sender="d0", msg_id="0" * 32, body=body(pad))
    assert encode(env) == exact and decode(exact).body["info"]["method"]["pad"] == "p" * pad
    assert refused(short) == "frame.too_dense"
    with pytest.raises(ProtocolError) as err:
        encode(Envelope(kind="done", run="r", round=1, sender="d0", msg_id="0" * 32, body=body(pad - 1)))
    assert err.value.rule == "frame.too_dense"


def test_arrays_count_against_the_budget_as_the_encoder_counts_them() -> None:
    weights = {f"w{i}": np.zeros((), np.float32) for i in range(MAX_ELEMENTS // ARRAY_COST)}
    env = Envelope(kind="weights", run="r", round=1, sender="d0",
                   body={"part": "p", "version": 0, "samples": 1, "weights": weights})
    with pytest.raises(ProtocolError) as err:
        encode(env)
    assert err.value.rule == "frame.too_many_elements"
    small = {f"layer{i}.weight": np.zeros((8, 8), np.float32) for i in range(300)}  # a model's worth
    env = Envelope(kind="weights", run="r", round=1, sender="d0",
                   body={"part": "p", "version": 0, "samples": 1, "weights": small})
    assert len(decode(encode(env)).body["weights"]) == 300


def test_a_refused_dense_frame_is_counted_by_its_rule_and_the_receiver_goes_on() -> None:
    bus = LoopbackBus()
    got: list[Envelope] = []
    receiver = LoopbackTransport(bus, role="edge", client_id="e0")
    receiver.subscribe("splitedge/r/device/d0/up/#", lambda t, e: got.append(e))
    sender = LoopbackTransport(bus, role="device", client_id="d0")
    sender.publish_raw("splitedge/r/device/d0/up/done",
                       raw("done", {"phase": "round", "info": {"method": {"x": [[1] * 1024 for _ in range(8)]}}}))
    ok = Envelope(kind="done", run="r", round=1, sender="d0", body={"phase": "round", "info": {}})
    sender.publish("splitedge/r/device/d0/up/done", ok)
    assert wait_until(lambda: len(got) == 1, 5)
    assert receiver.rejected == {"frame.too_dense": 1}


def test_protocol_md_budget_table_is_the_codec_constants() -> None:
    rows = table(block(DOC.read_text(encoding="utf-8"), "budget"))
    assert {r["constant"]: int(r["value"]) for r in rows} == {
        "FREE_ELEMENTS": FREE_ELEMENTS, "BYTES_PER_ELEMENT": BYTES_PER_ELEMENT, "ARRAY_COST": ARRAY_COST}
