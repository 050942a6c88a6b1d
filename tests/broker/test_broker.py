"""Brokers and MQTT-only behaviour: start/stop, connect errors, reconnect + resubscribe, and the
byte-agreement acceptance test against Mosquitto's own $SYS counters."""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import paho.mqtt.client as paho
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from splitedge.protocol.broker import EmbeddedBroker, MosquittoBroker, free_port, wait_port
from splitedge.protocol.codec import Envelope
from splitedge.protocol.mqtt import MqttTransport, parse_url
from splitedge.protocol.topics import pattern, topic
from splitedge.protocol.transport import wait_for

logger = logging.getLogger(__name__)
REPO = Path(__file__).resolve().parents[2]
RUN = "brk"
needs_mosquitto = pytest.mark.usefixtures("mosquitto_binary")  # skipped locally, failed on CI (brokers.py)


def status(state: str, rnd: int = 0) -> Envelope:
    return Envelope("status", RUN, rnd, "d1", {"state": state, "role": "device"})


def test_embedded_broker_starts_on_a_free_port_and_stops() -> None:
    pytest.importorskip("amqtt")
    with EmbeddedBroker() as broker:
        assert broker.url == f"mqtt://127.0.0.1:{broker.port}" and broker.port != 1883
        with MqttTransport(broker.url, client_id="probe", role="device") as t:
            assert t.connected
    assert not wait_port("127.0.0.1", broker.port, 0.2)  # the listener is closed


@needs_mosquitto
def test_mosquitto_broker_reports_a_bad_config() -> None:
    with pytest.raises(RuntimeError, match="mosquitto did not start"):
        MosquittoBroker(extra_conf="no_such_option 1").start(timeout=3)


def test_connect_timeout_raises_connection_error_with_url() -> None:
    port = free_port()
    start = time.monotonic()
    with pytest.raises(ConnectionError, match=f"mqtt://127.0.0.1:{port}.*no broker reachable"):
        MqttTransport(f"mqtt://127.0.0.1:{port}", client_id="nobody", role="device", connect_timeout=0.5)
    assert time.monotonic() - start < 3


@pytest.mark.parametrize("url, expected", [
    ("mqtt://h:1234", ("mqtt", "h", 1234, None, None)),
    ("mqtts://broker.example", ("mqtts", "broker.example", 8883, None, None)),
    ("mqtt://al%40ice:p%3Ass@10.0.0.2", ("mqtt", "10.0.0.2", 1883, "al@ice", "p:ss")),
])
def test_parse_url(url: str, expected: tuple) -> None:
    assert parse_url(url) == expected


def test_parse_url_rejects_other_schemes() -> None:
    with pytest.raises(ValueError, match="mqtt://"):
        parse_url("http://h:1883")


@needs_mosquitto
def test_reconnect_and_resubscribe_after_broker_restart() -> None:
    with MosquittoBroker() as broker:
        sub = MqttTransport(broker.url, client_id="resub", role="edge", keepalive=2,
                            reconnect_min=0.1, reconnect_max=0.5)
        got: list[int] = []
        sub.subscribe(pattern(RUN, kind="status"), lambda t, e: got.append(e.round))

        broker.restart()
        assert wait_for(lambda: sub.reconnects == 1 and sub.connected, 10)
        pub = MqttTransport(broker.url, client_id="resub-pub", role="device")
        pub.publish(topic(RUN, "device", "d1", "up", "status"), status("online", rnd=7), wait=5)

        assert wait_for(lambda: got == [7], 5)
        pub.close()
        sub.close()


@needs_mosquitto
@pytest.mark.parametrize("persistence", [False, True])
def test_a_node_is_online_again_after_a_graceful_broker_restart(persistence: bool, tmp_path: Path) -> None:
    from splitedge.runtime.node import Node
    from splitedge.runtime.session import check_identity_free, connect

    conf = f"persistence true\npersistence_location {tmp_path}/\n" if persistence else ""
    with MosquittoBroker(extra_conf=conf) as broker:
        # Prepare: an edge announces itself online (its will says offline); a watcher follows it
        node = Node(run=RUN, tier="edge", node_id="e0")
        transport = connect(broker.url, run=RUN, tier="edge", node_id="e0", keepalive=2, reconnect_min=0.1,
                            reconnect_max=0.5)
        node.announce_online(transport)
        seen: list[str] = []
        watcher = MqttTransport(broker.url, client_id="watch", role="cloud", keepalive=2, reconnect_min=0.1,
                                reconnect_max=0.5)
        watcher.subscribe(topic(RUN, "edge", "e0", "up", "status"), lambda t, e: seen.append(e.body["state"]))
        assert wait_for(lambda: seen == ["online"], 5)
        # Execute: SIGTERM and start again on the port (Mosquitto fires every client's will)
        broker.restart()
        assert wait_for(lambda: transport.reconnects == 1 and watcher.reconnects == 1, 15)
        # Assert: the node said online again, to those listening and to those who come later
        assert wait_for(lambda: seen and seen[-1] == "online" and len(seen) > 1, 5), seen
        with pytest.raises(ValueError, match="another edge with id 'e0' is online"):
            check_identity_free(broker.url, run=RUN, tier="edge", node_id="e0")
        watcher.close()
        transport.close(offline=True)


def test_serve_forever_runs_until_ctrl_c() -> None:
    pytest.importorskip("amqtt")
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", f"from splitedge.protocol.broker import serve_forever; serve_forever({port})"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert wait_port("127.0.0.1", port, 15)
        with MqttTransport(f"mqtt://127.0.0.1:{port}", client_id="cli", role="device") as t:
            t.publish(topic(RUN, "device", "d1", "up", "status"), status("online"), wait=5)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0  # generous: on a loaded 2-core box the shutdown alone took over 10 s
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)


class SysMonitor:
    """A plain paho client following $SYS/broker/bytes/received (QoS 0, no PUBACKs, no pings)."""

    def __init__(self, url: str) -> None:
        _, host, port, _, _ = parse_url(url)
        self.values: list[tuple[float, int]] = []
        self.lock = threading.Lock()
        self.client = paho.Client(CallbackAPIVersion.VERSION2, client_id="sys-monitor", protocol=paho.MQTTv311)
        self.client.on_message = self._on_message
        self.client.connect(host, port, keepalive=60)
        self.client.subscribe("$SYS/broker/bytes/received", qos=0)
        self.client.loop_start()

    def _on_message(self, client: paho.Client, userdata: object, msg: paho.MQTTMessage) -> None:
        if msg.retain:  # the stale value handed over on subscribe, from before we connected
            return
        with self.lock:
            self.values.append((time.monotonic(), int(msg.payload)))

    def next_value(self, after: float, timeout: float = 5.0) -> int:
        """First value published after monotonic time ``after``.

        Mosquitto 2.0 republishes $SYS only when a value changed, at most every
        sys_interval (in practice every 2 s at sys_interval 1: it compares whole seconds with >).
        A live (non-retained) value is computed after our SUBSCRIBE was processed, so it
        includes the monitor's own CONNECT and SUBSCRIBE.
        """
        def find() -> int | None:
            with self.lock:
                return next((v for ts, v in self.values if ts > after), None)
        assert wait_for(lambda: find() is not None, timeout), "no $SYS/broker/bytes/received update"
        value = find()
        assert value is not None
        return value

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


@needs_mosquitto
def test_byte_agreement_with_mosquitto_sys_counters(record_property: pytest.RecordProperty) -> None:
    """Acceptance: bytes the transport counts OUT (PUBLISH + control) match the broker's view."""
    with MosquittoBroker(sys_interval=1) as broker:
        monitor = SysMonitor(broker.url)
        try:
            before = monitor.next_value(after=0.0)
            t = MqttTransport(broker.url, client_id="bytes-d1", role="device")
            x = np.random.default_rng(0).standard_normal(2048).astype("f4")  # ~8 KiB arrays
            for rnd in range(200):
                env = Envelope("weights", RUN, rnd, "d1", {"part": "wc", "version": rnd, "samples": 1,
                                                           "weights": {"x": x}})
                t.publish(topic(RUN, "device", "d1", "up", "weights"), env)
            assert t.flush(10)
            t.close()
            closed_at = time.monotonic()
            counted = t.counters.total("out", "wire")
            delta = monitor.next_value(after=closed_at) - before
        finally:
            monitor.close()
    diff = abs(counted - delta) / delta
    record_property("bytes_counted_out", counted)
    record_property("bytes_broker_delta", delta)
    print(f"\nbyte agreement: transport counted {counted} B out, Mosquitto received {delta} B "
          f"(diff {counted - delta:+d} B, {100 * diff:.4f} %)")
    assert diff < 0.02


def make_test_pki(directory: Path) -> dict[str, str]:
    """A throw-away CA and a server certificate for 127.0.0.1 (openssl CLI)."""
    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=directory, check=True, capture_output=True)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt", "-days", "1",
        "-subj", "/CN=splitedge-test-ca")
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr",
        "-subj", "/CN=127.0.0.1")
    (directory / "ext.cnf").write_text("subjectAltName=IP:127.0.0.1\n")
    run("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
        "-out", "server.crt", "-days", "1", "-extfile", "ext.cnf")
    return {"ca": str(directory / "ca.crt"), "server": str(directory / "server.crt"),
            "server_key": str(directory / "server.key")}


@needs_mosquitto
def test_mqtts_with_ca_certificate(tmp_path: Path) -> None:
    if subprocess.run(["which", "openssl"], capture_output=True).returncode != 0:
        pytest.skip("openssl CLI not installed")
    pki = make_test_pki(tmp_path)
    tls = f"cafile {pki['ca']}\ncertfile {pki['server']}\nkeyfile {pki['server_key']}\n"
    with MosquittoBroker(extra_conf=tls) as broker:
        url = f"mqtts://127.0.0.1:{broker.port}"
        with MqttTransport(url, client_id="tls-d1", role="device", ca_certs=pki["ca"], connect_timeout=5) as t:
            got: list[Envelope] = []
            t.subscribe(pattern(RUN, kind="status"), lambda _t, e: got.append(e))
            t.publish(topic(RUN, "device", "d1", "up", "status"), status("online"))
            assert wait_for(lambda: got, 5)
        with pytest.raises(ConnectionError, match="no CONNACK"):  # plain MQTT on a TLS port
            MqttTransport(broker.url, client_id="plain", role="device", connect_timeout=1)



def test_subscription_table_can_change_while_amqtt_iterates_it() -> None:
    # Prepare: the table amqtt 0.12.1 iterates across awaits while other clients subscribe
    from splitedge.protocol.broker import _SnapshotDict

    table = _SnapshotDict({"a/#": [], "b/+": []})
    # Execute: add and delete entries during each kind of iteration amqtt uses
    for key in table:
        table[key + "/x"] = []
    for key, _ in table.items():
        if not key.endswith("/x"):
            del table[key]
    # Assert: no "dictionary changed size during iteration"; plain dict would have raised
    assert sorted(table) == ["a/#/x", "b/+/x"]
    with pytest.raises(RuntimeError):
        plain = {"a": 1}
        for key in plain:
            plain[key + "x"] = 2


@needs_mosquitto
def test_closed_transports_release_their_file_descriptors() -> None:
    """paho keeps its wake-up socketpair until garbage collection; close() must release it, or a
    process that runs several big federations climbs past select()'s 1024-descriptor limit."""
    import os

    def open_fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    with MosquittoBroker() as broker:
        transports = [MqttTransport(broker.url, client_id=f"fd-{k}", role="device") for k in range(10)]
        before_close = open_fds()
        for t in transports:
            t.close()
        after = open_fds()

    assert before_close - after >= 30, (before_close, after)  # socket + socketpair (3) for each of 10


def test_a_late_acknowledgement_on_the_embedded_broker_is_counted_not_logged(caplog: pytest.LogCaptureFixture) -> None:
    """amqtt gives a subscriber 5 s to acknowledge a QoS 1 message; a busy sim took longer
    thousands of times a round, each a warning and a traceback. Here a subscriber holds its
    PUBACK for 6 s: the message still arrives once, amqtt's lines are counted instead, and the
    broker says so in one line when it stops."""
    pytest.importorskip("amqtt")
    caplog.set_level(logging.DEBUG)
    got: list[Any] = []
    arrived = threading.Event()
    with EmbeddedBroker() as broker:
        sub = paho.Client(CallbackAPIVersion.VERSION2, client_id="slow-acker", manual_ack=True)
        sub.on_message = lambda c, u, msg: (got.append(msg), arrived.set())
        _, host, port, _, _ = parse_url(broker.url)
        sub.connect(host, port)
        sub.loop_start()
        try:
            subscribed = threading.Event()
            sub.on_subscribe = lambda *a: subscribed.set()
            sub.subscribe("late/ack", qos=1)
            assert subscribed.wait(5)
            pub = paho.Client(CallbackAPIVersion.VERSION2, client_id="publisher")
            pub.connect(host, port)
            pub.loop_start()
            pub.publish("late/ack", b"x" * 1000, qos=1).wait_for_publish(5)
            assert arrived.wait(5)
            time.sleep(6.0)  # past amqtt's 5 s wait for the PUBACK
            deadline = time.monotonic() + 5
            while broker.late_acks < 1 and time.monotonic() < deadline:
                time.sleep(0.1)
            assert broker.late_acks == 1
            sub.ack(got[0].mid, 1)  # the late PUBACK: amqtt no longer knows the message
            time.sleep(0.5)
            pub.loop_stop()
            pub.disconnect()
        finally:
            sub.loop_stop()
            sub.disconnect()
    assert [m.payload for m in got] == [b"x" * 1000]
    amqtt_lines = [r for r in caplog.records if r.name.startswith("amqtt") and r.levelno >= logging.WARNING]
    assert amqtt_lines == [], [r.getMessage() for r in amqtt_lines]
    said = [r.getMessage() for r in caplog.records if r.name == "splitedge.protocol.broker" and r.levelno == logging.WARNING]
    assert said and "1 messages were acknowledged after amqtt's 5 s limit" in said[0]


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, dead but not yet reaped by init, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


OWNER = """
import sys, threading, time
from splitedge.protocol.broker import MosquittoBroker
brokers = []
t = threading.Thread(target=lambda: brokers.append(MosquittoBroker().start()))
t.start(); t.join()  # started from a thread that is gone before the owner is killed
print(brokers[0].pid, brokers[0].port, flush=True)
time.sleep(600)
"""


@needs_mosquitto
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_broker_outlives_the_thread_that_started_it_and_ends_with_its_process() -> None:
    """kill -9 of a bench or sim left its Mosquitto running as an orphan (no finally runs)."""
    owner = subprocess.Popen([sys.executable, "-c", OWNER], stdout=subprocess.PIPE, text=True)
    try:
        pid, port = (int(v) for v in owner.stdout.readline().split())  # type: ignore[union-attr]
        time.sleep(1.0)  # the starting thread has ended: a child tied to it would be gone by now
        assert alive(pid) and wait_port("127.0.0.1", port, 5)
        owner.kill()
        owner.wait(10)
        assert wait_for(lambda: not alive(pid), 10), f"mosquitto {pid} outlived its killed owner"
    finally:
        if owner.poll() is None:
            owner.kill()
        owner.wait(10)
