"""A device of a DP run keeps its hello and its reports private (`--private-reports`): the
broker carries no exact sample count, no class list and no training loss of it, and the run
goes on as before (the edges bound and weigh it by the power of two it announced)."""

from __future__ import annotations

import math
import time
from types import SimpleNamespace

import numpy as np
import pytest

from mqtt_capture import Capture
from splitedge.methods.contract import ModelSpec, coarse_samples
from splitedge.methods.registry import create_method, default_config
from splitedge.protocol.codec import decode


def test_coarse_samples_is_the_power_of_two_at_or_above() -> None:
    assert [coarse_samples(n) for n in (0, 1, 2, 3, 4, 5, 144, 256, 257)] == [0, 1, 2, 4, 4, 8, 256, 256, 512]


def test_a_device_of_a_private_run_is_told_what_its_reports_still_say(caplog) -> None:
    from splitedge.device.building import build_part
    from splitedge.methods.compute import CPU

    m = create_method("hsfp", default_config("hsfp", ModelSpec(), dp_sigma=1.0, dp_clip=1.0))
    said = {}
    for hide, private in ((False, False), (True, False), (True, True)):
        me = SimpleNamespace(node_id="d0", rng=np.random.default_rng(0), placement=None, run_id="r", hide_classes=hide,
                             private_reports=private, exchange=SimpleNamespace(request=None, gather=None),
                             min_class_count=1, train_chunk=8, data=(np.zeros((4, 8, 8, 1), np.uint8), np.arange(4)),
                             backend="onnx", compute=CPU)
        caplog.clear()
        with caplog.at_level("WARNING", logger="splitedge.status"):
            part = build_part(me, m)
        said[(hide, private)] = caplog.text
        assert part.reported_samples(5) == (8 if private else 5)
    assert "the classes it holds, its samples and losses" in said[(False, False)]
    assert "carry its samples and losses" in said[(True, False)] and "--private-reports" in said[(True, False)]
    assert said[(True, True)] == ""


@pytest.mark.parametrize("private", [True, False])
def test_what_the_broker_carries_of_a_device_with_and_without_private_reports(mosquitto, tmp_path, private) -> None:
    """FedAvg with local DP, 4 devices of 150 digits each: with private reports every device's
    hello announces 256 samples and no class, its weights count 256, its `done` has no samples
    and no losses; the run completes with nothing refused. Without, all of it is exact."""
    import torch

    from splitedge.sim import SimSettings, run_sim

    torch.set_num_threads(1)
    run = f"private-{private}"
    dp = {"dp_sigma": 0.5, "dp_update_clip": 5.0} if private else {}
    capture = Capture(mosquitto, f"capture-{run}", topic=f"splitedge/{run}/#")
    try:
        run_sim(SimSettings(rounds=2, devices=4, edges=2, method="fedavg", broker=mosquitto.url, run=run,
                            out=tmp_path / run, max_train=600, max_test=200, deadline_s=60.0, overrides=dp))
        time.sleep(0.3)
    finally:
        capture.close()
    envs = [decode(payload) for topic, payload, *_ in capture.messages if "/device/" in topic]
    hellos = [e.body for e in envs if e.kind == "hello"]
    weights = [e.body["samples"] for e in envs if e.kind == "weights"]
    dones = [e.body["info"] for e in envs if e.kind == "done"]
    assert hellos and weights and dones
    assert {h["samples"] for h in hellos} == ({256} if private else {150})
    assert all((h.get("classes") is None) == private for h in hellos)
    assert set(weights) == ({256} if private else {150})
    trained = [i for i in dones if i["cost"] and not i["failed"]]  # as decoded: every field, defaults filled
    assert trained and all((i["samples"] is not None) != private and bool(i["loss"]) != private for i in trained), trained
    import json

    records = [json.loads(line) for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in records] == [1, 2] and math.isfinite(records[-1]["accuracy"])
    assert not any(r["rejected"].get(e) for r in records for e in ("e0", "e1")), [r["rejected"] for r in records]


def test_a_self_supervised_run_releases_its_models_privately_inside_a_secure_sum(mosquitto, tmp_path) -> None:
    """SimSiam under DP: each device's update is clipped and noised (one release a round, the
    epsilon in the round's record) and summed securely at its edge; at negligible noise and a
    clip no update reaches, the probe is the run's without DP: nothing else changed."""
    import json

    import torch

    from splitedge.sim import SimSettings, run_sim

    torch.set_num_threads(1)
    probes = {}
    for name, extra in (("clear", {}), ("private", {"dp_sigma": 1e-8, "dp_update_clip": 1e3, "secagg": "full",
                                                 "secagg_min_devices": 2})):
        out = tmp_path / name
        run_sim(SimSettings(rounds=2, devices=4, edges=2, method="simsiam", broker=mosquitto.url, run=f"ssl-{name}",
                            out=out, max_train=400, max_test=200, deadline_s=60.0, overrides=extra))
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        assert [r["round"] for r in records] == [1, 2]
        assert not any(r["rejected"].get(e) for r in records for e in ("e0", "e1")), [r["rejected"] for r in records]
        probes[name] = records[-1]["accuracy"]
        if extra:
            assert all(r["dp_epsilon"] > 0 for r in records), records
            two = {"devices": 2, "dropped": 0}
            assert all(r["secagg"] == {e: {"weights.model": two} for e in ("e0", "e1")} for r in records), records
    assert abs(probes["private"] - probes["clear"]) <= 0.03, probes


def test_fedmar_releases_its_model_and_mean_latent_privately(mosquitto, tmp_path) -> None:
    """FedMAR under DP: two releases a round per device (the model update, the mean latent over
    its images' clipped latents), every device's latent reaches the cloud at negligible noise,
    the run completes with nothing refused; FedMAR (and DecMAR) with the noise shared is refused
    before round 1 (their latents travel one by one)."""
    import json

    import torch

    from splitedge.cloud.options import build_run_config
    from splitedge.methods.data.datasets import load_dataset
    from splitedge.sim import SimSettings, run_sim

    torch.set_num_threads(1)
    private = {"dp_sigma": 1e-6, "dp_update_clip": 1e3, "dp_clip": 1e3}
    out = tmp_path / "fedmar"
    run_sim(SimSettings(rounds=2, devices=4, edges=2, method="fedmar", broker=mosquitto.url, run="fedmar-dp",
                        out=out, max_train=200, max_test=100, deadline_s=60.0, overrides=private))
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in records] == [1, 2]
    assert all(r["dp_epsilon"] > 0 and r["latents"] == 4 for r in records), records
    assert not any(r["rejected"].get(e) for r in records for e in ("e0", "e1")), [r["rejected"] for r in records]
    info = load_dataset("digits", max_train=10, max_test=10)[2]
    with pytest.raises(ValueError, match="DecMAR's models and mean latents go to each neighbour"):
        build_run_config("decmar", info, None, 0, {**private, "dp_devices": 2, "secagg": "full"})
    with pytest.raises(ValueError, match="mean latents travel device by device"):
        build_run_config("fedmar", info, None, 0, {**private, "secagg": "full", "calibrate": "lda", "dp_head_clip": 1.0,
                                                   "dp_devices": 2})
