"""Where the calibrated head sits (issue 54, item 1; methods/calibration/layers.py): the layer
names and their pooling, the rows a device holds back, the features a device computes at each
layer equal to the cloud's, the served network of a head off the classifier, a federation that
chooses among layers by the images its devices held back (never the test split) and exports
what it chose, and the settings and messages refused."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from splitedge.methods.calibration.layers import HeadLayer, held_out, layer_features, parse_layers, pooled
from splitedge.methods.calibration.records import Gate, check_heads, heads_message, record
from splitedge.methods.calibration.stats import HeadStats
from splitedge.methods.config import MethodConfig, ModelSpec, RunConfig
from splitedge.methods.contract import DeviceContext, RoundPlan
from splitedge.methods.registry import get_method
from splitedge.protocol.errors import ProtocolError
from splitedge.sim import SimSettings, run_sim

LAYERS = "wc,we_1,classifier"


def test_layer_names_read_and_refuse_in_one_line() -> None:
    assert [layer.name for layer in parse_layers("wc_8, we,classifier")] == ["wc_8", "we", "classifier"]
    assert parse_layers("we_4")[0] == HeadLayer("we", 4)
    for bad in ("wc:8", "fc1", "wc_0", "", "we,we"):
        with pytest.raises(ValueError, match="calib_layer"):
            parse_layers(bad)
    assert HeadLayer("wc", 8).dim((32, 16, 16)) == 2048 and HeadLayer("we").dim((128, 4, 4)) == 2048
    assert "does not divide" in HeadLayer("wc", 3).fits((32, 16, 16))
    with pytest.raises(ValueError, match="calib_holdout"):
        MethodConfig(calib_layer="wc,classifier", calib_holdout=0.0)
    with pytest.raises(ValueError, match="name one layer"):
        MethodConfig(calib_layer="wc,classifier", calibrate="lda", dp_sigma=1.0, dp_head_clip=1.0)


def test_pooling_in_numpy_is_torchs_adaptive_average_pool() -> None:
    x = np.random.default_rng(0).normal(size=(3, 5, 16, 16)).astype(np.float32)
    for side in (1, 2, 8):
        want = torch.nn.functional.adaptive_avg_pool2d(torch.from_numpy(x), side).reshape(3, -1).numpy()
        np.testing.assert_allclose(pooled(x, side), want, rtol=1e-6, atol=1e-6)
    assert pooled(x, None).shape == (3, 5 * 256)
    assert layer_features({"wc": x}, HeadLayer("wc", 2)).shape == (3, 20)
    with pytest.raises(ValueError, match="no we output"):
        layer_features({"wc": x}, HeadLayer("we"))


def test_the_rows_held_back_are_a_share_of_each_class_and_the_same_every_time() -> None:
    labels = np.repeat(np.arange(4), [10, 20, 1, 5])
    mask = held_out(labels, 0.2, "d3")
    assert [int(mask[labels == c].sum()) for c in range(4)] == [2, 4, 0, 1]  # a class of one keeps its image
    np.testing.assert_array_equal(mask, held_out(labels, 0.2, "d3"))
    assert not np.array_equal(mask, held_out(labels, 0.2, "d4"))  # each device draws its own


def _fedavg(layers: str, **kw) -> object:
    spec = ModelSpec(model="fedcnn", num_classes=10, channels=3, image_size=32, mean=(0.5,) * 3, std=(0.25,) * 3)
    method = get_method("fedavg")
    return method(RunConfig(spec, method.Config(calibrate="lda", calib_layer=layers, min_class_count=1, **kw)))


def test_a_device_computes_the_features_the_cloud_scores_and_serves() -> None:
    """The device's features at each layer (numpy pooling of its stage outputs) are the cloud's
    (torch's pooling of the same model), and the served network of a head at W_c or W_e gives
    the logits that head gives on those features."""
    from splitedge.methods.calibration.serving import stage_features, with_head_at
    from splitedge.models import load_numpy_state
    from splitedge.models.split import head_at_layer

    torch.manual_seed(0)
    m = _fedavg("wc_4,we,classifier")
    rng = np.random.default_rng(0)
    data = (rng.integers(0, 256, size=(6, 32, 32, 3), dtype=np.uint8), np.arange(6) % 3)
    part = m.device_part(DeviceContext("d0", m, rng), data, backend="torch")
    x = rng.normal(size=(6, 3, 32, 32)).astype(np.float32)
    outputs = part.stage_outputs(x)
    for layer in parse_layers("wc_4,we,classifier"):
        for mode in (True, False):  # the cloud's model may be in either mode: its features are eval's, its mode kept
            part.model.train(mode)
            with torch.no_grad():
                want = stage_features(part.model, layer)(torch.from_numpy(x)).numpy()
            assert part.model.training == part.model.wc.training == part.model.we.training == mode
        got = layer_features(outputs, layer)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        if layer.stage == "classifier":
            continue
        head = (rng.normal(size=(10, got.shape[1])), rng.normal(size=10))
        served = head_at_layer(part.model, layer.stage, layer.side)
        load_numpy_state(served, with_head_at(part.model, layer, head))
        with torch.no_grad():
            logits = served.eval()(torch.from_numpy(x)).double().numpy()
        np.testing.assert_allclose(logits, got @ head[0].T + head[1], rtol=1e-4, atol=1e-4)


def test_records_at_a_layer_the_phase_does_not_take_are_refused() -> None:
    m = _fedavg("wc_4,classifier")
    plan = RoundPlan(round=2, method="fedavg", deadline_s=10.0, config={}, phase="calibrate",
                     directives={"calibrate": {"layers": {"wc_4": 512, "classifier": 256}}})
    gate = Gate.of(plan, m)
    stats = HeadStats(np.arange(2), np.array([3, 4]), np.zeros((2, 512)), np.eye(512))
    ok = record(stats, plan, m.config, "wc_4")
    gate.check(type("E", (), {"body": ok.body})())
    for layer, why in (("we", "state.layer"), ("classifier", "state.dim")):
        bad = record(stats, plan, m.config, layer)
        with pytest.raises(ProtocolError) as exc:
            gate.check(type("E", (), {"body": bad.body})())
        assert exc.value.rule == why


def test_candidate_heads_must_be_one_per_layer_of_the_run() -> None:
    heads = {"wc_4": (np.zeros((10, 512)), np.zeros(10)), "classifier": (np.zeros((10, 256)), np.zeros(10))}
    body = heads_message(heads, 3).body
    check_heads(body, ["wc_4", "classifier"], 10)
    for layers, classes in ((["wc_4"], 10), (["wc_4", "classifier", "we"], 10), (["wc_4", "classifier"], 9)):
        with pytest.raises(ProtocolError):
            check_heads(body, layers, classes)


@pytest.mark.parametrize("method, layers, overrides, why", [
    ("fedproto", "we", {}, "only at the classifier's input"),
    ("fedavg", "we", {"secagg": "full", "robust": "none"}, "secure sums"),
    ("fedavg", "wc_3", {}, "does not divide"),
])
def test_settings_a_run_cannot_honour_are_refused_before_round_1(method, layers, overrides, why) -> None:
    spec = ModelSpec(model="fedcnn", num_classes=10, channels=3, image_size=32, mean=(0.5,) * 3, std=(0.25,) * 3)
    cls = get_method(method)
    m = cls(RunConfig(spec, cls.Config(calibrate="lda", calib_layer=layers, **overrides)))
    with pytest.raises(ValueError, match=why):
        m.settle()


@pytest.fixture(scope="module")
def chosen(tmp_path_factory) -> tuple[dict, list[dict], Path]:
    """Two rounds of FedAvg on digits over the embedded broker, choosing among three layers."""
    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("layers")
    s = SimSettings(rounds=2, devices=4, edges=2, method="fedavg", out=out, max_train=600, max_test=300, alpha=0.5,
                    overrides={"calibrate": "lda", "min_class_count": 1, "calib_layer": LAYERS})
    summary = run_sim(s)
    return summary, [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()], out


def test_the_federation_serves_the_layer_its_held_back_images_chose(chosen) -> None:
    summary, rounds, _ = chosen
    for r in rounds:
        scores, test = r["calib_layer_scores"], r["accuracy_calibrated_layers"]
        assert set(scores) == set(test) == {"wc", "we_1", "classifier"}
        # the held-back images chose (the first named among equals), not the test split
        best = max(scores.values())
        assert r["calib_layer"] == next(k for k in ("wc", "we_1", "classifier") if scores[k] == best)
        assert r["accuracy_calibrated"] == test[r["calib_layer"]]
        # about a fifth of the 600 training images were held back; the heads were fitted on the rest
        assert 90 <= r["calib_heldout"] <= 150 and r["calibrated"] == 600 - r["calib_heldout"]
    assert summary["served_head"] == "calibrated"
    assert summary["served_accuracy"] == rounds[-1]["accuracy_calibrated"]


def test_the_checkpoint_and_export_carry_the_chosen_layer(chosen, tmp_path) -> None:
    """The served checkpoint names the head's layer when it is off the classifier, and export
    rebuilds that network: its ONNX model scores as the round's record says."""
    from splitedge.cli import main
    from splitedge.exporters.checkpoint import read_header

    _, rounds, out = chosen
    layer = rounds[-1]["calib_layer"]
    meta = read_header(out / "model.safetensors").metadata
    assert meta.get("head_layer") == (None if layer == "classifier" else layer)
    assert main(["export", "--checkpoint", str(out / "model.safetensors"), "--out", str(tmp_path / "x"),
                 "--samples", "300"]) == 0
    report = json.loads((tmp_path / "x" / "export.json").read_text())
    assert report["head_layer"] == meta.get("head_layer")
    assert [v["top1_agreement"] for v in report["variants"] if v["graph"] == "model"] == [1.0]


def test_a_head_at_one_layer_off_the_classifier_is_served_and_exported(tmp_path) -> None:
    torch.set_num_threads(1)
    out = tmp_path / "run"
    run_sim(SimSettings(rounds=1, devices=2, edges=1, method="fedavg", out=out, max_train=300, max_test=100,
                        overrides={"calibrate": "lda", "min_class_count": 1, "calib_layer": "wc_2"}))
    record_ = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert record_["calib_layer"] == "wc_2" and "calib_layer_scores" not in record_
    assert record_["calibrated"] == 300  # one layer: nothing held back
    from splitedge.exporters.checkpoint import read_header

    assert read_header(out / "model.safetensors").metadata["head_layer"] == "wc_2"


@pytest.mark.parametrize("backend", ["torch", "onnx"])
def test_a_device_that_holds_images_back_to_choose_a_layer_does_not_train_on_them(backend) -> None:
    """A model trained on the held-back images would score itself on them: on CIFAR-10 FedAvg's
    held-back accuracy at fc1 was 72.9 % against 64.1 % on the test split, and the federation
    chose fc1 where W_e's head scored better on the test split (bench/results/layers-fedcnn-10dev)."""
    rng = np.random.default_rng(0)
    labels = np.arange(50) % 5
    data = (rng.integers(0, 256, size=(50, 32, 32, 3), dtype=np.uint8), labels)
    held = held_out(labels, 0.2, "d0")
    for layers, trained in (("wc_4,classifier", 50 - int(held.sum())), ("classifier", 50)):
        m = _fedavg(layers)
        part = m.device_part(DeviceContext("d0", m, rng), data, backend=backend)
        x, y = part.training_data()
        assert len(y) == trained and len(x) == trained
        assert len(part.y if backend == "torch" else part.train_set[1]) == trained  # what it trains on
        if trained < 50:
            np.testing.assert_array_equal(y, labels[~held])
