"""What each round costs each node (runtime/cost.py): a device's bytes on its own connection, its
process's CPU seconds and peak memory, passed up by its edge and written by the cloud per device
and round, and summed per device in a sim's summary."""

from __future__ import annotations

import json

import numpy as np

from splitedge.protocol.codec import Envelope
from splitedge.protocol.transport import LoopbackBus, LoopbackTransport
from splitedge.runtime.cost import CostMeter, add_costs, summed


def test_a_round_s_cost_is_what_happened_since_the_last_one() -> None:
    bus = LoopbackBus()
    t = LoopbackTransport(bus, role="device", client_id="d0")
    meter = CostMeter([t])
    env = Envelope(kind="arrays", run="r", round=1, sender="d0", body={"name": "x", "version": 1,
                                                                      "arrays": {"a": np.zeros(1000, "<f4")}})
    t.publish("splitedge/r/device/d0/up/arrays", env)
    sum(i * i for i in range(200_000))  # some CPU
    first = meter.round()
    assert first["bytes_up"] >= 4000 and first["cpu_s"] >= 0 and first["rss_peak_mb"] > 10
    assert "shared_process" not in first
    second = meter.round()  # nothing sent since
    assert second["bytes_up"] == 0 and second["bytes_down"] == 0


def test_phases_add_up_and_a_run_sums_per_device() -> None:
    round_ = {}
    add_costs(round_, {"d0": {"cpu_s": 1.5, "bytes_up": 10, "bytes_down": 5, "rss_peak_mb": 90.0}})
    add_costs(round_, {"d0": {"cpu_s": 0.25, "bytes_up": 3, "bytes_down": 1, "rss_peak_mb": 80.0}})  # its calibration
    assert round_["d0"] == {"cpu_s": 1.75, "bytes_up": 13, "bytes_down": 6, "rss_peak_mb": 90.0}
    run = summed([round_, {"d0": {"cpu_s": 1.0, "bytes_up": 7, "bytes_down": 2, "rss_peak_mb": 95.0}}])
    assert run["d0"] == {"cpu_s": 2.75, "bytes_up": 20, "bytes_down": 8, "rss_peak_mb": 95.0, "rounds": 2}


def test_the_cloud_writes_every_device_s_cost_every_round(tmp_path) -> None:
    import torch

    from splitedge.sim import SimSettings, run_sim

    torch.set_num_threads(1)
    summary = run_sim(SimSettings(rounds=2, devices=4, edges=2, method="fedavg", out=tmp_path, max_train=300,
                                  max_test=100))
    rounds = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    for r in rounds:
        assert sorted(r["device_costs"]) == ["d0", "d1", "d2", "d3"] and sorted(r["edge_costs"]) == ["e0", "e1"]
        assert all(c["bytes_up"] > 200_000 and c["shared_process"] for c in r["device_costs"].values())  # the model
    per_device = summary["device_costs"]
    assert per_device["d0"]["bytes_up"] == sum(r["device_costs"]["d0"]["bytes_up"] for r in rounds)
    # a device's bytes are its own connection's, on the wire (packets and MQTT control): what the
    # summary's counters say devices sent, plus their few control packets, less each device's last
    # `done` (a round's cost is measured before the done that reports it; no report holds the last)
    sent = sum(c["bytes_up"] for c in per_device.values())
    packets = summary["bytes"]["device"]["out_packet"]
    assert packets - 4 * 200 <= sent <= 1.05 * packets


def test_the_peak_is_never_below_the_resident_memory_now(monkeypatch) -> None:
    # Linux folds each thread's cached RSS counts into ru_maxrss late: busy threads made it read
    # below psutil's RSS, a thin device's peak metric under its current one (issue 56)
    import types

    import psutil

    from splitedge.runtime import cost

    monkeypatch.setattr(cost.resource, "getrusage", lambda who: types.SimpleNamespace(ru_maxrss=1))
    assert cost.peak_rss_bytes() >= psutil.Process().memory_info().rss > 10 * 2**20
