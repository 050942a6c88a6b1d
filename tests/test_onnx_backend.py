"""The thin device backend: OnnxExtractor (features, weight swaps, model swaps) and the H-SFP
thin device part, checked against torch; corrupt models and weights are rejected."""

from __future__ import annotations

import copy
import hashlib
from types import SimpleNamespace

import numpy as np
import onnx
import pytest
import torch

from splitedge.methods.thin.onnx_backend import OnnxExtractor
from splitedge.methods.thin.onnx_graph import initializer_specs
from splitedge.exporters.onnx_export import export_calib_bytes, export_module, export_wc_bytes, run_torch
from splitedge.exporters.variants import to_fp16
from splitedge.methods.calibration.records import calibration_round, head_stats
from splitedge.methods.calibration.stats import HeadStatsAccumulator, head_stats_from_arrays
from splitedge.methods.moments import MomentAccumulator
from splitedge.methods.data.preprocess import to_input
from parts import ctx_for, plan_for
from splitedge.models import ClassifierInput, create_split, state_to_numpy
from splitedge.protocol import Envelope, ProtocolError, decode, encode



def thin_device(images):
    ctx = ctx_for("hsfp", "d1")  # cnn on 8x8x1, normalised with mean 0.5 and std 0.25
    return ctx.method.device_part(ctx, images, "onnx")


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def make_split(seed: int):
    torch.manual_seed(seed)
    split = create_split("cnn", num_classes=10, in_channels=1, image_size=8).eval()
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
def model_bytes(splits):
    return export_wc_bytes(splits[0])


@pytest.fixture(scope="module")
def images():
    x = np.random.default_rng(0).integers(0, 256, (40, 8, 8, 1), dtype=np.uint8)
    y = np.arange(40) % 4
    return x, y


def test_initializer_table_matches_onnx(model_bytes):
    for data in (model_bytes, to_fp16(onnx.load_from_string(model_bytes)).SerializeToString()):
        ours = {n: (s.shape, s.dtype) for n, s in initializer_specs(data).items()}
        ref = {i.name: (tuple(i.dims), onnx.helper.tensor_dtype_to_np_dtype(i.data_type))
               for i in onnx.load_from_string(data).graph.initializer}
        assert ours == ref


def test_features_match_torch(splits, model_bytes, images):
    x = to_input(images[0], (0.5,), (0.25,))
    got = OnnxExtractor(model_bytes, sha256=hashlib.sha256(model_bytes).hexdigest()).features(x)
    assert np.abs(got - run_torch(splits[0].wc, x)).max() < 1e-5


@pytest.mark.parametrize("swap", ["patch", "initializer"])
def test_load_weights_swaps_by_name_with_torch_parity(splits, model_bytes, images, swap):
    # Prepare
    x = to_input(images[0], (0.5,), (0.25,))
    ext = OnnxExtractor(model_bytes, swap=swap)
    # Execute: the averaged W_c arrives as a state dict (incl. BN counters the graph does not use)
    ext.load_weights(state_to_numpy(splits[1].wc))
    # Assert
    assert np.abs(ext.features(x) - run_torch(splits[1].wc, x)).max() < 1e-5
    assert np.abs(ext.features(x) - run_torch(splits[0].wc, x)).max() > 1e-2


def bad_maps(good: dict) -> dict[str, dict]:
    missing = dict(good)
    missing.pop("block2.conv.weight")
    unknown = {**good, "block9.conv.weight": good["block1.conv.weight"]}
    shape = {**good, "block1.bn.bias": np.zeros(7, np.float32)}
    dtype = {**good, "block1.conv.weight": good["block1.conv.weight"].astype(np.int64)}
    return {"missing": missing, "unknown": unknown, "shape": shape, "dtype": dtype}


@pytest.mark.parametrize("case", ["missing", "unknown", "shape", "dtype"])
def test_mismatched_weights_rejected_and_old_session_kept(splits, model_bytes, images, case):
    # Prepare
    x = to_input(images[0], (0.5,), (0.25,))
    ext = OnnxExtractor(model_bytes)
    before = ext.features(x)
    # Execute / Assert
    with pytest.raises(ValueError):
        ext.load_weights(bad_maps(state_to_numpy(splits[1].wc))[case])
    assert np.array_equal(ext.features(x), before)


def test_load_model_checks_sha_and_bytes(splits, model_bytes, images):
    x = to_input(images[0], (0.5,), (0.25,))
    ext = OnnxExtractor(model_bytes)
    before = ext.features(x)
    with pytest.raises(ValueError, match="sha256"):
        ext.load_model(model_bytes, "0" * 64)
    junk = b"\x08\x07garbage" * 10
    with pytest.raises(ValueError):
        ext.load_model(junk, hashlib.sha256(junk).hexdigest())
    assert np.array_equal(ext.features(x), before)
    other = export_wc_bytes(splits[1])
    ext.load_model(other, hashlib.sha256(other).hexdigest())
    assert np.abs(ext.features(x) - run_torch(splits[1].wc, x)).max() < 1e-5


def test_corrupt_onnx_model_rejected_at_decode(model_bytes):
    body = {"part": "wc", "version": 0, "model": model_bytes[:-1] + b"\x00",
            "sha256": hashlib.sha256(model_bytes).hexdigest()}
    data = encode(Envelope(kind="onnx_model", run="r", round=0, sender="e0", body=body), validate=False)
    with pytest.raises(ProtocolError) as err:
        decode(data)
    assert err.value.rule == "schema.check"


def model_env(data: bytes, version: int = 0, sha: str | None = None) -> SimpleNamespace:
    body = {"part": "wc", "version": version, "model": data, "sha256": sha or hashlib.sha256(data).hexdigest()}
    return SimpleNamespace(kind="onnx_model", body=body)


def weights_env(weights: dict, version: int) -> SimpleNamespace:
    return SimpleNamespace(kind="weights", body={"part": "wc", "version": version, "samples": 1, "weights": weights})


def torch_moments(module, images):
    feats = run_torch(module, to_input(images[0], (0.5,), (0.25,)))
    acc = MomentAccumulator(int(np.prod(feats.shape[1:])))
    acc.add(feats.reshape(len(feats), -1), images[1])
    return acc.result()


def test_thin_device_waits_for_model_then_swaps_between_rounds(splits, model_bytes, images):
    # Prepare
    dev = thin_device(images)
    plan = plan_for(1, versions={"wc": 0, "we": 0})
    # Execute / Assert: weights alone do not make it ready; the model does
    dev.on_message(weights_env(state_to_numpy(splits[0].wc), 0))
    assert not dev.ready(plan)
    dev.on_message(model_env(model_bytes))
    assert dev.ready(plan) and dev.wc_version == 0
    # the average v1 is swapped in; moments match torch's W_c v1
    dev.on_message(weights_env(state_to_numpy(splits[1].wc), 1))
    assert dev.wc_version == 1
    np.testing.assert_allclose(dev.compute_moments().mean, torch_moments(splits[1].wc, images).mean, atol=1e-5)
    # a mismatched v2 is rejected with the v1 graph kept
    dev.on_message(weights_env(bad_maps(state_to_numpy(splits[1].wc))["shape"], 2))
    assert dev.wc_version == 1
    msgs = list(dev.run_round(plan_for(2, versions={"wc": 1, "we": 0})))
    assert msgs[0].kind == "moments" and msgs[0].body["versions"] == {"wc": 1}


def test_thin_device_keeps_model_when_a_new_one_is_corrupt(model_bytes, images):
    dev = thin_device(images)
    dev.on_message(model_env(model_bytes))
    extractor = dev.extractor
    before = extractor.features(to_input(images[0], (0.5,), (0.25,)))
    dev.on_message(model_env(b"\x08\x07not onnx", version=3))
    assert dev.extractor is extractor and dev.model_version == 0
    assert np.array_equal(extractor.features(to_input(images[0], (0.5,), (0.25,))), before)


def test_late_model_applies_newer_weights_seen_before(splits, model_bytes, images):
    dev = thin_device(images)
    dev.on_message(weights_env(state_to_numpy(splits[1].wc), 2))  # joined late: retained v2 first
    dev.on_message(model_env(model_bytes))
    assert dev.wc_version == 2
    np.testing.assert_allclose(dev.compute_moments().mean, torch_moments(splits[1].wc, images).mean, atol=1e-5)


def test_fp16_graph_accepts_f4_weights_by_name(splits, model_bytes, images):
    fp16 = to_fp16(export_module(copy.deepcopy(splits[0].wc), (1, 8, 8))).SerializeToString()
    ext = OnnxExtractor(fp16)
    ext.load_weights(state_to_numpy(splits[1].wc))
    x = to_input(images[0], (0.5,), (0.25,))
    ref = run_torch(splits[1].wc, x)
    assert np.abs(ext.features(x) - ref).max() < 1e-2 * np.abs(ref).max()


def test_thin_device_resends_moments_when_the_edge_asks(model_bytes, images):
    dev = thin_device(images)
    dev.on_message(model_env(model_bytes))
    plan = plan_for(1, versions={"wc": 0, "we": 0})
    assert [m.kind for m in dev.run_round(plan) if hasattr(m, "kind")] == ["moments"]
    assert [m for m in dev.run_round(plan) if hasattr(m, "kind")] == []
    dev.on_message(SimpleNamespace(kind="request", body={"what": "moments"}))
    assert [m.kind for m in dev.run_round(plan) if hasattr(m, "kind")] == ["moments"]


def test_thin_device_head_statistics_match_torch(splits, model_bytes, images):
    """Calibration on a thin device: a second graph (W_e and W_g's trunk) gets the calibration
    weights by name; the head statistics it sends are torch's, and a map that does not fit is
    dropped with the version it had kept."""
    # Prepare: W_c v0 as the device's graph, calibration weights of split 1
    dev = thin_device(images)
    dev.on_message(model_env(model_bytes))
    calib = ClassifierInput(splits[1].we, splits[1].wg).eval()
    plan = plan_for(1, versions={"wc": 0, "we": 0, "calib": 0}, directives={"calibrate": {"dim": 64}},
                    phase="calibrate")
    graph = export_calib_bytes(splits[0])
    calib_env = SimpleNamespace(kind="onnx_model", body={"part": "calib", "version": 0, "model": graph,
                                                         "sha256": hashlib.sha256(graph).hexdigest()})
    # Execute / Assert: the weights alone do not make it ready; with the graph they are swapped in
    dev.on_message(SimpleNamespace(kind="weights", body={"part": "calib", "version": 0, "samples": 0,
                                                         "weights": state_to_numpy(calib)}))
    assert not dev.ready(plan)
    dev.on_message(calib_env)
    assert dev.ready(plan) and dev.calib_version == 0
    calls, through = [], dev.classifier_input
    dev.classifier_input = lambda x: calls.append(len(x)) or through(x)  # type: ignore[method-assign]
    sent = [m for m in calibration_round(dev, plan) if hasattr(m, "kind")]
    assert [m.kind for m in sent] == ["arrays"] and sent[0].body["name"] == "head_stats"
    # a few images a call: onnxruntime's unoptimised convolutions buffer in proportion to the batch
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
    # a calibration map of another shape is refused; version 0 stays in use
    bad = {**state_to_numpy(calib), "we.block3.bn.bias": np.zeros(7, np.float32)}
    with pytest.raises(ProtocolError):
        dev.check(SimpleNamespace(kind="weights", body={"part": "calib", "version": 1, "weights": bad}), "parent")
    dev.on_message(SimpleNamespace(kind="weights", body={"part": "calib", "version": 1, "samples": 0, "weights": bad}))
    assert dev.calib_version == 0


def test_thin_device_with_pre_relu_takes_moments_before_the_relu_and_calibrates_after_it(splits, images):
    """pre_relu on a thin device: the cloud's W_c graph stops before the final ReLU, so its
    moments are torch's pre-activation ones, while the head statistics still see the ReLU."""
    from splitedge.models import pre_activation

    ctx = ctx_for("hsfp", "d1", pre_relu=True)
    dev = ctx.method.device_part(ctx, images, "onnx")
    dev.on_message(model_env(export_wc_bytes(splits[0], pre_relu=True)))
    assert not any(m.training for m in splits[0].wc.modules())  # exporting the view left W_c in eval mode
    calib = ClassifierInput(splits[1].we, splits[1].wg).eval()
    graph = export_calib_bytes(splits[0])
    dev.on_message(SimpleNamespace(kind="weights", body={"part": "calib", "version": 0, "samples": 0,
                                                         "weights": state_to_numpy(calib)}))
    dev.on_message(SimpleNamespace(kind="onnx_model", body={"part": "calib", "version": 0, "model": graph,
                                                            "sha256": hashlib.sha256(graph).hexdigest()}))
    moments = dev.compute_moments()
    np.testing.assert_allclose(moments.mean, torch_moments(pre_activation(splits[0].wc), images).mean, atol=1e-5)
    assert (moments.mean < 0).any()  # before the ReLU
    got = head_stats(dev.classifier_input, images, (0.5,), (0.25,))
    with torch.no_grad():
        feats = calib(splits[0].wc(torch.from_numpy(to_input(images[0], (0.5,), (0.25,))))).numpy()
    acc = HeadStatsAccumulator(feats.shape[1])
    acc.add(feats, images[1])
    np.testing.assert_allclose(got.mean, acc.result().mean, atol=1e-5)


def test_a_parked_thin_device_keeps_its_weights_once_and_comes_back_the_same(splits, model_bytes, images):
    """Parked, a thin device keeps its graph (the weights in use patched in) and no second copy
    of the weight map it swapped in; restored, it computes the same moments and takes the same
    (retained) weight map delivered again without a swap."""
    from splitedge.methods import snapshot

    dev = thin_device(images)
    dev.on_message(model_env(model_bytes))
    v1 = state_to_numpy(splits[1].wc)
    dev.on_message(weights_env(v1, 1))
    assert dev.wc_version == 1
    saved = snapshot.dumps(dev.resume_state())
    weight_bytes = sum(a.nbytes for a in v1.values())
    assert len(saved) < len(dev.extractor.model_bytes) + weight_bytes // 2, (len(saved), weight_bytes)
    assert "wc" in dev.latest  # the live device still has it (a graph delivered again needs it)

    fresh = thin_device(images)
    fresh.restore_state(snapshot.loads(saved))
    assert fresh.wc_version == 1 and "wc" not in fresh.latest
    np.testing.assert_array_equal(fresh.compute_moments().mean, dev.compute_moments().mean)
    fresh.on_message(weights_env(v1, 1))  # the retained map again: already in the graph
    assert fresh.wc_version == 1
    np.testing.assert_array_equal(fresh.compute_moments().mean, dev.compute_moments().mean)


def test_a_thin_trainer_in_the_papers_form_sends_moments_of_its_trained_copy(splits, model_bytes, images):
    """moments_of="local" on a thin device: the numpy copy after this round's training, the same
    features torch computes with those weights (eval mode)."""
    from splitedge.methods.contract import DONE, RoundPlan
    from splitedge.methods.moments import moments_from_body
    from splitedge.models import load_numpy_state

    ctx = ctx_for("hsfp", "d1", moments_of="local", device_batch=8)
    dev = ctx.method.device_part(ctx, images, "onnx")
    dev.on_message(model_env(model_bytes))
    plan = RoundPlan(round=1, method="hsfp", deadline_s=60, config={}, versions={"wc": 0, "we": 0})
    sent = [m for m in dev.run_round(plan) if m is not DONE]
    assert [m.kind for m in sent] == ["moments"]
    trained = dev.trainer.weights()
    assert not np.allclose(trained["block1.conv.weight"], state_to_numpy(splits[0].wc)["block1.conv.weight"])
    wc = make_split(0).wc
    load_numpy_state(wc, trained)
    np.testing.assert_allclose(moments_from_body(sent[0].body).mean, torch_moments(wc.eval(), images).mean,
                               rtol=1e-4, atol=1e-5)
