"""A method that exists only in the test tree (tests/ring_method.py), run over a real Mosquitto
by the unmodified runtimes.

It exercises what the method contract promises a new method without any edit outside its own
module: the cloud sends a message to ONE device (through that device's edge), devices on a ring
exchange messages with their two neighbours over device-to-device topics, and the cloud moves a
device to another edge between rounds (which then reports it, and the device keeps working).
"""

from __future__ import annotations

import threading
from typing import Any

from ring_method import token
from splitedge.protocol.mqtt import MqttTransport
from splitedge.protocol.topics import parse


def test_one_device_delivery_ring_peers_and_a_move_over_mosquitto(mosquitto, tmp_path) -> None:
    from splitedge.sim import SimSettings, run_sim

    # Prepare: an observer that records every topic of the run, with the payload's secret values
    run = "ring-contract"
    topics: list[str] = []
    lock = threading.Lock()

    def record(topic: str, env: Any) -> None:
        with lock:
            topics.append(topic)

    observer = MqttTransport(mosquitto.url, client_id="ring-observer", role="observer")
    observer.subscribe(f"splitedge/{run}/#", record)
    s = SimSettings(rounds=3, devices=4, edges=2, method="ring-test", broker=mosquitto.url, run=run,
                    out=tmp_path, max_train=40, max_test=20, deadline_s=60.0)
    # Execute
    try:
        history = _history(run_sim(s), tmp_path)
    finally:
        observer.close()
    # Assert: round 1, every device heard exactly its two ring neighbours' tokens of that round
    ring = {"d0": ("d3", "d1"), "d1": ("d0", "d2"), "d2": ("d1", "d3"), "d3": ("d2", "d0")}
    for r, rec in enumerate(history, start=1):
        assert set(rec["devices"]) == set(ring), rec
        for dev, info in rec["devices"].items():
            assert info["heard"] == {p: token(p, r) for p in ring[dev]}, (r, dev, info)
    # ... the cloud's message reached d1 alone, through its edge, one per closed round
    for r, rec in enumerate(history, start=1):
        for dev, info in rec["devices"].items():
            assert info["secrets"] == ([100 * k + 1 for k in range(1, r)] if dev == "d1" else []), (r, dev)
    with lock:
        secret_topics = {t for t in topics if "/arrays" in t and "/peer/" not in t}
    assert secret_topics and all(parse(t).to == "d1" for t in secret_topics)
    # ... d0 started at e0, was moved to e1 before round 2, and kept working there
    assert history[0]["devices"]["d0"]["reported_by"] == "e0" and history[0]["devices"]["d0"]["edge"] == "e0"
    for rec in history[1:]:
        assert rec["devices"]["d0"]["reported_by"] == "e1" and rec["devices"]["d0"]["edge"] == "e1"
    # ... and peers talked over device-to-device topics, never through an edge
    with lock:
        peer_topics = {t for t in topics if "/peer/" in t}
    assert {parse(t).node_id for t in peer_topics} == set(ring)
    # ... and each device's latest placement stays retained on its edge's downlink for a restart
    late = MqttTransport(mosquitto.url, client_id="ring-late", role="observer")
    placed: dict[str, str] = {}
    late.subscribe(f"splitedge/{run}/edge/+/down/assign/+", lambda t, e: placed.update({parse(t).to: e.body["edge"]}))
    try:
        assert late.wait_for(lambda: set(placed) == set(ring), 5), placed
    finally:
        late.close()
    assert placed["d0"] == "e1" and placed["d1"] == "e1" and placed["d2"] == "e0"


def _history(summary: dict, out) -> list[dict]:
    import json

    assert len(summary["accuracy_per_round"]) == 3
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
