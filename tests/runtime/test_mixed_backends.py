"""A mixed federation on a real broker: torch devices train W_c, onnx devices only send moments.

The onnx (thin) devices build W_c from their own install, bind the cloud's retained W_c weight map
(relayed by their edge) and must swap in the slow-scale average: their moments after it carry
the new W_c version. No graph crosses the broker.
"""

from __future__ import annotations

import threading

import pytest
import torch

from splitedge.protocol.mqtt import MqttTransport
from splitedge.protocol.topics import pattern
from splitedge.sim import SimSettings, run_sim


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def test_mixed_torch_onnx_sim_on_digits(mosquitto, tmp_path):
    # Prepare: d0, d2 torch on e0; d1, d3 onnx on e1 (round-robin backends and edges)
    run = "mixed-onnx-test"
    seen: list[tuple[str, int, int]] = []  # (device, round, wc_version) of every moments message
    lock = threading.Lock()

    kinds: set[str] = set()  # every kind an edge sends down

    def record(topic, env):
        with lock:
            seen.append((env.sender, env.round, int(env.body["versions"]["wc"])))

    def record_graph(topic, env):
        with lock:
            kinds.add(env.kind)

    observer = MqttTransport(mosquitto.url, client_id="observer", role="observer")
    observer.subscribe(pattern(run, "device", "+", "up", "moments"), record)
    observer.subscribe(pattern(run, "edge", "+", "down", "#"), record_graph)
    s = SimSettings(rounds=3, devices=4, edges=2, broker=mosquitto.url, run=run, out=tmp_path,
                    backends=("torch", "onnx"), max_train=600, max_test=300, deadline_s=60.0,
                    overrides={"ic": 2, "edge_samples": 1024, "cloud_samples": 2048})
    # Execute
    try:
        summary = run_sim(s)
    finally:
        observer.close()
    # Assert
    assert summary["final_accuracy"] > summary["chance"] + 0.2
    with lock:
        onnx_moments = [(d, r, v) for d, r, v in seen if d in ("d1", "d3")]
    assert {(d, 1, 0) for d in ("d1", "d3")} <= set(onnx_moments)
    assert {(d, 3, 1) for d in ("d1", "d3")} <= set(onnx_moments)  # after the round-2 W_c average
    # what reached the thin devices is data: rounds, placements and weight maps, never a graph
    assert {"round", "weights"} <= kinds <= {"round", "assign", "weights", "moments", "arrays", "request", "secagg"}


def _weights_senders(mosquitto, run: str):
    """(observer, list of (device, round) of every W_c weight map a device sends up)."""
    sent: list[tuple[str, int]] = []
    lock = threading.Lock()

    def record(topic, env):
        if env.body.get("part") == "wc":
            with lock:
                sent.append((env.sender, env.round))

    observer = MqttTransport(mosquitto.url, client_id=f"observer-{run}", role="observer")
    observer.subscribe(pattern(run, "device", "+", "up", "weights"), record)
    return observer, sent


@pytest.mark.parametrize("method", ["hsfp", "splitfed"])
def test_thin_trainers_reach_the_accuracy_of_torch_devices(mosquitto, tmp_path, method):
    """Issue 29: devices that train W_c in numpy (onnx backend) beside torch devices give the
    federation the accuracy of torch devices alone, same seed and rounds; the thin ones do train
    (their W_c goes up on averaging rounds)."""
    results = {}
    for label, backends in (("torch", ("torch",)), ("mixed", ("torch", "onnx"))):
        run = f"thin-train-{method}-{label}"
        observer, sent = _weights_senders(mosquitto, run)
        s = SimSettings(rounds=4, devices=4, edges=2, broker=mosquitto.url, run=run, out=tmp_path / label,
                        method=method, backends=backends, max_train=800, max_test=360, deadline_s=90.0,
                        overrides={"ic": 2, "edge_samples": 1024, "cloud_samples": 2048} if method == "hsfp" else {})
        try:
            results[label] = run_sim(s)["final_accuracy"]
        finally:
            observer.close()
        if label == "mixed":  # d1 and d3 are the thin ones (round-robin)
            every = range(1, 5) if method == "splitfed" else (2, 4)
            assert {(d, r) for d in ("d1", "d3") for r in every} <= set(sent), sorted(sent)
    assert results["mixed"] > 0.7, results
    assert abs(results["mixed"] - results["torch"]) < 0.06, results
