"""Many MqttTransports on one ClientLoop (paho's external-loop API on epoll), against Mosquitto.

The issue's acceptance test: 50 loop-driven clients deliver every QoS 1 message, and after a
broker restart every one reconnects, resubscribes, republishes its birth and delivers every
QoS 1 message again. Around it: one descriptor and no thread per client, TLS with signatures
in loop mode, a handler on the loop thread that publishes and subscribes without deadlock,
a failed connect that leaves nothing attached, and the open-file limit.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from splitedge.protocol.broker import MosquittoBroker, free_port
from splitedge.protocol.codec import Envelope
from splitedge.protocol.mqtt import MqttTransport
from splitedge.protocol.mqtt_loop import ClientLoop
from splitedge.protocol.topics import topic
from splitedge.protocol.transport import wait_for
from tls_pki import mtls_broker, pki, tls_url  # noqa: F401 - fixtures reused for the TLS case

RUN = "loop"
N = 50
K = 10  # QoS 1 messages per client per phase


def moments(sender: str, round_: int) -> Envelope:
    """A small statistics message, as a device sends its per-class moments."""
    rng = np.random.default_rng(round_)
    body = {"classes": np.arange(2, dtype="<i8"), "counts": np.array([3, 4], dtype="<i8"),
            "mean": rng.standard_normal((2, 4)).astype("<f4"), "var": rng.random((2, 4)).astype("<f4"),
            "space": "wc", "versions": {"wc": 1}, "session": ""}
    return Envelope("moments", RUN, round_, sender, body)


def status(sender: str, state: str) -> Envelope:
    return Envelope("status", RUN, 0, sender, {"state": state, "role": "device"})


def fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


class Fleet:
    """N devices d0..d{N-1} on one loop; device i listens to everything device i+1 publishes."""

    def __init__(self, url: str, loop: ClientLoop) -> None:
        self.seen: dict[int, list[Envelope]] = defaultdict(list)
        self.lock = threading.Lock()
        self.nodes: list[MqttTransport] = []
        for i in range(N):
            me = f"d{i}"
            t = MqttTransport(url, client_id=f"{RUN}-{me}", role="device", keepalive=5, loop=loop,
                              will=(topic(RUN, "device", me, "up", "status"), status(me, "offline")))
            t.subscribe(f"splitedge/{RUN}/device/d{(i + 1) % N}/up/#", self._handler(i))
            self.nodes.append(t)
        for i, t in enumerate(self.nodes):
            t.publish_birth(topic(RUN, "device", f"d{i}", "up", "status"), status(f"d{i}", "online"))

    def _handler(self, i: int):
        def handle(topic_: str, env: Envelope) -> None:
            with self.lock:
                self.seen[i].append(env)
        return handle

    def births(self, i: int) -> list[str]:
        with self.lock:
            return [e.msg_id for e in self.seen[i] if e.kind == "status" and e.body["state"] == "online"]

    def rounds(self, i: int) -> list[int]:
        with self.lock:
            return sorted(e.round for e in self.seen[i] if e.kind == "moments")

    def publish_rounds(self, first: int) -> None:
        for r in range(first, first + K):
            for i, t in enumerate(self.nodes):
                t.publish(topic(RUN, "device", f"d{i}", "up", "moments"), moments(f"d{i}", r))

    def close(self) -> None:
        for t in self.nodes:
            t.close()


@pytest.fixture()
def broker(mosquitto_binary) -> Iterator[MosquittoBroker]:
    with MosquittoBroker() as b:  # its own: this test restarts it
        yield b


def test_fifty_loop_clients_deliver_every_qos1_message_and_survive_a_broker_restart(broker: MosquittoBroker) -> None:
    threads_before, fds_before = threading.active_count(), fd_count()
    with ClientLoop(name="fleet-loop") as loop:
        fleet = Fleet(broker.url, loop)
        try:
            # the loop and its few connector threads, no thread per client
            assert threading.active_count() == threads_before + 1 + loop.connectors
            assert fd_count() - fds_before <= N + 4  # one socket per client (+ epoll and its wake-up pair)
            assert wait_for(lambda: all(len(fleet.births(i)) == 1 for i in range(N)), 10)

            fleet.publish_rounds(1)

            assert all(t.flush(10) for t in fleet.nodes)
            assert wait_for(lambda: all(fleet.rounds(i) == list(range(1, K + 1)) for i in range(N)), 10)
            first_births = {i: fleet.births(i)[0] for i in range(N)}

            broker.restart(down_for=0.5)

            assert wait_for(lambda: all(t.connected and t.reconnects == 1 for t in fleet.nodes), 20), \
                [t.client_id for t in fleet.nodes if not t.connected]
            # a second online birth, a fresh message (not the first one re-sent), from every node
            assert wait_for(lambda: all(len(fleet.births(i)) == 2 for i in range(N)), 10)
            assert all(fleet.births(i)[1] != first_births[i] for i in range(N))

            fleet.publish_rounds(K + 1)

            assert all(t.flush(10) for t in fleet.nodes)
            assert wait_for(lambda: all(fleet.rounds(i) == list(range(1, 2 * K + 1)) for i in range(N)), 10), \
                {i: len(fleet.rounds(i)) for i in range(N) if len(fleet.rounds(i)) != 2 * K}
            assert all(not t.rejected and t.handler_errors == 0 for t in fleet.nodes)
            sent = fleet.nodes[0].counters.snapshot()["out"]["moments"]
            got = fleet.nodes[N - 1].counters.snapshot()["in"]["moments"]  # d49 hears d0
            assert sent["messages"] == got["messages"] == 2 * K and sent["payload"] == got["payload"]
        finally:
            fleet.close()
        assert loop.clients == 0
    assert fd_count() <= fds_before


def test_a_handler_on_the_loop_thread_publishes_and_subscribes_without_waiting(mosquitto) -> None:
    with ClientLoop() as loop:
        a = MqttTransport(mosquitto.url, client_id="h-a", role="edge", loop=loop)
        b = MqttTransport(mosquitto.url, client_id="h-b", role="edge", loop=loop)
        took: list[float] = []
        relayed: list[Envelope] = []

        def relay(topic_: str, env: Envelope) -> None:  # on the loop thread: a wait would deadlock it
            start = time.monotonic()
            b.subscribe(topic(RUN, "device", "d2", "up", "moments"), lambda t, e: relayed.append(e))
            b.publish(topic(RUN, "device", "d2", "up", "moments"), moments("d2", env.round), wait=5)
            took.append(time.monotonic() - start)
        a.subscribe(topic(RUN, "device", "d1", "up", "moments"), relay)

        b.publish(topic(RUN, "device", "d1", "up", "moments"), moments("d1", 7), wait=5)

        assert wait_for(lambda: took, 5) and took[0] < 1.0
        assert wait_for(lambda: [e.round for e in relayed] == [7], 5)
        a.close()
        b.close()


class SilentHost:
    """A TCP port that accepts and never answers: a TLS client's handshake waits on it until its
    connect timeout (as against a broker host that is up but stuck, or a black-holed route)."""

    def __init__(self) -> None:
        import socket

        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.accepted = threading.Event()
        self.held: list = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            self.held.append(conn)
            self.accepted.set()

    def close(self) -> None:
        self.server.close()
        for conn in self.held:
            conn.close()


def test_a_client_stuck_connecting_does_not_stall_the_others(mosquitto) -> None:
    import ssl

    import paho.mqtt.client as paho

    silent = SilentHost()
    with ClientLoop() as loop:
        stuck = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id="stuck")
        ctx = ssl.create_default_context()
        ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
        stuck.tls_set_context(ctx)
        stuck.connect_timeout = 60.0  # its handshake waits this long on the silent host
        stuck.connect_async("127.0.0.1", silent.port)
        session = loop.attach(stuck)
        assert silent.accepted.wait(10), "the stuck client never reached the silent host"
        live = MqttTransport(mosquitto.url, client_id="live", role="edge", loop=loop)
        got: list[int] = []
        live.subscribe(topic(RUN, "device", "d1", "up", "moments"), lambda t, e: got.append(e.round))
        for r in range(K):
            live.publish(topic(RUN, "device", "d1", "up", "moments"), moments("d1", r), wait=5)
        # every QoS 1 message went out and came back while the other client is still in its
        # TLS handshake: connecting does not hold the loop
        assert wait_for(lambda: sorted(got) == list(range(K)), 10)
        assert not session.open and not stuck.is_connected()
        live.close()
        silent.close()


def test_a_connect_that_fails_leaves_nothing_on_the_loop() -> None:
    with ClientLoop() as loop:
        with pytest.raises(ConnectionError, match="no broker reachable"):
            MqttTransport(f"mqtt://127.0.0.1:{free_port()}", client_id="nobody", role="device", loop=loop,
                          connect_timeout=1.0, reconnect_min=0.1)
        assert loop.clients == 0


def test_loop_clients_over_mutual_tls_with_signatures(pki: Path, mtls_broker: MosquittoBroker) -> None:  # noqa: F811
    from splitedge.protocol.signing import KeyRing, Signer, _ed25519

    pytest.importorskip("cryptography")
    key = _ed25519().Ed25519PrivateKey.generate()
    signer, ring = Signer(key), KeyRing({"d1": key.public_key()})
    files = {"ca_certs": str(pki / "ca.pem"), "certfile": str(pki / "e0.pem"), "keyfile": str(pki / "e0.key")}
    url, t = tls_url(mtls_broker), topic(RUN, "device", "d1", "up", "moments")
    got: list[int] = []
    with ClientLoop() as loop, \
            MqttTransport(url, client_id="tls-sub", role="edge", loop=loop, keyring=ring, **files) as sub, \
            MqttTransport(url, client_id="tls-pub", role="device", loop=loop, signer=signer, **files) as pub, \
            MqttTransport(url, client_id="tls-forger", role="device", loop=loop, **files) as forger:
        sub.subscribe(t, lambda _t, e: got.append(e.round))

        forger.publish(t, moments("d1", 1), wait=5)  # unsigned: refused by the keyring
        pub.publish(t, moments("d1", 2), wait=5)

        assert wait_for(lambda: got == [2] and sum(sub.rejected.values()) == 1, 5), (got, sub.rejected)
        assert all(rule.startswith("sig.") for rule in sub.rejected)


def test_the_open_file_limit_is_raised_to_the_hard_limit_or_the_error_names_it() -> None:
    script = textwrap.dedent("""
        import resource
        from splitedge.protocol.mqtt_loop import ensure_fd_limit
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
        got = ensure_fd_limit(1000)
        print(got == resource.getrlimit(resource.RLIMIT_NOFILE)[0] >= 1064)
        try:
            ensure_fd_limit(hard + 1)
        except RuntimeError as exc:
            print("hard RLIMIT_NOFILE" in str(exc) and str(hard) in str(exc))
    """)
    import resource

    if resource.getrlimit(resource.RLIMIT_NOFILE)[1] in (resource.RLIM_INFINITY,) or \
            resource.getrlimit(resource.RLIMIT_NOFILE)[1] < 1064:
        pytest.skip("needs a finite hard RLIMIT_NOFILE of at least 1064")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["True", "True"], out.stderr
