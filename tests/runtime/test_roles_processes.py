"""The three roles as separate OS processes against a private Mosquitto, on digits.

This is the deployment shape: each process holds only its own data (devices read an .npz
shard), nothing is shared but the broker. Checks that accuracy rises, that the byte counters
of the tiers agree with each other, and that a device killed mid-run does not stall it.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest

from splitedge.methods.data.datasets import load_dataset

from federation import Federation


def _payload(counters: list[dict], direction: str, kind: str) -> int:
    return sum(t["bytes"][direction].get(kind, {}).get("payload", 0) for t in counters)


def test_three_rounds_as_processes(tmp_path: Path, mosquitto) -> None:
    # Prepare: 1 cloud, 2 edges, 4 devices, each its own process; W_c averaged in round 2
    fed = Federation(tmp_path, mosquitto.url, edges=2, devices=4, rounds=3,
                     extra=["--ic", "2", "--ie", "2", "--deadline", "120"])
    try:
        # Execute
        fed.wait(timeout=240)
        metrics = fed.metrics()
    finally:
        fed.close()
    # Assert: all rounds ran, accuracy rose above chance
    assert [m["round"] for m in metrics] == [1, 2, 3], fed.log("cloud")
    acc = [m["accuracy"] for m in metrics]
    assert acc[-1] > acc[0] and acc[-1] > 0.3, acc
    assert (fed.out / "model.safetensors").exists()
    # Assert: what devices sent up is what their edges received (per data kind, exactly)
    devices = [fed.counters(f"d{d}") for d in range(4)]
    edges = [fed.counters(f"e{e}") for e in range(2)]
    cloud = fed.counters("cloud")
    for kind in ("moments", "done"):
        sent = sum(_payload(c, "out", kind) for c in devices)
        assert sent > 0 and sent == sum(_payload(c, "in", kind) for c in edges), kind
    # weights into edges = devices' W_c uploads + every cloud weights message, once per edge
    cloud_weights = sum(_payload(cloud, "out", k) for k in ("weights-wc", "weights-we", "weights"))
    dev_weights = sum(_payload(c, "out", "weights") for c in devices)
    edge_in = sum(_payload(c, "in", k) for c in edges for k in ("weights", "weights-wc", "weights-we"))
    assert dev_weights > 0 and edge_in == dev_weights + 2 * cloud_weights
    # what edges sent up is what the cloud received
    for kind in ("moments", "done"):
        sent = sum(_payload(c, "out", kind) for c in edges)
        assert sent > 0 and sent == _payload(cloud, "in", kind), kind
    assert all(not t["rejected"] for c in devices + edges + [cloud] for t in c)


def test_killed_device_does_not_stall_the_run(tmp_path: Path, mosquitto) -> None:
    # Prepare: a short deadline so the round with the dead device closes without it
    fed = Federation(tmp_path, mosquitto.url, edges=1, devices=3, rounds=3,
                     extra=["--deadline", "20", "--ic", "10", "--ie", "10"])
    # Execute: kill a device between rounds, without a clean disconnect
    metrics, elapsed = fed.kill_after_round_1("d2", ("cloud", "e0", "d0", "d1"))
    # Assert: the remaining rounds closed (at the latest at their deadlines) and learning went on
    assert [m["round"] for m in metrics] == [1, 2, 3], fed.log("cloud")
    assert elapsed < 2 * 20 + 30
    assert metrics[-1]["accuracy"] > 0.2


def test_killed_edge_does_not_stall_the_run(tmp_path: Path, mosquitto) -> None:
    # Prepare: two edges with one device each
    # (a deadline that a loaded CI box's first round cannot miss: the dead edge's rounds close on its will)
    fed = Federation(tmp_path, mosquitto.url, edges=2, devices=2, rounds=3,
                     extra=["--deadline", "60", "--ic", "10", "--ie", "10"])
    # Execute: the second edge dies; its device is orphaned
    metrics, _ = fed.kill_after_round_1("e1", ("cloud", "e0", "d0"))
    # Assert: the cloud finished every round with the edge that is left
    assert [m["round"] for m in metrics] == [1, 2, 3], fed.log("cloud")
    assert metrics[0]["edges"] == 2 and metrics[-1]["edges"] == 1
    assert metrics[-1]["accuracy"] > 0.2


def test_a_graceful_broker_restart_mid_run_loses_no_round(tmp_path: Path) -> None:
    from splitedge.protocol.broker import MosquittoBroker
    from splitedge.sim import SimSettings, run_sim

    # Prepare: a private Mosquitto this test may restart; every node has its own MQTT client
    with MosquittoBroker() as broker:
        def restart_after_round_1(record: dict) -> None:
            if record["round"] == 1:
                broker.restart()  # SIGTERM: Mosquitto fires every client's will, then starts again
        # Execute
        s = SimSettings(rounds=4, devices=4, edges=2, method="fedavg", broker=broker.url, out=tmp_path / "run",
                        deadline_s=60)
        run_sim(s, on_round=restart_after_round_1)
    # Assert: the nodes came back online and every round had both edges and moved the model on
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["round"] for m in metrics] == [1, 2, 3, 4]
    assert [m["edges"] for m in metrics] == [2, 2, 2, 2], metrics
    assert [m["versions"]["model"] for m in metrics] == [0, 1, 2, 3]


def test_before_a_round_the_cloud_waits_for_edges_that_went_offline_then_goes_on_or_stops() -> None:
    from splitedge.cloud.coordinator import CloudCoordinator, CloudSettings
    from splitedge.methods.config import RunConfig
    from splitedge.methods.fedavg.config import FedAvgConfig
    from splitedge.protocol.transport import LoopbackBus, LoopbackTransport

    from parts import SPEC

    # Prepare: a cloud whose two edges joined; both are offline now (as after a broker restart)
    settings = CloudSettings(method="fedavg", rounds=3, config=RunConfig(SPEC, FedAvgConfig()), min_edges=2,
                             rejoin_timeout_s=0.5)
    cloud = CloudCoordinator(LoopbackTransport(LoopbackBus(), role="cloud", client_id="c"), settings, run="r",
                             test=(np.zeros((1, 8, 8, 1), np.uint8), np.zeros(1, np.int64)))
    cloud.view.members.update({"e0": ["d0"], "e1": ["d1"]})
    # Execute / Assert: nobody back within the rejoin timeout: the run stops, saying why
    with pytest.raises(TimeoutError, match="no edge is online before round 2, and none came back within 0.5 s"):
        cloud.edges.wait_for_live_edges(2)
    # one edge back, the other dead: round 2 waits its grace once, later rounds no more
    cloud.edges.status("e0", "online")
    started = time.monotonic()
    cloud.edges.wait_for_live_edges(2)
    assert 4 < time.monotonic() - started < 10 and cloud.edges.enough == 1
    started = time.monotonic()
    cloud.edges.wait_for_live_edges(3)
    assert time.monotonic() - started < 0.5
    # the live edge's device left (its edge's done said so): no round trains with nobody in it
    cloud.view.members["e0"] = []
    with pytest.raises(TimeoutError, match="no device is online before round 3"):
        cloud.edges.wait_for_live_edges(3)


def test_a_node_that_finds_a_finished_run_waits_for_a_new_one_and_joins_it(mosquitto) -> None:
    """Before any round, a finished run's retained stop makes a node wait (for as long as the
    new cloud takes: tests/runtime/test_reused_runs.py); the new session's round clears it."""
    import threading

    from splitedge.device.agent import DeviceAgent
    from splitedge.edge.aggregator import EdgeAggregator
    from splitedge.methods.config import RunConfig
    from splitedge.methods.fedavg.config import FedAvgConfig
    from splitedge.methods.contract import RoundPlan
    from splitedge.runtime.node import Node
    from splitedge.runtime.session import connect

    from parts import SPEC

    run = "late"
    # Prepare: what a finished run leaves on the broker: the cloud's retained stop, its status offline
    cloud, transport = Node(run=run, tier="cloud", node_id="cloud"), connect(mosquitto.url, run=run, tier="cloud",
                                                                              node_id="cloud")
    config = RunConfig(SPEC, FedAvgConfig()).to_wire()
    stop = RoundPlan(round=4, method="fedavg", deadline_s=1.0, config=config, session="0123456789abcdef", stop=True)
    cloud.send(transport, "down", "round", stop.to_body(), round_=4, retain=True)
    cloud.send(transport, "up", "status", {"state": "offline", "role": "cloud"}, round_=0, retain=True)
    transport.flush()
    # Execute: an edge and a device start late
    (x, y), _, _ = load_dataset("digits")
    nodes = [EdgeAggregator(connect(mosquitto.url, run=run, tier="edge", node_id="e0"), run=run, node_id="e0"),
             DeviceAgent(connect(mosquitto.url, run=run, tier="device", node_id="d0"), run=run, node_id="d0",
                         edge="e0", data=(x[:50], y[:50]))]
    threads = []
    for n in nodes:
        n.start()
        threads.append(threading.Thread(target=n.run_forever, daemon=True))
        threads[-1].start()
    try:
        # Assert: both hold the stop and stay; a new session's first round clears it at the edge
        deadline = time.monotonic() + 30
        while nodes[0].stops.held is None and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(1.0)
        # (the edge cleared its own downlink at start: its device waits for its round, no stop in sight)
        assert nodes[0].stops.held == "new run" and not any(n.stopped.is_set() for n in nodes)
        new = RoundPlan(round=1, method="fedavg", deadline_s=30.0, config=config, session="fedcba9876543210")
        cloud.send(transport, "down", "round", new.to_body(), round_=1, retain=True)
        while nodes[0].session != new.session and time.monotonic() < deadline:
            time.sleep(0.1)
        while nodes[1].session != new.session and time.monotonic() < deadline:
            time.sleep(0.1)
        assert [n.session for n in nodes] == [new.session] * 2 and nodes[0].stops.held is None
        assert not any(n.stopped.is_set() for n in nodes)
    finally:
        nodes[0].stop()
        nodes[1].stop()
        nodes[0].down.close(offline=True)
        nodes[1].transport.close(offline=True)
        transport.close()
