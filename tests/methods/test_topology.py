"""Peer graphs (methods/topology.py) and the per-device Mosquitto ACL enforcing them (protocol/acl.py).

The last tests start a Mosquitto with the generated ACL (per-device logins from
mosquitto_passwd, no anonymous clients) and check on a ring d0-d1-d2-d3 that d0 reads its
neighbours' peer messages but not d2's, and cannot publish as d1.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

from brokers import require_mosquitto
from splitedge.methods.topology import (check_graph, degrees, edge_list, erdos_renyi, is_connected, mean_degree, ring,
                                        write_graph)
from splitedge.protocol.acl import peer_acl, write_acl
from splitedge.protocol.broker import MosquittoBroker

TEN = [f"d{i}" for i in range(10)]


def assert_undirected(graph: dict[str, tuple[str, ...]]) -> None:
    check_graph(graph)
    for d, nbrs in graph.items():
        assert d not in nbrs and list(nbrs) == sorted(nbrs)
        assert all(d in graph[p] for p in nbrs)


# -- Erdos-Renyi ------------------------------------------------------------------------------
@pytest.mark.parametrize("degree", [2, 4, 9])
def test_erdos_renyi_connected_undirected_and_near_the_degree(degree: int) -> None:
    graphs = [erdos_renyi(TEN, degree, np.random.default_rng(seed)) for seed in range(20)]
    for g in graphs:
        assert list(g) == TEN
        assert_undirected(g)
        assert is_connected(g)
    avg = float(np.mean([mean_degree(g) for g in graphs]))
    # conditioning on connectivity raises low degrees a little (2 -> about 2.5 on 10 devices)
    assert abs(avg - degree) <= 0.3 * degree + 0.1, avg
    if degree == 9:
        assert all(degrees(g) == {d: 9 for d in TEN} for g in graphs)


def test_erdos_renyi_is_deterministic_per_seed_and_varies_across_seeds() -> None:
    draws = {seed: [erdos_renyi(TEN, 3, np.random.default_rng(seed)) for _ in range(2)] for seed in range(5)}
    assert all(a == b for a, b in draws.values())
    assert len({json.dumps(edge_list(a)) for a, _ in draws.values()}) > 1


def test_erdos_renyi_complete_and_trivial_cases() -> None:
    complete = {d: tuple(x for x in TEN if x != d) for d in TEN}
    assert erdos_renyi(TEN, 9, np.random.default_rng(0)) == complete
    assert erdos_renyi(TEN, 50, np.random.default_rng(0)) == complete
    assert erdos_renyi(["solo"], 3, np.random.default_rng(0)) == {"solo": ()}
    assert erdos_renyi(["a", "b"], 0.5, np.random.default_rng(0)) == {"a": ("b",), "b": ("a",)}


def test_erdos_renyi_errors() -> None:
    with pytest.raises(ValueError, match="mean degree 0.1"):
        erdos_renyi([f"d{i}" for i in range(30)], 0.1, np.random.default_rng(0), max_tries=20)
    with pytest.raises(ValueError, match="mean degree 0"):
        erdos_renyi(TEN, 0, np.random.default_rng(0))
    for bad in (-1, float("nan")):
        with pytest.raises(ValueError, match="mean_degree"):
            erdos_renyi(TEN, bad, np.random.default_rng(0))
    with pytest.raises(ValueError, match="duplicate"):
        erdos_renyi(["a", "b", "a"], 2, np.random.default_rng(0))
    with pytest.raises(ValueError, match="at least one"):
        erdos_renyi([], 2, np.random.default_rng(0))


# -- ring and graph helpers -------------------------------------------------------------------
def test_ring() -> None:
    g = ring(TEN)
    assert_undirected(g)
    assert is_connected(g) and set(degrees(g).values()) == {2}
    assert g["d0"] == ("d1", "d9") and g["d5"] == ("d4", "d6")
    assert ring(["a", "b"]) == {"a": ("b",), "b": ("a",)}
    assert ring(["a"]) == {"a": ()}
    assert ring(["a", "b", "c"]) == {"a": ("b", "c"), "b": ("a", "c"), "c": ("a", "b")}


def test_graph_helpers() -> None:
    split = {"a": ("b",), "b": ("a",), "c": ("d",), "d": ("c",)}
    assert not is_connected(split) and is_connected({"a": ()}) and not is_connected({})
    assert degrees(split) == {"a": 1, "b": 1, "c": 1, "d": 1} and mean_degree(split) == 1.0
    assert edge_list({"b": ("a", "c"), "a": ("b",), "c": ("b",)}) == [["a", "b"], ["b", "c"]]
    for bad, why in (({"a": ("b",), "b": ()}, "no way back"), ({"a": ("a",)}, "itself"),
                     ({"a": ("x",)}, "not in the graph"), ({"a": ("b", "b"), "b": ("a",)}, "twice")):
        with pytest.raises(ValueError, match=why):
            check_graph(bad)


def test_write_graph(tmp_path: Path) -> None:
    g = erdos_renyi(TEN, 3, np.random.default_rng(1))
    paths = write_graph(tmp_path / "out", g, title="ER(10, 3)")
    assert [p.name for p in paths] == ["graph.json", "graph.png"]
    doc = json.loads(paths[0].read_text())
    assert doc["edges"] == edge_list(g) == sorted(doc["edges"])
    assert {(a, b) for a, b in doc["edges"]} == {(a, b) for a in g for b in g[a] if a < b}
    assert doc["neighbours"] == {d: list(n) for d, n in g.items()}
    assert doc["mean_degree"] == pytest.approx(2 * len(doc["edges"]) / 10) and doc["connected"] is True
    png = paths[1].read_bytes()
    assert png.startswith(b"\x89PNG") and 1000 < len(png) < 200_000


# -- ACL text ---------------------------------------------------------------------------------
def test_peer_acl_text_for_a_ring() -> None:
    g = ring(["d0", "d1", "d2", "d3"])
    text = peer_acl("r1", g, edges={d: "e0" for d in g}, groups={"d0": ["blue"]}, users={"d3": "dev-3"},
                    probes=False)
    lines = text.splitlines()
    assert lines[0].startswith("#")
    block = lines[lines.index("user d0") + 1:lines.index("user d1")]
    rules = [ln for ln in block if ln.startswith("topic ")]
    assert rules == ["topic readwrite splitedge/r1/device/d0/#",
                     "topic read splitedge/r1/edge/e0/down/+",
                     "topic read splitedge/r1/edge/e0/down/+/d0",
                     "topic read splitedge/r1/edge/e0/up/status",
                     "topic read splitedge/r1/edge/e0/down/+/@blue",
                     "topic read splitedge/r1/device/d1/peer/+",
                     "topic read splitedge/r1/device/d1/peer/+/d0",
                     "topic read splitedge/r1/device/d3/peer/+",
                     "topic read splitedge/r1/device/d3/peer/+/d0"]
    assert "splitedge/r1/device/d2/peer" not in "\n".join(block)  # d2 is not d0's neighbour
    assert "user dev-3" in lines and "user d3" not in lines
    assert "topic readwrite splitedge/r1/device/d3/#" in lines
    # the only other up topic a device reads is its edge's status
    assert {ln for ln in lines if "/up" in ln and ln.startswith("topic read ")} == {"topic read splitedge/r1/edge/e0/up/status"}
    # without edges: only its own topics and the peers
    bare = peer_acl("r1", g, probes=False).splitlines()
    assert not any("/edge/" in ln for ln in bare if ln.startswith("topic"))
    assert sum(ln.startswith("topic ") for ln in bare) == 4 * (1 + 2 * 2)
    # by default each login also has its probe login: its device's status, read only, and its echo topic
    probes = peer_acl("r1", g, users={"d3": "dev-3"}).split("\nuser dev-3.probe\n")[1].splitlines()
    assert probes[:2] == ["topic readwrite splitedge-probe/r1/device/d3", "topic read splitedge/r1/device/d3/up/status"]


def test_peer_acl_refuses_bad_input() -> None:
    g = ring(["d0", "d1", "d2"])
    for kwargs, why in (({"edges": {"d0": "e0"}}, "no edge"), ({"users": {"dx": "u"}}, "not in the graph"),
                        ({"users": {"d0": "d1"}}, "own logins"), ({"groups": {"d0": ["g"]}}, "need edges"),
                        ({"users": {"d0": "u\ntopic read #"}}, "one-line")):
        with pytest.raises(ValueError, match=why):
            peer_acl("r1", g, **kwargs)
    with pytest.raises(ValueError):
        peer_acl("r/1", g)
    with pytest.raises(ValueError):
        peer_acl("r1\ntopic read #", g)
    with pytest.raises(ValueError, match="'@'"):
        peer_acl("r1", ring(["@x", "d1"]))
    for reserved in ("all",):  # '@all' addresses every device
        with pytest.raises(ValueError, match="reserved"):
            peer_acl("r1", g, edges={d: "e0" for d in g}, groups={"d0": [reserved]})


def test_write_acl(tmp_path: Path) -> None:
    path = write_acl(tmp_path / "sub" / "peer.acl", "user a\ntopic read x")
    assert path.read_text() == "user a\ntopic read x\n"


# -- against a real Mosquitto -----------------------------------------------------------------
RUN = "topo"
RING = ["d0", "d1", "d2", "d3"]
ADMIN = "admin"
SECRET = "peer-secret"


class Inbox:
    """A plain paho client logged in as `user`, recording every (topic, payload) it receives."""

    def __init__(self, port: int, user: str | None, password: str = SECRET) -> None:
        import paho.mqtt.client as paho
        from paho.mqtt.enums import CallbackAPIVersion

        self.got: list[tuple[str, bytes]] = []
        self._lock = threading.Lock()
        self._connack = threading.Event()
        self._suback = threading.Event()
        self.connect_failed = False
        self.suback_codes: list = []
        self.client = paho.Client(CallbackAPIVersion.VERSION2, client_id=f"{user}-{uuid.uuid4().hex[:8]}")
        if user is not None:
            self.client.username_pw_set(user, password)
        self.client.on_connect = self._on_connect
        self.client.on_message = self._on_message
        self.client.on_subscribe = self._on_subscribe
        self.client.connect("127.0.0.1", port)
        self.client.loop_start()
        assert self._connack.wait(5), f"{user}: no CONNACK"

    def _on_connect(self, client, userdata, flags, reason_code, properties) -> None:
        self.connect_failed = reason_code.is_failure
        self._connack.set()

    def _on_message(self, client, userdata, msg) -> None:
        with self._lock:
            self.got.append((msg.topic, msg.payload))

    def _on_subscribe(self, client, userdata, mid, reason_codes, properties) -> None:
        self.suback_codes = list(reason_codes)
        self._suback.set()

    def subscribe(self, filter_: str) -> None:
        self._suback.clear()
        self.client.subscribe(filter_, qos=1)
        assert self._suback.wait(5), "no SUBACK"

    def publish(self, topic: str, payload: bytes) -> None:
        self.client.publish(topic, payload, qos=1).wait_for_publish(5)

    def topics(self) -> set[str]:
        with self._lock:
            return {t for t, _ in self.got}

    def wait_for(self, topics: set[str], timeout: float = 5.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if topics <= self.topics():
                return True
            time.sleep(0.02)
        return False

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


@pytest.fixture(scope="module")
def ring_broker(tmp_path_factory: pytest.TempPathFactory):
    """Mosquitto with peer_acl(ring d0..d3) plus an admin login that reads splitedge/#."""
    require_mosquitto("mosquitto", "mosquitto_passwd")
    workdir = tmp_path_factory.mktemp("peer-acl")
    passwd = workdir / "passwd"
    for i, user in enumerate([*RING, ADMIN]):
        subprocess.run(["mosquitto_passwd", *(["-c"] if i == 0 else []), "-b", str(passwd), user, SECRET],
                       check=True, capture_output=True)
    acl = write_acl(workdir / "peer.acl", peer_acl(RUN, ring(RING)) + f"\nuser {ADMIN}\ntopic read splitedge/#\n")
    conf = f"allow_anonymous false\npassword_file {passwd}\nacl_file {acl}\n"
    with MosquittoBroker(extra_conf=conf) as broker:
        yield broker


def peer_topic(sender: str, to: str | None = None) -> str:
    return f"splitedge/{RUN}/device/{sender}/peer/weights" + (f"/{to}" if to else "")


def test_acl_device_reads_only_its_neighbours(ring_broker: MosquittoBroker) -> None:
    d0 = Inbox(ring_broker.port, "d0")
    admin = Inbox(ring_broker.port, ADMIN)
    senders = {d: Inbox(ring_broker.port, d) for d in ("d1", "d2", "d3")}
    try:
        assert not d0.connect_failed and not admin.connect_failed
        d0.subscribe(f"splitedge/{RUN}/device/+/peer/#")
        admin.subscribe("splitedge/#")
        # first what d0 must not see: its non-neighbour d2, and a neighbour's message for d2
        forbidden = {peer_topic("d2"), peer_topic("d2", "d0"), peer_topic("d1", "d2")}
        senders["d2"].publish(peer_topic("d2"), b"x")
        senders["d2"].publish(peer_topic("d2", "d0"), b"x")
        senders["d1"].publish(peer_topic("d1", "d2"), b"x")
        allowed = {peer_topic("d1"), peer_topic("d1", "d0"), peer_topic("d3"), peer_topic("d3", "d0")}
        for t in sorted(allowed):
            senders[t.split("/")[3]].publish(t, b"ok")
        assert d0.wait_for(allowed), (d0.topics(), ring_broker.log_tail())
        assert admin.wait_for(allowed | forbidden)  # they were all published
        time.sleep(0.5)  # bounded wait for anything late
        assert d0.topics() == allowed
    finally:
        for c in (d0, admin, *senders.values()):
            c.close()


def test_acl_device_cannot_publish_as_another(ring_broker: MosquittoBroker) -> None:
    d0 = Inbox(ring_broker.port, "d0")
    admin = Inbox(ring_broker.port, ADMIN)
    try:
        admin.subscribe("splitedge/#")
        forged = [peer_topic("d1"), peer_topic("d1", "d2"), f"splitedge/{RUN}/device/d1/up/status",
                  f"splitedge/{RUN}/edge/e0/down/round"]
        for t in forged:
            d0.publish(t, b"forged")
        d0.publish(peer_topic("d0"), b"mine")  # after the forgeries, on the same connection
        assert admin.wait_for({peer_topic("d0")}), ring_broker.log_tail()
        time.sleep(0.5)
        assert admin.topics() == {peer_topic("d0")}
    finally:
        d0.close()
        admin.close()


def test_acl_broker_refuses_anonymous_and_wrong_passwords(ring_broker: MosquittoBroker) -> None:
    for user, password in ((None, ""), ("d0", "wrong"), ("nobody", SECRET)):
        probe = Inbox(ring_broker.port, user, password)
        try:
            assert probe.connect_failed
        finally:
            probe.close()
