"""Byte accounting: exact MQTT 3.1.1 packet sizes and exact agreement with bytes on a socket."""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest

from splitedge.protocol.accounting import (
    ByteCounters,
    connect_packet_bytes,
    publish_packet_bytes,
    remaining_length_bytes,
    subscribe_packet_bytes,
)
from splitedge.protocol.codec import Envelope, encode
from splitedge.protocol.topics import topic


def varint(n: int) -> bytes:
    """Independent MQTT remaining-length encoder (spec 2.2.3 pseudo-code)."""
    out = bytearray()
    while True:
        n, digit = divmod(n, 128)
        out.append(digit | (0x80 if n else 0))
        if not n:
            return bytes(out)


def hand_built_publish(topic_name: str, payload: bytes, qos: int) -> bytes:
    t = topic_name.encode()
    body = len(t).to_bytes(2, "big") + t + (b"\x00\x01" if qos else b"") + payload
    return bytes([0x30 | (qos << 1)]) + varint(len(body)) + body


@pytest.mark.parametrize("remaining, size", [
    (0, 1), (127, 1), (128, 2), (16383, 2), (16384, 3), (2097151, 3), (2097152, 4), (268435455, 4),
])
def test_remaining_length_boundaries(remaining: int, size: int) -> None:
    assert remaining_length_bytes(remaining) == size == len(varint(remaining))


def test_remaining_length_out_of_range() -> None:
    with pytest.raises(ValueError):
        remaining_length_bytes(268435456)


# topic "t" -> remaining = 2 + 1 (+2 packet id) + payload; pick payloads on the varint boundaries
@pytest.mark.parametrize("qos, payload_len, expected", [
    (0, 0, 5), (0, 124, 129), (0, 125, 131), (1, 122, 129), (1, 123, 131),
    (0, 16380, 16383 + 3), (0, 16381, 16384 + 4), (1, 16378, 16383 + 3), (1, 16379, 16384 + 4),
])
def test_publish_packet_size_exact_at_boundaries(qos: int, payload_len: int, expected: int) -> None:
    publish = pytest.importorskip("amqtt.mqtt.publish")  # an independent MQTT encoder
    payload = bytes(payload_len)
    packet = hand_built_publish("t", payload, qos)
    amqtt_packet = publish.PublishPacket.build("t", payload, 1 if qos else None, False, qos, False).to_bytes()

    assert publish_packet_bytes("t", payload_len, qos) == expected == len(packet) == len(amqtt_packet)


def test_publish_packet_counts_utf8_topic_bytes() -> None:
    assert publish_packet_bytes("é", 0, 0) == len(hand_built_publish("é", b"", 0)) == 6


def test_counters_snapshot_total_reset() -> None:
    c = ByteCounters("edge")
    c.record("out", "moments", 100, 120)
    c.record("out", "moments", 50, 70)
    c.record("in", "round", 10, 30)
    c.record_control("out", 14, "CONNECT")

    snap = c.snapshot()
    assert snap == {"out": {"moments": {"messages": 2, "payload": 150, "packet": 190}},
                    "in": {"round": {"messages": 1, "payload": 10, "packet": 30}},
                    "control": {"out": 14, "in": 0}}
    assert c.total("out") == 150 and c.total("out", "packet") == 190 and c.total("out", "wire") == 204
    assert c.total("out", "messages") == 2 and c.role == "edge"
    assert c.control_breakdown()["out"] == {"CONNECT": 14}
    snap["out"]["moments"]["payload"] = 0  # a snapshot is a copy
    assert c.total("out") == 150
    c.reset()
    assert c.total("out", "wire") == 0 and c.snapshot()["out"] == {}
    with pytest.raises(ValueError):
        c.record("sideways", "x", 1, 1)


def test_counters_are_thread_safe() -> None:
    c = ByteCounters("device")

    def work() -> None:
        for _ in range(2000):
            c.record("out", "k", 3, 5)
            c.record_control("in", 2)

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert c.snapshot()["out"]["k"] == {"messages": 16000, "payload": 48000, "packet": 80000}
    assert c.total("in", "wire") == 32000


class FakeBroker:
    """Just enough MQTT 3.1.1 to count every byte a client writes and reads on the socket."""

    def __init__(self, push: bytes) -> None:
        self.push = push  # a PUBLISH (QoS 1) sent to the client after its first SUBSCRIBE
        self.received = 0
        self.sent = 0
        self.packets: list[int] = []
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _read(self, conn: socket.socket, n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = conn.recv(n - len(data))
            if not chunk:
                raise EOFError
            data += chunk
        self.received += n
        return data

    def _send(self, conn: socket.socket, data: bytes) -> None:
        conn.sendall(data)
        self.sent += len(data)

    def _serve(self) -> None:
        conn, _ = self.server.accept()
        with conn:
            try:
                while True:
                    self._handle(conn)
            except (EOFError, OSError):
                pass

    def _handle(self, conn: socket.socket) -> None:
        first = self._read(conn, 1)[0]
        remaining, shift = 0, 0
        while True:
            digit = self._read(conn, 1)[0]
            remaining += (digit & 0x7F) << shift
            shift += 7
            if not digit & 0x80:
                break
        body = self._read(conn, remaining)
        kind = first >> 4
        self.packets.append(kind)
        if kind == 1:  # CONNECT -> CONNACK
            self._send(conn, b"\x20\x02\x00\x00")
        elif kind == 8:  # SUBSCRIBE -> SUBACK (granted QoS 1), then push a message
            self._send(conn, b"\x90\x03" + body[:2] + b"\x01")
            self._send(conn, self.push)
        elif kind == 3 and (first >> 1) & 3:  # PUBLISH QoS 1 -> PUBACK
            tlen = int.from_bytes(body[:2], "big")
            self._send(conn, b"\x40\x02" + body[2 + tlen:4 + tlen])
        elif kind == 12:  # PINGREQ -> PINGRESP
            self._send(conn, b"\xd0\x00")
        elif kind == 14:  # DISCONNECT
            raise EOFError


def test_mqtt_transport_counts_exactly_the_bytes_on_the_socket() -> None:
    from splitedge.protocol.mqtt import MqttTransport

    run = "acct"
    status = Envelope("status", run, 0, "c", {"state": "online", "role": "cloud"})
    down = topic(run, "cloud", "c", "down", "status")
    push_payload = encode(status)
    push = hand_built_publish(down, push_payload, 1)
    broker = FakeBroker(push)
    will = (topic(run, "device", "d1", "up", "status"), Envelope("status", run, 0, "d1",
                                                                  {"state": "offline", "role": "device"}))
    t = MqttTransport(f"mqtt://u%40x:secret@127.0.0.1:{broker.port}", client_id="acct-d1", role="device",
                      will=will, keepalive=1, connect_timeout=5)
    got: list[Envelope] = []
    t.subscribe(down, lambda _t, e: got.append(e))
    w = Envelope("weights", run, 1, "d1", {"part": "wc", "version": 0, "samples": 1,
                                           "weights": {"x": np.arange(300, dtype="f4")}})
    t.publish(topic(run, "device", "d1", "up", "weights"), w, wait=5)
    t.publish(topic(run, "device", "d1", "up", "weights"), w, qos=0)
    assert t.wait_for(lambda: got, 5)
    time.sleep(1.6)  # let one keepalive PINGREQ/PINGRESP happen

    t.close()
    broker.thread.join(5)

    assert 12 in broker.packets  # a PINGREQ was on the wire, and counted below
    assert t.counters.total("out", "wire") == broker.received
    assert t.counters.total("in", "wire") == broker.sent
    assert t.counters.control_breakdown()["out"]["CONNECT"] == connect_packet_bytes(
        "acct-d1", will_topic=will[0], will_payload_len=len(encode(will[1])), username="u@x", password="secret")
    assert t.counters.control_breakdown()["out"]["SUBSCRIBE"] == subscribe_packet_bytes([down])
