"""Presence cannot be lost: a node's last word reaches every receiver, whatever came before it.

A node's will (status offline, retained) fires when its connection drops without a DISCONNECT;
it reconnects and says online again; later it stops cleanly and says offline itself. Each of
these is a message of its own (its own msg_id; when signed, its own seq), so no receiver (an
edge's members, the cloud, `splitedge watch`) drops the clean stop, or a second will, as a
duplicate of the first will. Before issue 56 a clean stop re-sent the will's bytes, so after a
blip the edge kept the stopped device online and held every round open until its deadline.

All on a real Mosquitto: the blip is the device's socket shut under paho (no DISCONNECT), so
the broker fires the will at once and paho reconnects on its own. Waits are derived from what
was measured in the same run (the will's own latency, round 1's duration), never fixed small
numbers, so the tests pass on a busy box.
"""

from __future__ import annotations

import itertools
import socket
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from live_nodes import LiveNodes
from splitedge.cloud.coordinator import CloudCoordinator, CloudSettings
from splitedge.cloud.options import build_run_config
from splitedge.device.agent import DeviceAgent
from splitedge.edge.aggregator import EDGE_DEADLINE_FRACTION, EdgeAggregator
from splitedge.methods.data.datasets import load_dataset
from splitedge.protocol.codec import Envelope
from splitedge.protocol.mqtt import MqttTransport
from splitedge.protocol.topics import topic
from splitedge.protocol.transport import wait_for
from splitedge.runtime.node import Node
from splitedge.runtime.presence import REJOIN_GRACE_S
from splitedge.runtime.session import connect
from splitedge.watch_cli import Watcher

_runs = itertools.count()
DELIVERY_FLOOR_S = 15.0  # the least any wait for one message gets (an upper bound: passing runs take ms)


def blip(transport: MqttTransport) -> None:
    """Drop the connection as a network fault would: the socket shut under paho, no DISCONNECT.
    The broker reads EOF on a session that did not say goodbye and publishes the will; paho
    sees the same EOF and reconnects after its back-off."""
    sock = transport._client.socket()  # noqa: SLF001
    assert sock is not None, "not connected"
    sock.shutdown(socket.SHUT_RDWR)


class StatusLog:
    """What one receiver routed on a status topic: (state, msg_id) in arrival order."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.got: list[tuple[str, str]] = []

    def __call__(self, topic_: str, env: Envelope) -> None:
        with self.lock:
            self.got.append((env.body["state"], env.msg_id))

    def states(self) -> list[str]:
        with self.lock:
            return [s for s, _ in self.got]

    def ids(self) -> list[str]:
        with self.lock:
            return [i for _, i in self.got]


class Site:
    """On one run: an edge-like receiver and a `splitedge watch` reading d0's status, and d0
    connected with its will, saying online as every node does (runtime/session.py, Node)."""

    def __init__(self, url: str, run: str, keys: Path | None) -> None:
        from splitedge.protocol.signing import load_keyring, load_signer

        self.url, self.run = url, run
        self.status_topic = topic(run, "device", "d0", "up", "status")
        self.receiver_keys = {"keyring": load_keyring(keys)} if keys else {}
        self.edge = MqttTransport(url, client_id=f"{run}-edge-e0", role="edge", **self.receiver_keys)
        self.heard = StatusLog()
        self.edge.subscribe(self.status_topic, self.heard)
        self.watcher = Watcher(url, run)
        self.device = connect(url, run=run, tier="device", node_id="d0", reconnect_min=0.2, reconnect_max=1.0,
                              **({"signer": load_signer(keys / "d0.key")} if keys else {}))
        Node(run=run, tier="device", node_id="d0").announce_online(self.device)
        assert wait_for(lambda: self.heard.states() == ["online"], DELIVERY_FLOOR_S), self.heard.states()
        self.wait_s = DELIVERY_FLOOR_S

    def blip_and_return(self) -> None:
        """d0's link drops (the edge hears its will), then d0 is back (the edge hears online)."""
        n = len(self.heard.states())
        started = time.monotonic()
        blip(self.device)
        assert wait_for(lambda: len(self.heard.states()) > n, self.wait_s), self.heard.states()
        assert self.heard.states()[n:] == ["offline"], f"d0's will was not heard: {self.heard.states()}"
        self.wait_s = max(self.wait_s, 20 * (time.monotonic() - started))  # from the will's own latency
        assert wait_for(lambda: len(self.heard.states()) > n + 1 and self.device.connected, self.wait_s), \
            self.heard.states()
        assert self.heard.states()[n + 1:] == ["online"], self.heard.states()
        assert wait_for(lambda: self.watcher.state.node("device", "d0").state == "online", self.wait_s)

    def late_reading(self) -> list[str]:
        """What a receiver that subscribes now reads: the broker's retained status."""
        late = StatusLog()
        probe = MqttTransport(self.url, client_id=f"{self.run}-late", role="observer", **self.receiver_keys)
        try:
            probe.subscribe(self.status_topic, late)
            wait_for(lambda: late.states(), self.wait_s)
            return late.states()
        finally:
            probe.close()

    def close(self) -> None:
        self.device.close()
        self.watcher.close()
        self.edge.close()


@pytest.fixture(params=[False, True], ids=["unsigned", "signed"])
def site(request, mosquitto) -> Any:
    keys = None
    if request.param:
        pytest.importorskip("cryptography")
        from splitedge.cli import main

        keys = request.getfixturevalue("tmp_path") / "keys"
        assert main(["keys", "generate", "--out", str(keys), "d0"]) == 0
    s = Site(mosquitto.url, f"last-word-{next(_runs)}", keys)
    try:
        yield s
    finally:
        s.close()


def test_a_clean_stop_after_a_will_is_the_last_word_at_the_edge_and_the_watcher(site: Site) -> None:
    # Execute: d0's will fires once (a blip), d0 reconnects, then stops cleanly (what
    # `splitedge device` does at exit: runtime/session.py's close says offline)
    site.blip_and_return()
    site.device.close()

    # Assert: the clean stop is the last word at the edge and at the watcher, and each of the
    # four status messages was a message of its own (no receiver could take one for another)
    heard = site.heard
    edge_heard = wait_for(lambda: len(heard.states()) == 4, site.wait_s)
    watch_shows = wait_for(lambda: site.watcher.state.node("device", "d0").state == "offline", site.wait_s)
    assert edge_heard and watch_shows, (f"the clean stop after a will was lost: the edge heard {heard.states()}, "
                                        f"splitedge watch shows d0 {site.watcher.state.node('device', 'd0').state}")
    assert heard.states() == ["online", "offline", "online", "offline"]
    assert len(set(heard.ids())) == 4, heard.ids()
    assert site.edge.duplicates == 0 and site.edge.rejected == {}, (site.edge.duplicates, site.edge.rejected)
    head, tabs = site.watcher.snapshot()
    devices = next(t for t in tabs if t.title.startswith("Devices"))
    assert devices.rows[0][0] == "d0" and devices.rows[0][2].startswith("left "), devices.rows
    assert site.watcher.transport.duplicates == 0
    # ... and the broker keeps it: a receiver that comes later reads offline
    assert site.late_reading() == ["offline"]


def test_a_second_will_after_a_return_is_heard_too(site: Site) -> None:
    # Execute: two blips; after the second d0 stays away (as if it died in between: it does
    # not reconnect within the test, and no DISCONNECT ever reaches the broker)
    site.blip_and_return()
    n = len(site.heard.states())
    site.device._client.reconnect_delay_set(3600, 3600)  # noqa: SLF001
    blip(site.device)

    # Assert: the second will is heard as the last word, by the edge and the watcher
    assert wait_for(lambda: len(site.heard.states()) > n, site.wait_s), \
        f"the edge never heard d0's second will: {site.heard.states()}"
    assert site.heard.states() == ["online", "offline", "online", "offline"]
    assert len(set(site.heard.ids())) == 4, site.heard.ids()
    assert wait_for(lambda: site.watcher.state.node("device", "d0").state == "offline", site.wait_s)
    assert site.late_reading() == ["offline"]


def test_an_edge_closes_the_round_after_a_blipped_device_stopped_cleanly_on_quorum(mosquitto) -> None:
    """The federation: after round 1, d1 blips (its will fires), comes back, then stops cleanly.
    Round 2 must close when d0 is done, not at the edge's deadline; `splitedge watch` must show
    d1 offline. Round 2's deadline is 20 times round 1's time, so waiting it out shows plainly."""
    run = "last-word-fed"
    train, test, info = load_dataset("digits", max_train=400)
    x, y = train
    shards = {"d0": (x[:200], y[:200]), "d1": (x[200:400], y[200:400])}
    config = build_run_config("fedavg", info, None, 0, {})
    watcher = Watcher(mosquitto.url, run)
    seen: dict[str, Any] = {}
    with LiveNodes(lambda _id: mosquitto.url, run) as live:
        live.adopt(watcher)  # closed with the nodes
        edge = live.start(EdgeAggregator(live.transport("edge", "e0"), run=run, node_id="e0"))
        devices = {d: live.start(DeviceAgent(live.adopt(connect(mosquitto.url, run=run, tier="device", node_id=d,
                                                                reconnect_min=0.2, reconnect_max=1.0)),
                                             run=run, node_id=d, edge="e0", data=shards[d]))
                   for d in shards}
        settings = CloudSettings(method="fedavg", rounds=2, config=config, min_edges=1, min_devices=2)

        def after_round(record: dict[str, Any]) -> None:
            if record["round"] != 1:
                return
            d1 = devices["d1"]
            round_s = record["round_seconds"]
            # d1's link drops: the broker fires its will, the edge marks it offline
            started = time.monotonic()
            blip(d1.transport)
            assert wait_for(lambda: "d1" not in edge.roster.presence.online, max(DELIVERY_FLOOR_S, 10 * round_s))
            wait_s = max(DELIVERY_FLOOR_S, 20 * (time.monotonic() - started), 2 * round_s)
            # ... it reconnects and is online again
            assert wait_for(lambda: d1.transport.connected and "d1" in edge.roster.presence.online, wait_s)
            assert wait_for(lambda: watcher.state.node("device", "d1").state == "online", wait_s)
            # ... then it stops cleanly (what `splitedge device` does on Ctrl-C)
            d1.stop()
            live.threads[1 + list(devices).index("d1")].join(wait_s)
            d1.transport.close()
            seen["offline"] = wait_for(lambda: "d1" not in edge.roster.presence.online, wait_s)
            assert seen["offline"], "the edge never heard d1's clean stop: it still counts d1 online"
            assert wait_for(lambda: watcher.state.node("device", "d1").state == "offline", wait_s), \
                "splitedge watch still shows the stopped d1 online"
            # the edge's short grace for a device that only blinked (runtime/presence.py) runs out
            assert wait_for(lambda: edge.roster.awaited == {"d0"}, REJOIN_GRACE_S + wait_s), edge.roster.awaited
            settings.deadline_s = seen["deadline"] = max(60.0, 20 * round_s)  # round 2's, from round 1's time

        settings.on_round = after_round
        history = CloudCoordinator(live.transport("cloud", "cloud"), settings, run=run, test=test).run()
    # Assert: round 2 closed on quorum (d0 done, nobody missed) well inside its deadline, with d0 alone
    assert [r["round"] for r in history] == [1, 2] and seen.get("offline")
    assert edge.rounds.counts.get("missed", 0) == 0, edge.rounds.counts
    assert history[1]["participants"] == 1, history[1]
    edge_deadline = seen["deadline"] * EDGE_DEADLINE_FRACTION
    assert history[1]["round_seconds"] < edge_deadline / 2, (history[1]["round_seconds"], seen["deadline"])
