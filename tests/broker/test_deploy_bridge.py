"""The shipped Mosquitto configs (deploy/mosquitto/) carrying one real H-SFP round.

Two Mosquitto instances on free ports stand in for a cloud broker (the shipped cloud.conf
with a password file, and its ACL unless a test says otherwise) and an edge-site broker (the
shipped bridge section, only `address` replaced). The cloud coordinator sits on the cloud
broker; one edge and two devices on the site broker. A monitor on the cloud broker checks
that device traffic never crosses the bridge. The other layout runs too: no bridge, the
edge connected to both brokers (`splitedge edge --upstream`).
"""

from __future__ import annotations

import math
import subprocess
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

from brokers import require_mosquitto
from splitedge.protocol.broker import MosquittoBroker

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "mosquitto"
SITE_USER, CLOUD_USER, WATCHER, PASSWORD = "site1", "cloud", "watcher", "test-secret"
SITE_NODES = ("e0", "d0")  # logins of the generated site ACL (one connection per login: the configs bind ids)
BRIDGE_TOPICS = ["topic splitedge/+/edge/+/up/# out 1", "topic splitedge/+/cloud/+/down/# in 1"]


@pytest.fixture(autouse=True)
def _mosquitto_tools() -> None:
    """Skipped without mosquitto and mosquitto_passwd; failed instead on CI (brokers.py)."""
    require_mosquitto("mosquitto", "mosquitto_passwd")


# -- configs -------------------------------------------------------------------------------
def bridge_section(cloud_port: int) -> str:
    """edge-site.conf from `connection` on, verbatim but for `address`, plus the remote login
    that the shipped file leaves commented (its cloud broker refuses anonymous clients)."""
    text = (DEPLOY / "edge-site.conf").read_text()
    lines = text[text.index("\nconnection "):].splitlines()
    lines = [f"address 127.0.0.1:{cloud_port}" if ln.startswith("address ") else ln for ln in lines]
    return "\n".join([*lines, f"remote_username {SITE_USER}", f"remote_password {PASSWORD}"]) + "\n"


def make_passwd(workdir: Path) -> Path:
    passwd = workdir / "passwd"
    for i, user in enumerate((CLOUD_USER, SITE_USER, WATCHER, *SITE_NODES)):
        subprocess.run(["mosquitto_passwd", *(["-c"] if i == 0 else []), "-b", str(passwd), user, PASSWORD],
                       check=True, capture_output=True)
    return passwd


def shipped_conf(name: str, workdir: Path, **rewrite: str | None) -> str:
    """A shipped config with host paths moved into `workdir`; MosquittoBroker adds the listener
    (on a free port) and logs to stderr. `rewrite`: option -> replacement line, or None to drop."""
    rewrite = {"listener": None, "log_dest": None, "password_file": f"password_file {make_passwd(workdir)}",
               "persistence_location": f"persistence_location {workdir}/", **rewrite}
    out = []
    for line in (DEPLOY / name).read_text().splitlines():
        option = line.split(" ", 1)[0]
        if option not in rewrite:
            out.append(line)
        elif rewrite[option] is not None:
            out.append(rewrite[option])
    return "\n".join(out) + "\n"


def cloud_conf(workdir: Path, *, acl: bool = True) -> str:
    """cloud.conf as shipped, its ACL included; `acl=False` drops the ACL, to show that the
    bridge's topic lines alone keep device traffic on the site."""
    return shipped_conf("cloud.conf", workdir, acl_file=f"acl_file {DEPLOY / 'cloud.acl'}" if acl else None)


def test_shipped_bridge_carries_exactly_edge_up_and_cloud_down() -> None:
    lines = (DEPLOY / "edge-site.conf").read_text().splitlines()
    assert [ln for ln in lines if ln.startswith("topic ")] == BRIDGE_TOPICS
    assert "cleansession false" in lines and "try_private true" in lines


# -- a monitor that records every topic it sees ---------------------------------------------
class Monitor:
    """A raw paho client subscribed to splitedge/# (and the bridges' $SYS state)."""

    def __init__(self, port: int, username: str | None = None) -> None:
        import paho.mqtt.client as paho
        from paho.mqtt.enums import CallbackAPIVersion

        self.seen: dict[str, bytes] = {}
        self.history: list[tuple[str, bytes]] = []  # every message, in arrival order
        self._subscribed = threading.Semaphore(0)
        self.client = paho.Client(CallbackAPIVersion.VERSION2, client_id=f"monitor-{uuid.uuid4().hex[:8]}")
        if username:
            self.client.username_pw_set(username, PASSWORD)
        self.client.on_message = lambda c, u, m: (self.seen.__setitem__(m.topic, m.payload),
                                                  self.history.append((m.topic, m.payload)))
        self.client.on_subscribe = lambda *a: self._subscribed.release()
        self.client.connect("127.0.0.1", port)
        self.client.loop_start()
        for pattern in ("splitedge/#", "$SYS/broker/connection/#"):
            self.client.subscribe(pattern, qos=1)
            assert self._subscribed.acquire(timeout=5), "monitor got no SUBACK"

    def topics(self, part: str) -> list[str]:
        return sorted(t for t in list(self.seen) if part in t)

    def wait_for(self, topic: str, payload: bytes, timeout: float = 10.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.seen.get(topic) == payload:
                return True
            time.sleep(0.05)
        return False

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


# -- one round with the runtimes in threads, as splitedge/sim/federation.py's Federation does --------------
def run_one_round(cloud_url: str, site_url: str, upstream_url: str | None, run: str) -> list[dict]:
    """Cloud on `cloud_url`; edge e0 on `site_url` (and `upstream_url` if given); d0, d1 on the site."""
    from splitedge.cloud.coordinator import CloudCoordinator, CloudSettings
    from splitedge.cloud.options import build_run_config
    from splitedge.device.agent import DeviceAgent
    from splitedge.edge.aggregator import EdgeAggregator
    from splitedge.methods.data.datasets import load_dataset
    from splitedge.methods.data.partition import iid
    from splitedge.runtime.session import connect

    train, test, info = load_dataset("digits", max_train=300, max_test=200, seed=0)
    config = build_run_config("hsfp", info, None, 0, {"edge_samples": 256, "cloud_samples": 256, "cloud_epochs": 1})
    transports, nodes = [], []

    def conn(url: str, tier: str, node_id: str):
        transports.append(connect(url, run=run, tier=tier, node_id=node_id))
        return transports[-1]

    try:
        up = conn(upstream_url, "edge", "e0") if upstream_url else None
        nodes.append(EdgeAggregator(conn(site_url, "edge", "e0"), up, run=run, node_id="e0"))
        for d, idx in enumerate(iid(train[1], 2, np.random.default_rng(0))):
            nodes.append(DeviceAgent(conn(site_url, "device", f"d{d}"), run=run, node_id=f"d{d}", edge="e0",
                                     data=(train[0][idx], train[1][idx])))
        threads = [threading.Thread(target=n.run_forever, daemon=True) for n in nodes]
        for node, thread in zip(nodes, threads):
            node.start()
            thread.start()
        settings = CloudSettings(method="hsfp", rounds=1, config=config, deadline_s=20.0, min_edges=1, min_devices=2,
                                 join_timeout_s=15)
        return CloudCoordinator(conn(cloud_url, "cloud", "cloud"), settings, run=run, test=test).run()
    finally:
        for node in nodes:
            node.stop()
        for t in transports:
            t.close()


def assert_round_and_isolation(history: list[dict], cloud: Monitor, site: Monitor, run: str, *,
                               bridged: bool) -> None:
    assert len(history) == 1 and history[0]["edges"] == 1
    assert math.isfinite(history[0]["accuracy"]) and 0.0 <= history[0]["accuracy"] <= 1.0
    # The devices did talk, on the site broker only; the cloud got the edge's summary.
    assert site.topics(f"splitedge/{run}/device/d0/up/"), "devices never published"
    assert f"splitedge/{run}/edge/e0/up/moments" in cloud.seen
    assert f"splitedge/{run}/edge/e0/down/round" in site.seen
    # Bridged, the cloud's down-topics reach the site broker; with --upstream only the edge hears them.
    assert bool(site.topics(f"splitedge/{run}/cloud/")) is bridged
    assert cloud.topics("/device/") == []


@pytest.fixture()
def cloud_broker(tmp_path: Path):
    with MosquittoBroker(extra_conf=cloud_conf(tmp_path)) as broker:
        yield broker


@pytest.fixture()
def cloud_broker_no_acl(tmp_path: Path):
    with MosquittoBroker(extra_conf=cloud_conf(tmp_path, acl=False)) as broker:
        yield broker


def test_whole_edge_site_conf_forwards_edge_up_and_cloud_down_only(tmp_path: Path,
                                                                    cloud_broker_no_acl: MosquittoBroker) -> None:
    """The whole edge-site.conf (every option must be known, or Mosquitto stops; its ACL the one
    `data split --acl` writes, which does not bind the bridge) bridged to a cloud broker without
    its ACL, so the bridge's topic lines alone decide what crosses: an
    edge up-topic goes out, cloud down-topics come in (one addressed to a device by a 7th
    segment), a device up-topic stays on the site."""
    from splitedge.protocol.mqtt import MqttTransport

    from splitedge.protocol.acl import federation_acl, write_acl

    cloud_port, run = cloud_broker_no_acl.port, f"fwd-{uuid.uuid4().hex[:6]}"
    (tmp_path / "site").mkdir()
    login = f"address 127.0.0.1:{cloud_port}\nremote_username {SITE_USER}\nremote_password {PASSWORD}"
    acl = write_acl(tmp_path / "site" / "broker.acl", federation_acl(run, {"d0": "e0"}))  # what data split writes
    edge_up, device_up = f"splitedge/{run}/edge/e0/up/moments", f"splitedge/{run}/device/d0/up/moments"
    down, addressed = f"splitedge/{run}/cloud/cloud/down/round", f"splitedge/{run}/cloud/cloud/down/weights-wc/d3"
    conf = shipped_conf("edge-site.conf", tmp_path / "site", address=login, acl_file=f"acl_file {acl}")
    with MosquittoBroker(extra_conf=conf) as site_broker:
        cloud, site = Monitor(cloud_port, WATCHER), Monitor(site_broker.port, WATCHER)
        device, edge, on_cloud = (MqttTransport(f"mqtt://{user}:{PASSWORD}@127.0.0.1:{port}",
                                                client_id=f"fwd-{user}", role="edge")
                                  for user, port in (("d0", site_broker.port), ("e0", site_broker.port),
                                                     (CLOUD_USER, cloud_port)))
        try:
            assert cloud.wait_for("$SYS/broker/connection/splitedge-bridge-site1/state", b"1"), \
                site_broker.log_tail()
            device.publish_raw(device_up, b"device", qos=1)  # first: had it crossed, it would arrive first
            edge.publish_raw(edge_up, b"edge", qos=1)
            # retained: the bridge may subscribe on the cloud broker just after it reports "1"
            on_cloud.publish_raw(down, b"all", qos=1, retain=True)
            on_cloud.publish_raw(addressed, b"to-d3", qos=1, retain=True)
            assert cloud.wait_for(edge_up, b"edge"), site_broker.log_tail()
            assert site.wait_for(down, b"all") and site.wait_for(addressed, b"to-d3"), site_broker.log_tail()
            assert site.seen.get(device_up) == b"device"  # published, and on the site broker only
            time.sleep(0.5)  # a straggler would have had time to cross
            assert cloud.topics("/device/") == [], cloud.topics("/device/")
        finally:
            for c in (device, edge, on_cloud, cloud, site):
                c.close()


def test_cloud_acl_confines_a_site(cloud_broker: MosquittoBroker) -> None:
    """A site's login may speak only as an edge: device and cloud topics are dropped."""
    from splitedge.protocol.mqtt import MqttTransport

    cloud = Monitor(cloud_broker.port, WATCHER)
    site = MqttTransport(f"mqtt://{SITE_USER}:{PASSWORD}@127.0.0.1:{cloud_broker.port}", client_id="acl-probe",
                         role="edge")
    try:
        for t in ("splitedge/acl/device/d0/up/moments", "splitedge/acl/cloud/cloud/down/round",
                  "splitedge/acl/edge/e0/up/hello"):
            site.publish_raw(t, b"x", qos=1)
        assert cloud.wait_for("splitedge/acl/edge/e0/up/hello", b"x")
        assert cloud.topics("/device/") == [] and cloud.topics("/cloud/") == []
    finally:
        site.close()
        cloud.close()


def test_bridge_logs_in_under_the_cloud_acl(cloud_broker: MosquittoBroker) -> None:
    """The site login of cloud.acl is enough for the bridge: state, edge up, cloud down."""
    from splitedge.protocol.mqtt import MqttTransport

    with MosquittoBroker(extra_conf=bridge_section(cloud_broker.port)) as site_broker:
        cloud, site = Monitor(cloud_broker.port, WATCHER), Monitor(site_broker.port)
        probes = [MqttTransport(url, client_id=f"probe-{i}", role="edge") for i, url in enumerate(
            (site_broker.url, f"mqtt://{CLOUD_USER}:{PASSWORD}@127.0.0.1:{cloud_broker.port}"))]
        try:
            assert cloud.wait_for("$SYS/broker/connection/splitedge-bridge-site1/state", b"1"), \
                site_broker.log_tail()
            probes[0].publish_raw("splitedge/acl/edge/e0/up/hello", b"up", qos=1)
            # retained: the bridge may subscribe on the cloud broker just after it reports "1"
            probes[1].publish_raw("splitedge/acl/cloud/cloud/down/round", b"down", qos=1, retain=True)
            assert cloud.wait_for("splitedge/acl/edge/e0/up/hello", b"up")
            assert site.wait_for("splitedge/acl/cloud/cloud/down/round", b"down")
        finally:
            for c in (*probes, cloud, site):
                c.close()


def test_round_across_bridged_edge_site_broker(cloud_broker_no_acl: MosquittoBroker) -> None:
    # No ACL on the cloud broker here: it would also drop device topics, hiding a bridge
    # that forwards too much. The topic lines of edge-site.conf must do it on their own.
    cloud_broker = cloud_broker_no_acl
    run = f"bridge-{uuid.uuid4().hex[:6]}"
    cloud = Monitor(cloud_broker.port, WATCHER)
    with MosquittoBroker(extra_conf=bridge_section(cloud_broker.port)) as site_broker:
        site = Monitor(site_broker.port)
        try:
            # The bridge announces itself on the cloud broker (notifications true).
            assert cloud.wait_for("$SYS/broker/connection/splitedge-bridge-site1/state", b"1"), \
                site_broker.log_tail()
            cloud_url = f"mqtt://{CLOUD_USER}:{PASSWORD}@127.0.0.1:{cloud_broker.port}"
            history = run_one_round(cloud_url, site_broker.url, None, run)
            assert_round_and_isolation(history, cloud, site, run, bridged=True)
        finally:
            site.close()
            cloud.close()


def test_round_with_edge_on_both_brokers(cloud_broker: MosquittoBroker) -> None:
    """`splitedge edge --broker SITE --upstream CLOUD`: no bridge, the edge relays. The edge
    logs in as the site user, so this also shows the shipped ACL lets an edge do its job."""
    run = f"upstream-{uuid.uuid4().hex[:6]}"
    cloud = Monitor(cloud_broker.port, WATCHER)
    with MosquittoBroker() as site_broker:
        site = Monitor(site_broker.port)
        try:
            cloud_url = f"mqtt://{CLOUD_USER}:{PASSWORD}@127.0.0.1:{cloud_broker.port}"
            upstream = f"mqtt://{SITE_USER}:{PASSWORD}@127.0.0.1:{cloud_broker.port}"
            history = run_one_round(cloud_url, site_broker.url, upstream, run)
            assert_round_and_isolation(history, cloud, site, run, bridged=False)
            # the devices see their edge online on their own broker (a held stop waits on it)
            from splitedge.protocol.codec import decode

            states = [decode(p).body["state"] for t, p in list(site.history)
                      if t == f"splitedge/{run}/edge/e0/up/status" and p]
            assert "online" in states, states
        finally:
            site.close()
            cloud.close()
