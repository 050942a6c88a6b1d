"""Byte accounting at the transport: payload bytes and MQTT 3.1.1 packet bytes.

Bandwidth is a headline result of splitedge, so the bench must not estimate it: every
transport records each PUBLISH it sends or receives (payload and exact packet size from the
MQTT 3.1.1 framing) by message kind and direction, plus the control packets it knows about
(CONNECT, SUBSCRIBE, PUBACK, PINGREQ, ...) under ``control``. Summed, ``total(d, "wire")``
can be compared with what a broker reports (Mosquitto's ``$SYS/broker/bytes/received``).

Packet sizes are computed, not sniffed: the formulas below are the MQTT 3.1.1 framing
(section 2 and 3), tested byte-exactly against hand-built packets.
"""

from __future__ import annotations

import copy
import threading
from typing import Any

DIRECTIONS = ("out", "in")
FIELDS = ("messages", "payload", "packet")

# Fixed sizes of MQTT 3.1.1 control packets without a variable payload.
PUBACK_BYTES = 4  # 0x40, 0x02, packet id (2)
CONNACK_BYTES = 4  # 0x20, 0x02, flags, return code
UNSUBACK_BYTES = 4
PINGREQ_BYTES = 2
PINGRESP_BYTES = 2
DISCONNECT_BYTES = 2
MAX_REMAINING_LENGTH = 268_435_455  # 4-byte varint limit


def remaining_length_bytes(remaining: int) -> int:
    """Size of the remaining-length varint (1..4 bytes, 7 bits each)."""
    if remaining < 0 or remaining > MAX_REMAINING_LENGTH:
        raise ValueError(f"remaining length {remaining} outside 0..{MAX_REMAINING_LENGTH}")
    size = 1
    while remaining >= 128:
        remaining //= 128
        size += 1
    return size


def _framed(remaining: int) -> int:
    """Whole packet size: 1 header byte + varint + the rest."""
    return 1 + remaining_length_bytes(remaining) + remaining


def _strlen(value: str | bytes | None) -> int:
    if value is None:
        return 0
    return len(value.encode("utf-8") if isinstance(value, str) else value)


def publish_packet_bytes(topic: str | bytes, payload_len: int, qos: int) -> int:
    """PUBLISH: header + varint + 2-byte topic length + topic + packet id (qos>0) + payload."""
    remaining = 2 + _strlen(topic) + (2 if qos > 0 else 0) + payload_len
    return _framed(remaining)


def connect_packet_bytes(client_id: str, *, will_topic: str | None = None, will_payload_len: int = 0,
                         username: str | None = None, password: str | bytes | None = None) -> int:
    """CONNECT (3.1.1): 10-byte variable header, then length-prefixed client id, will, credentials."""
    remaining = 10 + 2 + _strlen(client_id)
    if will_topic is not None:
        remaining += 2 + _strlen(will_topic) + 2 + will_payload_len
    if username is not None:
        remaining += 2 + _strlen(username)
        if password is not None:
            remaining += 2 + _strlen(password)
    return _framed(remaining)


def subscribe_packet_bytes(filters: list[str]) -> int:
    """SUBSCRIBE: packet id + (2-byte length + filter + requested QoS byte) per filter."""
    return _framed(2 + sum(2 + _strlen(f) + 1 for f in filters))


def suback_packet_bytes(n_filters: int) -> int:
    """SUBACK: packet id + one return code per filter."""
    return _framed(2 + n_filters)


def unsubscribe_packet_bytes(filters: list[str]) -> int:
    """UNSUBSCRIBE: packet id + (2-byte length + filter) per filter."""
    return _framed(2 + sum(2 + _strlen(f) for f in filters))


class ByteCounters:
    """Thread-safe counters of messages, payload bytes and packet bytes by direction and kind.

    Transports call :meth:`record` from their network thread while the runtime publishes from
    another, so every update and read takes one lock. ``role`` is stored so that a bench can
    attribute a snapshot to a device, an edge or the cloud.
    """

    def __init__(self, role: str = "") -> None:
        self.role = role
        self._lock = threading.Lock()
        self._data: dict[str, Any] = {}
        self._control_packets: dict[str, dict[str, int]] = {}
        self.reset()

    def reset(self) -> None:
        """Start counting from zero (e.g. at the start of a measured phase)."""
        with self._lock:
            self._data = {"out": {}, "in": {}, "control": {"out": 0, "in": 0}}
            self._control_packets = {"out": {}, "in": {}}

    def record(self, direction: str, kind: str, payload_bytes: int, packet_bytes: int) -> None:
        """Count one PUBLISH of ``kind`` sent ("out") or received ("in")."""
        _check_direction(direction)
        with self._lock:
            row = self._data[direction].setdefault(kind, {"messages": 0, "payload": 0, "packet": 0})
            row["messages"] += 1
            row["payload"] += payload_bytes
            row["packet"] += packet_bytes

    def record_control(self, direction: str, packet_bytes: int, packet_type: str = "other") -> None:
        """Count a non-PUBLISH packet (CONNECT, SUBSCRIBE, PUBACK, PINGREQ, DISCONNECT, ...)."""
        _check_direction(direction)
        with self._lock:
            self._data["control"][direction] += packet_bytes
            per_type = self._control_packets[direction]
            per_type[packet_type] = per_type.get(packet_type, 0) + packet_bytes

    def state(self) -> dict[str, Any]:
        """Everything counted so far (`carry_on` adds it to another connection's counters)."""
        with self._lock:
            return copy.deepcopy({"data": self._data, "control_packets": self._control_packets})

    def carry_on(self, saved: dict[str, Any]) -> None:
        """Add what an earlier connection of the same node counted (`state`): a resumed sim's
        byte counts cover the whole run, not only the part after the restart."""
        with self._lock:
            for direction in DIRECTIONS:
                for kind, row in saved["data"][direction].items():
                    into = self._data[direction].setdefault(kind, {"messages": 0, "payload": 0, "packet": 0})
                    for name in into:
                        into[name] += int(row.get(name, 0))
                self._data["control"][direction] += int(saved["data"]["control"][direction])
                per_type = self._control_packets[direction]
                for packet_type, n in saved["control_packets"][direction].items():
                    per_type[packet_type] = per_type.get(packet_type, 0) + int(n)

    def snapshot(self) -> dict[str, Any]:
        """A deep copy: ``{"out": {kind: {messages, payload, packet}}, "in": {...}, "control": {"out", "in"}}``."""
        with self._lock:
            return copy.deepcopy(self._data)

    def control_breakdown(self) -> dict[str, dict[str, int]]:
        """Control bytes per packet type and direction (for debugging a mismatch with the broker)."""
        with self._lock:
            return copy.deepcopy(self._control_packets)

    def total(self, direction: str, field: str = "payload") -> int:
        """Sum over kinds of ``field`` ("messages", "payload", "packet"), or "wire" = packet + control."""
        _check_direction(direction)
        if field not in FIELDS and field != "wire":
            raise ValueError(f"field must be one of {FIELDS + ('wire',)}, got {field!r}")
        with self._lock:
            name = "packet" if field == "wire" else field
            value = sum(row[name] for row in self._data[direction].values())
            if field == "wire":
                value += self._data["control"][direction]
            return value

    def __repr__(self) -> str:
        return (f"ByteCounters(role={self.role!r}, out={self.total('out', 'wire')}B, "
                f"in={self.total('in', 'wire')}B)")


def _check_direction(direction: str) -> None:
    if direction not in DIRECTIONS:
        raise ValueError(f"direction must be 'out' or 'in', got {direction!r}")
