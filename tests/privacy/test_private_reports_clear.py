"""What stays in the clear with private reports (issue 53, item 5; docs/privacy.md, "What stays
in the clear"): a device of a DP run (every simulated device of one reports privately) sends no
held-out score, sample count, loss or CPU time in its `done`, and its edge forwards its cost to
the cloud only summed with its other such devices, never device by device. Read off a real
broker by a raw subscriber to the run's `#`, for the two methods that score devices' held-out
shares (FedProto, CFLHKD)."""

from __future__ import annotations

import json
import math
import time

import pytest

from mqtt_capture import Capture
from splitedge.protocol.codec import decode
from splitedge.protocol.done import DevicesDone, DoneInfo, Scores

# what a device's done info may say of its data with private reports: nothing of these
SCORES = ("accuracy", "effective_rank", "eval_samples", "global_accuracy", "samples", "loss", "samples_sent")
DP = {"dp_sigma": 1.0, "dp_clip": 20.0, "dp_head_clip": 1.0, "dp_update_clip": 20.0}
DP_SGD = {"dp_unit": "sample", "dp_sample_rate": 0.25, "dp_grad_clip": 1.0}
"""FedProto releases privately only with DP-SGD (its prototypes are of the model it trains)."""


def test_private_info_keeps_only_what_is_listed() -> None:
    from splitedge.runtime.mods.private import PRIVATE_COST, PRIVATE_INFO, private_info

    info = DoneInfo(samples=150, loss={"ce": 0.3}, withheld={"classes": 1, "samples": 3}, dp_releases=2,
                    refused={"schema": 1}, scores=Scores(accuracy=0.7, eval_samples=20),
                    method={"accuracy": 0.9, "effective_rank": 7.5, "eval_samples": 30, "global_accuracy": 0.8,
                            "samples_sent": 300, "neighbours_heard": 2},
                    cost={"cpu_s": 1.25, "rss_peak_mb": 300.0, "bytes_up": 4096.0, "bytes_down": 8192.0})
    out = private_info(info, clear=("neighbours_heard",)).to_info()
    assert out == {"withheld": {"classes": 1, "samples": 3}, "dp_releases": 2, "refused": {"schema": 1},
                   "method": {"neighbours_heard": 2}, "cost": {"bytes_up": 4096.0, "bytes_down": 8192.0},
                   "private_reports": True}
    assert not set(SCORES) & set(PRIVATE_INFO) and not {"cpu_s", "rss_peak_mb"} & set(PRIVATE_COST)


def test_an_edge_sums_its_private_devices_costs_and_the_cloud_adds_them_per_edge() -> None:
    from splitedge.runtime.cost import add_costs, device_costs, phase_costs

    infos = {"d0": DoneInfo(cost={"bytes_up": 10.0, "bytes_down": 5.0}, private_reports=True),
             "d1": DoneInfo(cost={"bytes_up": 30.0, "bytes_down": 7.0}, private_reports=True),
             "d2": DoneInfo(cost={"cpu_s": 1.5, "bytes_up": 2.0, "bytes_down": 1.0, "rss_peak_mb": 9.0})}
    out = device_costs(DevicesDone(reported=3), infos)
    assert out == DevicesDone(reported=3, cost={"d2": {"cpu_s": 1.5, "bytes_up": 2.0, "bytes_down": 1.0, "rss_peak_mb": 9.0}},
                              private_cost={"devices": 2, "bytes_up": 40.0, "bytes_down": 12.0})

    class Report:
        sender = "e0"

        def get(self, kind):
            from types import SimpleNamespace
            return SimpleNamespace(body={"info": DoneInfo(devices=out, cost={"cpu_s": 0.5, "bytes_up": 1.0}).to_info()})

    devices, edges = phase_costs([Report()])
    assert set(devices) == {"d2"}
    assert edges == {"e0": {"cpu_s": 0.5, "bytes_up": 1, "private_devices": {"devices": 2, "bytes_up": 40,
                                                                           "bytes_down": 12}}}
    into: dict = {}
    add_costs(into, edges)
    add_costs(into, edges)  # a second phase of the round: bytes add up, the devices do not
    assert into["e0"]["private_devices"] == {"devices": 2, "bytes_up": 80, "bytes_down": 24}


@pytest.mark.parametrize("method", ["fedproto", "cflhkd"])
def test_a_private_run_s_devices_and_edges_keep_devices_figures_off_the_broker(mosquitto, tmp_path, method) -> None:
    import torch

    from splitedge.sim import SimSettings, run_sim

    torch.set_num_threads(1)
    run = f"clear-{method}"
    capture = Capture(mosquitto, f"capture-{run}", topic=f"splitedge/{run}/#")
    try:
        run_sim(SimSettings(rounds=2, devices=4, edges=2, method=method, broker=mosquitto.url, run=run,
                            out=tmp_path / run, max_train=600, max_test=200, deadline_s=60.0,
                            overrides={**DP, **(DP_SGD if method == "fedproto" else {})}))
        time.sleep(0.3)
    finally:
        capture.close()
    envs = [(topic, decode(payload)) for topic, payload, *_ in capture.messages if payload]
    device_dones = [e.body["info"] for t, e in envs if "/device/" in t and e.kind == "done"]
    edge_dones = [e.body["info"] for t, e in envs if "/edge/" in t and e.kind == "done"]
    assert len(device_dones) >= 8 and len(edge_dones) >= 4, (len(device_dones), len(edge_dones))
    for info in device_dones:  # as the codec filled its record: every field, at its default when not sent
        assert not set(SCORES) & set(info["method"]) and not info["scores"], info  # no held-out score of one device
        assert info["samples"] is None and not info["loss"], info  # nor its samples or losses
        assert not {"cpu_s", "rss_peak_mb"} & set(info["cost"]), info
        assert info["private_reports"] is True, info
    assert any(i["dp_releases"] for i in device_dones)  # they did release, privately
    for info in edge_dones:
        assert not info["devices"]["cost"], info  # no device's cost forwarded one by one
        assert not {"accuracy", "effective_rank", "eval_samples", "global_accuracy"} & set(info["method"]), info
    summed = [i["devices"]["private_cost"] for i in edge_dones if i["devices"]["private_cost"]]
    # (CFLHKD moves devices between edges when it clusters them: an edge may hold one, three)
    assert summed and all(c["devices"] >= 1 and c["bytes_up"] > 0 for c in summed), summed
    records = [json.loads(line) for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in records] == [1, 2]
    assert all(r["dp_epsilon"] > 0 for r in records)
    assert all(not r["device_costs"] and sum(c["private_devices"]["devices"] for c in r["edge_costs"].values()) == 4
               for r in records), [r["edge_costs"] for r in records]
    if method == "fedproto":  # its accuracy is the devices' held-out scores: kept on the devices
        assert all(r["accuracy"] is None and r["eval_samples"] == 0 for r in records), records
    else:  # CFLHKD's is the cloud's own, of the global model on the test split
        assert math.isfinite(records[-1]["accuracy"]), records[-1]
