"""The self-supervised methods end to end over a real Mosquitto (digits, a few rounds): each
learns a representation a linear probe reads better than a random-init encoder's, SSD's scales
reach each device on its own topic, and the DSR / PD flags switch their terms off."""

from __future__ import annotations

import json
import math
import threading
from typing import Any

import pytest
import torch

from splitedge.methods.config import ModelSpec
from splitedge.methods.data.datasets import load_dataset
from splitedge.methods.metrics.report import representation_report
from splitedge.methods.ssl.model import build_net, encode
from splitedge.protocol.mqtt import MqttTransport
from splitedge.protocol.topics import parse
from splitedge.sim import SimSettings, run_sim

ROUNDS = 3


def _run(mosquitto: Any, tmp_path: Any, method: str, **settings: Any) -> list[dict]:
    torch.set_num_threads(1)
    s = SimSettings(rounds=ROUNDS, devices=4, edges=2, method=method, broker=mosquitto.url, run=f"ssl-{method}",
                    out=tmp_path, deadline_s=120.0, overrides={"report_every": str(ROUNDS), **settings})
    run_sim(s)
    return [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def random_init() -> dict:
    """The same report for the untrained encoder every method starts from (same seed and spec)."""
    torch.set_num_threads(1)
    _, test, info = load_dataset("digits")
    spec = ModelSpec(model="cnn", num_classes=10, channels=1, image_size=8, mean=tuple(info.mean), std=tuple(info.std))
    net = build_net(spec, proj_hidden=4, predictor=False)
    return representation_report(lambda images: encode(net, images, spec), test, num_classes=10, seed=spec.seed)


@pytest.mark.parametrize("method", ["simsiam", "align-uniform", "ssd"])
def test_self_supervised_method_beats_a_random_encoder(method: str, mosquitto, tmp_path, random_init) -> None:
    # Execute
    history = _run(mosquitto, tmp_path, method)
    # Assert: the report came at the last round, on the test split, and beats the untrained encoder
    final = history[-1]
    assert all("probe_accuracy" not in r for r in history[:-1])
    assert final["accuracy"] == final["probe_accuracy"] > random_init["probe_accuracy"], (final, random_init)
    assert final["knn_accuracy"] > random_init["knn_accuracy"]
    assert final["probe_samples"] + final["eval_samples"] == 360 and len(final["spectrum"]) == 64
    # labels never trained anything: the devices' loss holds the method's terms only
    terms = set(final["loss"]["device"]) - {"total"}
    assert terms == {"simsiam": {"simsiam"}, "align-uniform": {"align", "uniformity"},
                     "ssd": {"align", "uniformity", "dsr", "pd"}}[method]


def test_ssd_scales_reach_each_device_alone_and_flags_switch_terms_off(mosquitto, tmp_path) -> None:
    # Prepare: record which topics carried SSD's records
    seen: list[tuple[str, str]] = []
    lock = threading.Lock()

    def record(topic: str, env: Any) -> None:
        if env.kind == "arrays":
            with lock:
                seen.append((topic, env.body["name"]))

    observer = MqttTransport(mosquitto.url, client_id="ssd-observer", role="observer")
    observer.subscribe("splitedge/ssl-ssd/#", record)
    try:
        # Execute: the ablation without PD, then without DSR
        no_pd = _run(mosquitto, tmp_path / "nopd", "ssd", pd="false")
    finally:
        observer.close()
    no_dsr = _run(mosquitto, tmp_path / "nodsr", "ssd", dsr="false")
    # Assert: Q went to every device once, each d_k to its device only (cloud -> its edge -> it)
    with lock:
        scales = [(parse(t), name) for t, name in seen if name == "ssd_d"]
        q = [parse(t) for t, name in seen if name == "ssd_q"]
    cloud_d = {t.to for t, _ in scales if t.tier == "cloud"}
    edge_d = {t.to for t, _ in scales if t.tier == "edge"}
    assert cloud_d == edge_d == {"d0", "d1", "d2", "d3"}
    assert {t.to for t in q if t.tier == "cloud"} == {"@all"} and {t.to for t in q if t.tier == "edge"} == {None}
    assert set(no_pd[-1]["loss"]["device"]) - {"total"} == {"align", "uniformity", "dsr"}
    assert set(no_dsr[-1]["loss"]["device"]) - {"total"} == {"align", "uniformity", "pd"}


def test_ssd_in_the_papers_form_trains_with_both_terms(mosquitto, tmp_path) -> None:
    # form=paper swaps DSR and PD for the paper's formulas (test_ssl_losses checks them by hand);
    # the run takes them: both terms in the devices' loss, finite, and the code's form differs
    paper = _run(mosquitto, tmp_path / "paper", "ssd", form="paper")
    code = _run(mosquitto, tmp_path / "code", "ssd")
    loss_paper, loss_code = paper[-1]["loss"]["device"], code[-1]["loss"]["device"]
    assert {"dsr", "pd"} <= set(loss_paper) and all(math.isfinite(v) for v in loss_paper.values()), loss_paper
    assert loss_paper["pd"] != pytest.approx(loss_code["pd"], rel=1e-3), (loss_paper, loss_code)
