"""What the broker saw versus what our transports counted.

The bandwidth numbers are only worth publishing if the transports' own counters agree with
an outside witness, so the bench follows Mosquitto's ``$SYS/broker/bytes/received`` the way
``tests/broker/test_broker.py`` does (a plain paho client, QoS 0, retained values ignored) and
collects every transport a run opens through :func:`capture_transports`, so the counters can
be read after the run without the bench touching strategies or runtimes.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any, Iterator

import paho.mqtt.client as paho
from paho.mqtt.enums import CallbackAPIVersion

from splitedge.protocol.mqtt import parse_url
from splitedge.protocol.transport import Transport, wait_for

SYS_RECEIVED = "$SYS/broker/bytes/received"


class SysMonitor:
    """A plain paho client following one numeric ``$SYS`` topic (QoS 0: no PUBACKs of its own).

    Mosquitto 2.0 republishes ``$SYS`` only when a value changed, at most every
    ``sys_interval`` (about every 2 s at ``sys_interval 1``). The retained value handed over
    on subscribe predates us and is dropped; a live value already includes this monitor's
    CONNECT and SUBSCRIBE, so a later delta counts only other clients (and our pings, 2 B
    each every 60 s).
    """

    def __init__(self, url: str, topic: str = SYS_RECEIVED) -> None:
        _, host, port, _, _ = parse_url(url)
        self.values: list[tuple[float, int]] = []
        self._lock = threading.Lock()
        self._client = paho.Client(CallbackAPIVersion.VERSION2, client_id=f"bench-sys-{id(self):x}",
                                   protocol=paho.MQTTv311)
        self._client.on_message = self._on_message
        self._client.connect(host, port, keepalive=60)
        self._client.subscribe(topic, qos=0)
        self._client.loop_start()

    def _on_message(self, client: paho.Client, userdata: object, msg: paho.MQTTMessage) -> None:
        if msg.retain:
            return
        with self._lock:
            self.values.append((time.monotonic(), int(msg.payload)))

    def next_value(self, after: float, timeout: float = 8.0) -> int:
        """First value published after monotonic time ``after``; TimeoutError if none comes."""
        def find() -> int | None:
            with self._lock:
                return next((v for ts, v in self.values if ts > after), None)

        if not wait_for(lambda: find() is not None, timeout):
            raise TimeoutError(f"no {SYS_RECEIVED} update within {timeout:g}s (is sys_interval set?)")
        value = find()
        assert value is not None
        return value

    def settled_value(self, since: float, quiet: float = 3.0) -> int:
        """The broker's count once nothing has changed since ``since``.

        A value published after ``since`` is current. If none comes within ``quiet`` seconds
        (longer than Mosquitto's ~2 s republish period), the count has not changed since
        ``since`` and the latest value published before it is already the final one.
        """
        try:
            return self.next_value(after=since, timeout=quiet)
        except TimeoutError:
            with self._lock:
                if not self.values:
                    raise
                return self.values[-1][1]

    def close(self) -> None:
        self._client.disconnect()
        self._client.loop_stop()

    def __enter__(self) -> SysMonitor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextlib.contextmanager
def capture_transports() -> Iterator[list[Transport]]:
    """Collect every transport opened through ``runtime.session.connect`` inside the block.

    The runtimes and ``sim`` open their MQTT connections through that one function, so
    wrapping it is the transport-level tap the bench needs: counters are read, nothing else
    changes. A run that opens no transport through it yields an empty list, which callers
    treat as an error rather than reporting zero bytes.
    """
    import splitedge.runtime.session as node

    opened: list[Transport] = []
    original = node.connect

    def tapped(*args: Any, **kwargs: Any) -> Transport:
        transport = original(*args, **kwargs)
        opened.append(transport)
        return transport

    node.connect = tapped
    try:
        yield opened
    finally:
        node.connect = original


def tier_totals(transports: list[Transport]) -> dict[str, dict[str, int]]:
    """Bytes by tier: ``{tier: {out_payload, out_packet, out_wire, in_payload, ...}}``."""
    out: dict[str, dict[str, int]] = {}
    for t in transports:
        row = out.setdefault(t.role, {})
        for direction in ("out", "in"):
            for field in ("payload", "packet", "wire"):
                key = f"{direction}_{field}"
                row[key] = row.get(key, 0) + t.counters.total(direction, field)
    return out


def agreement(counted: int, broker_delta: int) -> dict[str, Any]:
    """The cross-check record: both numbers and the relative difference in percent."""
    diff = abs(counted - broker_delta) / broker_delta if broker_delta else float("inf")
    return {"counted_out_wire": counted, "broker_received_delta": broker_delta,
            "diff_bytes": counted - broker_delta, "diff_pct": 100.0 * diff}
