"""Grouped (depthwise) convolutions and ReLU6 in the thin layers (issue 55), against torch autograd:
the layers alone, per-sample gradients, the chunked step, tiny_mobilenet's W_c and calibration
trunk as a ThinModel (tests/plugin_models/tiny_mobilenet_thin.py), and a thin device without
torch training that W_c for a round of a real federation.

Tolerances are the thin trainer's (tests/thin/test_thin_trainer.py): 1e-4 of the largest
magnitude of torch's value for outputs and gradients (measured 12/08: a grouped layer's output
and input gradient up to 1.7e-7, its weight gradient 1.1e-6; per-sample gradients 2.2e-7;
tiny_mobilenet's W_c 4.6e-7 for output and input gradient, 1.8e-6 for parameter gradients; its
chunked step against the whole batch's 1.6e-6); ReLU6 is exact.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from splitedge.methods.thin import plugins as thin_plugins
from splitedge.methods.thin.layers import BatchNorm2d, Conv2d, ReLU6, Sequential
from splitedge.models import ClassifierInput, state_to_numpy
from torch_parity import GRAD_TOL, both_passes, rel_err

MODELS = Path(__file__).resolve().parents[1] / "plugin_models"
MODEL = "tiny_mobilenet:factory"


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


@pytest.fixture
def tiny(monkeypatch):
    """tiny_mobilenet's torch module and its thin twin, importable and registered for this test."""
    monkeypatch.syspath_prepend(str(MODELS))
    monkeypatch.setattr(thin_plugins, "_REGISTRY", {})
    import tiny_mobilenet
    import tiny_mobilenet_thin

    thin_plugins.register_thin_model(tiny_mobilenet_thin.THIN)
    return tiny_mobilenet, tiny_mobilenet_thin


def moved_norms(module: nn.Module, seed: int = 0) -> nn.Module:
    """BatchNorm scales, shifts and running statistics away from their initial values."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for m in module.modules():
            if isinstance(m, nn.BatchNorm2d):
                nn.init.uniform_(m.weight, 0.5, 1.5)
                nn.init.uniform_(m.bias, -0.5, 0.5)
                m.running_mean.normal_(0, 0.1)
                m.running_var.uniform_(0.5, 1.5)
    return module


# (c_in, c_out, groups, kernel, stride, padding, side): depthwise, channel multipliers, general groups
CONV_CASES = [(8, 8, 8, 3, 1, 1, 9), (8, 8, 8, 3, 2, 1, 8), (8, 8, 8, 3, 1, 0, 7), (8, 8, 8, 3, 2, 0, 9),
              (4, 8, 4, 3, 2, 1, 7), (6, 12, 3, 3, 1, 1, 6), (6, 12, 3, 3, 2, 0, 7), (8, 4, 2, 1, 1, 0, 5),
              (8, 16, 4, 3, 2, 1, 8)]


@pytest.mark.parametrize("c_in,c_out,groups,kernel,stride,padding,side", CONV_CASES)
def test_a_grouped_convolution_matches_torch_forward_and_backward(c_in, c_out, groups, kernel, stride, padding, side):
    # Prepare: torch's layer, its weight copied by state name; 20 samples (a chunk of 16 and one of 4)
    torch.manual_seed(0)
    ref = nn.Conv2d(c_in, c_out, kernel, stride, padding, groups=groups, bias=False)
    conv = Conv2d(c_in, c_out, kernel, stride, padding, groups=groups)
    net = Sequential([("conv", conv)])
    net.load(state_to_numpy(nn.Sequential(OrderedDict(conv=ref))))
    rng = np.random.default_rng(1)
    x = rng.standard_normal((20, c_in, side, side)).astype(np.float32)
    # Execute
    got = both_passes(ref, net, x, rng)
    # Assert: torch's weight shape, output, input and weight gradients
    assert conv.params["weight"].shape == tuple(ref.weight.shape) == (c_out, c_in // groups, kernel, kernel)
    assert got["out"].shape == got["out_t"].shape and got["out"].dtype == np.float32
    assert rel_err(got["out"], got["out_t"]) < GRAD_TOL
    assert rel_err(got["dx"], got["dx_t"]) < GRAD_TOL
    assert rel_err(conv.grads["weight"], ref.weight.grad.numpy()) < GRAD_TOL


def test_groups_that_do_not_divide_the_channels_are_refused():
    for c_in, c_out, groups in ((6, 8, 4), (8, 6, 4), (4, 4, 0)):
        with pytest.raises(ValueError, match="groups"):
            Conv2d(c_in, c_out, 3, groups=groups)


def test_relu6_matches_torch_at_and_around_0_and_6():
    # Values exactly at the kinks, one float32 step either side, far outside and between
    eps0, eps6 = np.float32(1e-45), np.spacing(np.float32(6))
    points = np.array([-100, -1, -eps0, 0, eps0, 1e-7, 0.5, 3, 6 - eps6, 6, 6 + eps6, 7, 1e6], np.float32)
    x = np.tile(points, (2, 3, 1, 1))
    rng = np.random.default_rng(2)
    upstream = rng.standard_normal(x.shape).astype(np.float32)
    xt = torch.from_numpy(x.copy()).requires_grad_()
    ref = nn.ReLU6()(xt)
    ref.backward(torch.from_numpy(upstream))
    layer = ReLU6()
    out = layer.forward(x.copy(), train=True)
    dx = layer.backward(upstream.copy())
    np.testing.assert_array_equal(out, ref.detach().numpy())
    np.testing.assert_array_equal(dx, xt.grad.numpy())
    assert (dx[..., [3, 9]] == 0).all() and (dx[..., [4, 8]] != 0).all()  # none at 0 and 6, some just inside


def _depthwise_pair(seed: int = 3) -> tuple[nn.Module, Sequential]:
    """conv-bn-relu6, a stride-2 depthwise conv-bn-relu6 and a 1x1 conv-bn, in torch and in numpy."""
    torch.manual_seed(seed)
    ref = nn.Sequential(nn.Conv2d(3, 8, 3, 1, 1, bias=False), nn.BatchNorm2d(8), nn.ReLU6(),
                        nn.Conv2d(8, 8, 3, 2, 1, groups=8, bias=False), nn.BatchNorm2d(8), nn.ReLU6(),
                        nn.Conv2d(8, 16, 1, bias=False), nn.BatchNorm2d(16))
    net = Sequential([(str(i), layer) for i, layer in enumerate([
        Conv2d(3, 8, 3, 1, 1), BatchNorm2d(8), ReLU6(), Conv2d(8, 8, 3, 2, 1, groups=8), BatchNorm2d(8), ReLU6(),
        Conv2d(8, 16, 1, 1, 0), BatchNorm2d(16)])])
    moved_norms(ref, seed)
    net.load(state_to_numpy(ref))
    return ref, net


def test_per_sample_gradients_of_a_depthwise_net_are_each_image_s_own():
    # Prepare: BatchNorm frozen (running statistics), as DP-SGD trains; torch runs each image alone
    from splitedge.methods.thin.per_sample import freeze_norms, per_sample_backward

    ref, net = _depthwise_pair()
    rng = np.random.default_rng(4)
    x = (rng.standard_normal((6, 3, 9, 9)) * 2).astype(np.float32)  # ReLU6 saturates somewhere
    upstream = rng.standard_normal((6, 16, 5, 5)).astype(np.float32)
    # Execute
    freeze_norms(net)
    net.forward(x.copy(), train=True)
    grads, dx = per_sample_backward(net, upstream.copy())
    ref.eval()
    expected: dict[str, list[np.ndarray]] = {}
    for i in range(len(x)):
        ref.zero_grad()
        ref(torch.from_numpy(x[i:i + 1])).backward(torch.from_numpy(upstream[i:i + 1]))
        for name, p in ref.named_parameters():
            expected.setdefault(name, []).append(p.grad.numpy().copy())
    # Assert: every parameter, every image; the depthwise weight's per-image shape is torch's
    assert set(grads) == set(expected)
    assert grads["3.weight"].shape == (6, 8, 1, 3, 3)
    for name, per_image in expected.items():
        for i, g in enumerate(per_image):
            assert rel_err(grads[name][i], g) < GRAD_TOL, (name, i)


def _tiny_torch_wc(tiny, channels: int, size: int) -> nn.Module:
    torch.manual_seed(0)
    return moved_norms(tiny[0].factory(num_classes=10, in_channels=channels, image_size=size).wc)


@pytest.mark.parametrize("channels,size", [(1, 8), (3, 16)])
def test_tiny_mobilenet_s_thin_wc_matches_torch_in_training_and_eval(tiny, channels, size):
    # Prepare
    wc = _tiny_torch_wc(tiny, channels, size).train()
    net = tiny[1].wc(channels)
    net.load(state_to_numpy(wc))
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((18, channels, size, size)) * 2).astype(np.float32)
    xt = torch.from_numpy(x).requires_grad_()
    # Execute
    out_t = wc(xt)
    upstream = rng.standard_normal(tuple(out_t.shape)).astype(np.float32)
    out_t.backward(torch.from_numpy(upstream))
    out = net.forward(x.copy(), train=True)
    dx = net.backward(upstream.copy())
    # Assert: output, input gradient, every parameter gradient, the state (names, order, buffers)
    assert rel_err(out, out_t.detach().numpy()) < GRAD_TOL
    assert rel_err(dx, xt.grad.numpy()) < GRAD_TOL
    torch_params = dict(wc.named_parameters())
    for name, layer, key in net.parameters():
        assert rel_err(layer.grads[key], torch_params[name].grad.numpy()) < GRAD_TOL, name
    state, ref = net.state(), state_to_numpy(wc)
    assert list(state) == list(ref)
    for name in ref:
        np.testing.assert_allclose(state[name], ref[name], rtol=1e-5, atol=1e-6, err_msg=name)
    wc.eval()
    with torch.no_grad():
        assert rel_err(net.forward(x.copy(), train=False), wc(torch.from_numpy(x)).numpy()) < GRAD_TOL


def test_tiny_mobilenet_s_graphs_load_the_torch_weights_and_refuse_a_dense_depthwise_weight(tiny):
    # The device's W_c and calibration trunk, built by name from the plug-in, against torch in eval mode
    from splitedge.methods.thin.graphs import calib_graph, thin_models, wc_graph
    from splitedge.protocol import ProtocolError

    torch.manual_seed(6)
    split = moved_norms(tiny[0].factory(num_classes=10, in_channels=1, image_size=8)).eval()
    trunk = ClassifierInput(split.we, split.wg)
    assert MODEL in thin_models()
    wc, cal = wc_graph(MODEL, 1), calib_graph(MODEL, 1, 8, 10)
    wc.load_weights(state_to_numpy(split.wc))
    cal.load_weights(state_to_numpy(trunk))
    x = np.random.default_rng(7).standard_normal((10, 1, 8, 8)).astype(np.float32)
    with torch.no_grad():
        h = split.wc(torch.from_numpy(x))
        e, f = trunk.stages(h)
    assert rel_err(wc.features(x), h.numpy()) < GRAD_TOL
    got_e, got_f = cal.stages(h.numpy())
    assert rel_err(got_e, e.numpy()) < GRAD_TOL and rel_err(got_f, f.numpy()) < GRAD_TOL
    # a map whose depthwise weight is a dense one ([64, 64, 3, 3]) is refused and the weights in use stay
    bad = state_to_numpy(split.wc)
    bad["block1.3.weight"] = np.zeros((64, 64, 3, 3), np.float32)
    before = wc.weights()
    shapes = r"block1\.3\.weight: shape \(64, 64, 3, 3\), the model has \(64, 1, 3, 3\)"
    with pytest.raises(ProtocolError, match=shapes):
        wc.load_weights(bad)
    for name, value in before.items():
        np.testing.assert_array_equal(wc.weights()[name], value)


def test_a_supcon_step_of_tiny_mobilenet_in_chunks_is_the_whole_batch_s(tiny):
    # Prepare: the thin trainer of the plug-in model, whole batch and in chunks of 7 of 40 views
    from splitedge.methods.thin.trainer import SupConTrainer

    weights = state_to_numpy(_tiny_torch_wc(tiny, 3, 16))
    trainers = {chunk: SupConTrainer(MODEL, 3, proj_dim=16, lr=0.05, tau=0.5, seed=0, chunk=chunk) for chunk in (0, 7)}
    views = np.random.default_rng(8).standard_normal((40, 3, 16, 16)).astype(np.float32)
    losses = {}
    for chunk, trainer in trainers.items():
        trainer.load(weights)
        # Execute
        losses[chunk] = trainer.step_views(views.copy(), np.arange(40) % 5)["total"]
    # Assert: the same loss, every gradient, and the weights after the step
    assert losses[7] == pytest.approx(losses[0], rel=1e-6)
    for (name, layer, key), (_, twin, _) in zip(trainers[0].wc.parameters(), trainers[7].wc.parameters()):
        assert rel_err(twin.grads[key], layer.grads[key]) < GRAD_TOL, name
    for name, value in trainers[0].wc.state().items():
        assert rel_err(trainers[7].wc.state()[name], value) < 1e-5, name


def test_a_chunked_step_whose_first_convolution_is_grouped_gives_the_whole_batch_gradients():
    # The first block's weight gradient comes from sums gathered per chunk; a grouped first
    # convolution sees each group's own windows (chunked._first_products)
    from splitedge.methods.thin.chunked import ChunkedStep
    from splitedge.methods.thin.layers import global_avg_pool, global_avg_pool_backward

    def net() -> Sequential:
        return Sequential([("0", Conv2d(4, 8, 3, 1, 1, groups=2)), ("1", BatchNorm2d(8)), ("2", ReLU6()),
                           ("3", Conv2d(8, 8, 3, 2, 1, groups=8)), ("4", BatchNorm2d(8)), ("5", ReLU6())])

    weights = state_to_numpy(moved_norms(nn.Sequential(
        nn.Conv2d(4, 8, 3, 1, 1, groups=2, bias=False), nn.BatchNorm2d(8), nn.ReLU6(),
        nn.Conv2d(8, 8, 3, 2, 1, groups=8, bias=False), nn.BatchNorm2d(8), nn.ReLU6())))
    whole, chunked = net(), net()
    whole.load(weights)
    chunked.load(weights)
    rng = np.random.default_rng(9)
    x = rng.standard_normal((21, 4, 10, 10)).astype(np.float32)
    grad = rng.standard_normal((21, 8)).astype(np.float32)
    fmap = whole.forward(x.copy(), train=True)
    whole.backward(global_avg_pool_backward(grad, fmap.shape))
    step = ChunkedStep(chunked, 4)
    pooled, shape = step.forward(x, global_avg_pool)
    step.backward(x, grad, global_avg_pool_backward, shape)
    assert rel_err(pooled, global_avg_pool(fmap)) < 1e-5
    for (name, layer, key), (_, twin, _) in zip(whole.parameters(), chunked.parameters()):
        assert rel_err(twin.grads[key], layer.grads[key]) < GRAD_TOL, name


def test_a_depthwise_layer_unfolds_no_windows():
    # The windows of one chunk of 16 (64 channels, 3x3, 32x32) are 37.7 MB: the layer's whole
    # forward and backward over 64 samples must stay under them beyond its output and input gradient
    import tracemalloc

    conv = Conv2d(64, 64, 3, 1, 1, groups=64)
    conv.params["weight"] = np.random.default_rng(10).standard_normal((64, 1, 3, 3)).astype(np.float32)
    x = np.random.default_rng(11).standard_normal((64, 64, 32, 32)).astype(np.float32)
    windows = 16 * 64 * 9 * 32 * 32 * 4
    tracemalloc.start()
    out = conv.forward(x, train=True)
    forward_peak = tracemalloc.get_traced_memory()[1] - out.nbytes
    tracemalloc.reset_peak()
    dx = conv.backward(out)
    backward_peak = tracemalloc.get_traced_memory()[1] - out.nbytes - dx.nbytes
    tracemalloc.stop()
    assert forward_peak < windows / 3 and backward_peak < windows / 3, (forward_peak, backward_peak)


NO_TORCH = ("import os\nwith open(os.environ['SPLITEDGE_TEST_TORCH_TRIED'], 'a') as f:\n    f.write(str(os.getpid()))\n"
            "raise ModuleNotFoundError(\"No module named 'torch'\", name='torch')\n")
"""A torch package that is not there: a process that has it first on its path cannot import torch,
and leaves its pid in a file if it tried."""


def _observe(url: str, run: str):
    """(observer, the W_c weight maps edges sent down, those devices sent up: (sender, weights))."""
    from splitedge.protocol.mqtt import MqttTransport
    from splitedge.protocol.topics import pattern

    down, up, lock = [], [], threading.Lock()

    def record(into: list):
        def on(topic, env) -> None:
            if env.kind == "weights" and env.body.get("part") == "wc":
                with lock:
                    into.append((env.sender, env.body["weights"]))
        return on

    observer = MqttTransport(url, client_id="observer-thin-grouped", role="observer")
    observer.subscribe(pattern(run, "edge", "+", "down", "#"), record(down))
    observer.subscribe(pattern(run, "device", "+", "up", "weights"), record(up))
    return observer, down, up


def _no_torch_env(tmp_path: Path, monkeypatch) -> tuple[dict[str, str], Path, Path]:
    """Every node finds the plug-in models; the thin device's environment also puts the absent
    torch first on its path. (That environment, the file it leaves if it tries torch, the file
    it leaves if it imports the torch model tiny_mobilenet.py.)"""
    blocker = tmp_path / "no-torch" / "torch"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text(NO_TORCH)
    tried, imported = tmp_path / "torch-tried", tmp_path / "torch-model-imported"
    path = os.pathsep.join(p for p in (str(MODELS), os.environ.get("PYTHONPATH", "")) if p)
    monkeypatch.setenv("PYTHONPATH", path)
    env = {"PYTHONPATH": f"{blocker.parent}{os.pathsep}{path}", "SPLITEDGE_TEST_TORCH_TRIED": str(tried),
           "SPLITEDGE_TEST_IMPORTED": str(imported)}
    return env, tried, imported


@pytest.mark.usefixtures("mosquitto_binary")
def test_a_thin_device_without_torch_trains_tiny_mobilenet_for_a_round_of_a_real_federation(tmp_path, monkeypatch):
    """Cloud, edge and a torch device run tiny_mobilenet:factory; d0 runs `--backend onnx --plugin
    tiny_mobilenet_thin:THIN` with no torch it could import, trains the depthwise W_c and sends it up."""
    from federation import Federation
    from splitedge.protocol.broker import MosquittoBroker

    thin_env, tried, imported = _no_torch_env(tmp_path, monkeypatch)
    with MosquittoBroker() as broker:
        observer, down, up = _observe(broker.url, "itest")
        fed = Federation(tmp_path, broker.url, edges=1, devices=2, rounds=1,
                         extra=["--method", "hsfp-cal", "--model", MODEL, "--plugin", MODEL, "--set", "ic=1",
                                "--deadline", "120", "--join-timeout", "60"],
                         edge_extra=("--plugin", MODEL),
                         node_extra={"d0": ["--backend", "onnx", "--plugin", "tiny_mobilenet_thin:THIN"],
                                     "d1": ["--plugin", MODEL]},
                         node_env={"d0": thin_env})
        try:
            assert fed.procs["cloud"].wait(240) == 0, fed.logs()
            fed.wait(30)
        finally:
            fed.close()
            observer.close()
    assert [p.returncode for p in fed.procs.values()] == [0, 0, 0, 0], fed.logs()
    assert not tried.exists() and not imported.exists(), fed.log("d0")  # neither torch nor the torch model
    assert "backend onnx" in fed.log("d0") and "Traceback" not in fed.log("d0"), fed.log("d0")
    metrics = fed.metrics()
    assert len(metrics) == 1 and np.isfinite(metrics[0]["accuracy"]), metrics
    sent = [w for sender, w in up if sender == "d0"]
    assert len(sent) == 1 and down, (len(sent), len(down))
    start, trained = down[0][1], sent[0]
    assert set(trained) == set(start) and trained["block1.3.weight"].shape == (64, 1, 3, 3)
    assert all(np.isfinite(v).all() for v in trained.values())
    assert not np.allclose(trained["block1.3.weight"], start["block1.3.weight"])  # the depthwise layer trained
    assert int(trained["block1.4.num_batches_tracked"]) > int(start["block1.4.num_batches_tracked"])
