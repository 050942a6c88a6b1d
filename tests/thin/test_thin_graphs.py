"""The thin device runs only what its install defines: W_c and the calibration trunk built in
numpy from the model spec, weights bound after checks, parity with torch, and no graph accepted
from the wire."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from splitedge.exporters.onnx_export import export_module, run_torch
from splitedge.methods.calibration.records import calibration_round, head_stats
from splitedge.methods.calibration.stats import HeadStatsAccumulator, head_stats_from_arrays
from splitedge.methods.config import ModelSpec
from splitedge.methods.contract import Unsupported
from splitedge.methods.data.preprocess import to_input
from splitedge.methods.moments import MomentAccumulator
from splitedge.methods.thin.graphs import calib_graph, thin_models, wc_graph
from splitedge.models import ClassifierInput, create_split, state_to_numpy
from splitedge.protocol import Envelope, ProtocolError, decode, encode
from parts import device_ctx, plan_for

CIFAR = ModelSpec(model="fedcnn", channels=3, image_size=32, mean=(0.5,) * 3, std=(0.25,) * 3)


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def make_split(seed: int, model: str = "cnn", channels: int = 1, size: int = 8):
    torch.manual_seed(seed)
    split = create_split(model, num_classes=10, in_channels=channels, image_size=size).eval()
    with torch.no_grad():
        for m in split.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.normal_(0, 0.1)
                m.running_var.uniform_(0.5, 1.5)
    return split


@pytest.fixture(scope="module")
def splits():
    return make_split(0), make_split(1)  # global v0, and the "averaged" v1


@pytest.fixture(scope="module")
def images():
    x = np.random.default_rng(0).integers(0, 256, (40, 8, 8, 1), dtype=np.uint8)
    y = np.arange(40) % 4
    return x, y


def thin_device(images, **settings):
    ctx = device_ctx("hsfp", "d1", **settings)  # cnn on 8x8x1, normalised with mean 0.5 and std 0.25
    return ctx.method.device_part(ctx, images, "onnx")


def weights_env(weights: dict, version: int, part: str = "wc") -> SimpleNamespace:
    return SimpleNamespace(kind="weights", body={"part": part, "version": version, "samples": 1, "weights": weights})


def torch_moments(module, images):
    feats = run_torch(module, to_input(images[0], (0.5,), (0.25,)))
    acc = MomentAccumulator(int(np.prod(feats.shape[1:])))
    acc.add(feats.reshape(len(feats), -1), images[1])
    return acc.result()


@pytest.mark.parametrize("model,channels,size", [("cnn", 1, 8), ("cnn", 3, 32), ("fedcnn", 3, 32), ("fedcnn", 1, 8),
                                                ("fedcnn2", 3, 32), ("fedcnn2", 1, 8),
                                                ("resnet18", 3, 32), ("resnet18", 1, 8)])
def test_local_graphs_match_torch(model, channels, size):
    """Every model a thin device runs: its W_c and its calibration trunk, built from the spec,
    take the torch split's state dict as it is and compute what torch computes."""
    split = make_split(3, model, channels, size)
    x = np.random.default_rng(1).standard_normal((6, channels, size, size)).astype(np.float32)
    wc = wc_graph(model, channels)
    wc.load_weights(state_to_numpy(split.wc))
    h = wc.features(x)
    np.testing.assert_allclose(h, run_torch(split.wc, x), atol=1e-5)
    trunk = ClassifierInput(split.we, split.wg).eval()
    calib = calib_graph(model, channels, size, 10)
    calib.load_weights(state_to_numpy(trunk))
    np.testing.assert_allclose(calib.features(h), run_torch(trunk, h), atol=1e-4)
    assert thin_models() == ["cnn", "fedcnn", "fedcnn2", "resnet18"]


def bad_maps(good: dict) -> dict[str, dict]:
    missing = dict(good)
    missing.pop("block2.conv.weight")
    unknown = {**good, "block9.conv.weight": good["block1.conv.weight"]}
    shape = {**good, "block1.bn.bias": np.zeros(7, np.float32)}
    dtype = {**good, "block1.conv.weight": good["block1.conv.weight"].astype(np.int64)}
    size = {**good, "block1.conv.weight": np.zeros((32, 1, 3, 3000), np.float32)}
    nan = {**good, "block1.bn.weight": np.full(32, np.nan, np.float32)}
    variance = {**good, "block1.bn.running_var": -np.ones(32, np.float32)}
    return {"missing": missing, "unknown": unknown, "shape": shape, "dtype": dtype, "size": size, "nan": nan,
            "variance": variance}


@pytest.mark.parametrize("case", ["missing", "unknown", "shape", "dtype", "size", "nan", "variance"])
def test_a_map_that_does_not_fit_is_refused_and_the_weights_in_use_stay(splits, images, case):
    x = to_input(images[0], (0.5,), (0.25,))
    wc = wc_graph("cnn", 1)
    wc.load_weights(state_to_numpy(splits[0].wc))
    before = wc.features(x)
    with pytest.raises(ProtocolError) as err:
        wc.load_weights(bad_maps(state_to_numpy(splits[1].wc))[case])
    assert err.value.rule in ("state.weights", "state.range")
    assert np.array_equal(wc.features(x), before)


def test_a_model_the_install_lacks_is_refused_in_one_line():
    with pytest.raises(ValueError, match="runs the models of its install"):
        wc_graph("vit_mae", 3)
    spec = ModelSpec(model="vit_mae", channels=3, image_size=32, mean=(0.5,) * 3, std=(0.25,) * 3)
    ctx = device_ctx("hsfp", "d1", spec=spec)
    with pytest.raises(Unsupported, match="--backend torch"):
        ctx.method.device_part(ctx, (np.zeros((4, 32, 32, 3), np.uint8), np.zeros(4, int)), "onnx")


def test_a_graph_never_travels(splits):
    """No kind carries a graph: `onnx_model` is an unknown kind, and a graph's bytes where a
    weight map is expected are refused by the schema, before any part sees them."""
    graph = export_module(splits[0].wc, (1, 8, 8), part="wc").SerializeToString()
    old = Envelope(kind="onnx_model", run="r", round=0, sender="e0",
                   body={"part": "wc", "version": 0, "model": graph, "sha256": "0" * 64})
    with pytest.raises(ProtocolError) as err:
        decode(encode(old, validate=False))
    assert err.value.rule == "envelope.kind_unknown"
    smuggled = Envelope(kind="weights", run="r", round=0, sender="e0",
                        body={"part": "wc", "version": 1, "samples": 0, "weights": {"block1.conv.weight": graph}})
    with pytest.raises(ProtocolError) as err:
        decode(encode(smuggled, validate=False))
    assert err.value.rule.startswith("schema")


def test_thin_device_waits_for_weights_then_swaps_between_rounds(splits, images):
    dev = thin_device(images)
    plan = plan_for(1, versions={"wc": 0, "we": 0})
    assert not dev.ready(plan)  # its own W_c, but no weights from the federation yet
    dev.on_message(weights_env(state_to_numpy(splits[0].wc), 0))
    assert dev.ready(plan) and dev.wc_version == 0
    np.testing.assert_allclose(dev.compute_moments().mean, torch_moments(splits[0].wc, images).mean, atol=1e-5)
    dev.on_message(weights_env(state_to_numpy(splits[1].wc), 1))
    assert dev.wc_version == 1
    np.testing.assert_allclose(dev.compute_moments().mean, torch_moments(splits[1].wc, images).mean, atol=1e-5)
    bad = weights_env(bad_maps(state_to_numpy(splits[1].wc))["shape"], 2)
    with pytest.raises(ProtocolError):
        dev.check(bad, "parent")  # the runtime refuses it (logged, counted) before on_message
    msgs = list(dev.run_round(plan_for(2, versions={"wc": 1, "we": 0})))
    assert msgs[0].kind == "moments" and msgs[0].body["versions"] == {"wc": 1}


def test_thin_device_resends_moments_when_the_edge_asks(splits, images):
    dev = thin_device(images)
    dev.on_message(weights_env(state_to_numpy(splits[0].wc), 0))
    plan = plan_for(1, versions={"wc": 0, "we": 0})
    assert [m.kind for m in dev.run_round(plan) if hasattr(m, "kind")] == ["moments"]
    assert [m for m in dev.run_round(plan) if hasattr(m, "kind")] == []
    dev.on_message(SimpleNamespace(kind="request", body={"what": "moments"}))
    assert [m.kind for m in dev.run_round(plan) if hasattr(m, "kind")] == ["moments"]


def test_thin_device_head_statistics_match_torch(splits, images):
    """Calibration on a thin device: the trunk of its install gets the calibration weights by
    name; the head statistics it sends are torch's; a map that does not fit is refused."""
    dev = thin_device(images)
    dev.on_message(weights_env(state_to_numpy(splits[0].wc), 0))
    calib = ClassifierInput(splits[1].we, splits[1].wg).eval()
    plan = plan_for(1, versions={"wc": 0, "we": 0, "calib": 0}, directives={"calibrate": {"layers": {"classifier": 64}}},
                    phase="calibrate")
    assert not dev.ready(plan)
    dev.on_message(weights_env(state_to_numpy(calib), 0, part="calib"))
    assert dev.ready(plan) and dev.calib_version == 0
    calls, through = [], dev.stage_outputs
    dev.stage_outputs = lambda x: calls.append(len(x)) or through(x)  # type: ignore[method-assign]
    sent = [m for m in calibration_round(dev, plan) if hasattr(m, "kind")]
    assert [m.kind for m in sent] == ["arrays"] and sent[0].body["name"] == "head_stats"
    assert dev.stats_batch == 4 and max(calls) == 4 and sum(calls) == len(images[1])
    got = head_stats_from_arrays(sent[0].body["arrays"])
    with torch.no_grad():
        feats = calib(splits[0].wc(torch.from_numpy(to_input(images[0], (0.5,), (0.25,))))).numpy()
    acc = HeadStatsAccumulator(feats.shape[1])
    acc.add(feats, images[1])
    want = acc.result()
    np.testing.assert_array_equal(got.counts, want.counts)
    np.testing.assert_allclose(got.mean, want.mean, atol=1e-5)
    np.testing.assert_allclose(got.cov, want.cov, atol=1e-5)
    bad = {**state_to_numpy(calib), "we.block3.bn.bias": np.zeros(7, np.float32)}
    with pytest.raises(ProtocolError):
        dev.check(weights_env(bad, 1, part="calib"), "parent")


def test_thin_device_with_pre_relu_takes_moments_before_the_relu_and_calibrates_after_it(splits, images):
    from splitedge.models import pre_activation

    dev = thin_device(images, pre_relu=True)
    dev.on_message(weights_env(state_to_numpy(splits[0].wc), 0))
    calib = ClassifierInput(splits[1].we, splits[1].wg).eval()
    dev.on_message(weights_env(state_to_numpy(calib), 0, part="calib"))
    moments = dev.compute_moments()
    np.testing.assert_allclose(moments.mean, torch_moments(pre_activation(splits[0].wc), images).mean, atol=1e-5)
    assert (moments.mean < 0).any()  # before the ReLU
    got = head_stats(dev.classifier_input, images, (0.5,), (0.25,))
    with torch.no_grad():
        feats = calib(splits[0].wc(torch.from_numpy(to_input(images[0], (0.5,), (0.25,))))).numpy()
    acc = HeadStatsAccumulator(feats.shape[1])
    acc.add(feats, images[1])
    np.testing.assert_allclose(got.mean, acc.result().mean, atol=1e-5)


def test_a_parked_thin_device_comes_back_the_same(splits, images):
    """Parked (a virtual device) or restarted, a thin device keeps the weights it bound, as
    arrays; restored, it computes the same moments."""
    from splitedge.methods import snapshot

    dev = thin_device(images)
    dev.on_message(weights_env(state_to_numpy(splits[1].wc), 1))
    saved = snapshot.dumps(dev.resume_state())
    fresh = thin_device(images)
    fresh.restore_state(snapshot.loads(saved))
    assert fresh.wc_version == 1 and fresh.extractor.loaded
    np.testing.assert_array_equal(fresh.compute_moments().mean, dev.compute_moments().mean)


def test_a_thin_trainer_in_the_papers_form_sends_moments_of_its_trained_copy(splits, images):
    """moments_of="local" on a thin device: the numpy copy after this round's training, the same
    features torch computes with those weights (eval mode)."""
    from splitedge.methods.contract import DONE, RoundPlan
    from splitedge.methods.moments import moments_from_body
    from splitedge.models import load_numpy_state

    dev = thin_device(images, moments_of="local", device_batch=8)
    dev.on_message(weights_env(state_to_numpy(splits[0].wc), 0))
    plan = RoundPlan(round=1, method="hsfp", deadline_s=60, config={}, versions={"wc": 0, "we": 0})
    sent = [m for m in dev.run_round(plan) if m is not DONE]
    assert [m.kind for m in sent] == ["moments"]
    trained = dev.trainer.weights()
    assert not np.allclose(trained["block1.conv.weight"], state_to_numpy(splits[0].wc)["block1.conv.weight"])
    wc = make_split(0).wc
    load_numpy_state(wc, trained)
    np.testing.assert_allclose(moments_from_body(sent[0].body).mean, torch_moments(wc.eval(), images).mean,
                               rtol=1e-4, atol=1e-5)


def test_thin_device_stage_outputs_are_torchs_at_every_layer(splits, images):
    """A head may sit at W_c's or W_e's output (methods/calibration/layers.py): the thin device's
    outputs there are the torch split's, so its statistics describe the served network."""
    dev = thin_device(images)
    dev.on_message(weights_env(state_to_numpy(splits[0].wc), 0))
    calib = ClassifierInput(splits[1].we, splits[1].wg).eval()
    dev.on_message(weights_env(state_to_numpy(calib), 0, part="calib"))
    x = to_input(images[0], (0.5,), (0.25,))
    got = dev.stage_outputs(x)
    with torch.no_grad():
        h = splits[0].wc.eval()(torch.from_numpy(x))
        e, f = calib.stages(h)
    for key, want in (("wc", h), ("we", e), ("classifier", f)):
        np.testing.assert_allclose(got[key], want.numpy(), atol=1e-5)
