"""Contract tests generated from the model registry: a new model is covered automatically."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from splitedge.models import (PART_NAMES, create_split, list_models, load_numpy_state, pool,
                    state_to_numpy)

CONFIGS = {"digits": (1, 8), "cifar": (3, 32)}


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def built() -> dict:
    """Build each (model, config) once; resnet18 construction dominates test time."""
    torch.manual_seed(0)
    return {(name, cfg): create_split(name, num_classes=10, in_channels=c, image_size=s)
            for name in list_models() for cfg, (c, s) in CONFIGS.items()}


def test_builtin_models_registered():
    assert {"cnn", "resnet18"} <= set(list_models())


@pytest.mark.parametrize("cfg", sorted(CONFIGS))
@pytest.mark.parametrize("name", list_models())
def test_forward_shapes_and_assembly(built, name, cfg):
    model = built[(name, cfg)].eval()
    c, s = CONFIGS[cfg]
    x = torch.randn(3, c, s, s)
    with torch.no_grad():
        hc = model.wc(x)
        he = model.we(hc)
        out = model.wg(he)
        full = model(x)
    assert tuple(hc.shape) == (3, *model.wc_shape)
    assert tuple(he.shape) == (3, *model.we_shape)
    assert tuple(out.shape) == (3, 10)
    assert torch.equal(full, out)
    assert pool(hc).shape == (3, model.wc_shape[0])


@pytest.mark.parametrize("name", list_models())
def test_train_step_has_gradients_in_every_part(built, name):
    model = built[(name, "digits")].train()
    x, y = torch.randn(4, 1, 8, 8), torch.tensor([0, 1, 2, 3])
    torch.nn.functional.cross_entropy(model(x), y).backward()
    for part in PART_NAMES:
        grads = [p.grad for p in model.part(part).parameters()]
        assert grads and all(g is not None and torch.isfinite(g).all() for g in grads)
    model.zero_grad(set_to_none=True)


@pytest.mark.parametrize("name", list_models())
def test_state_round_trip(built, name):
    src = built[(name, "digits")]
    weights = state_to_numpy(src)
    assert list(weights) == list(src.state_dict())
    assert all(w.dtype in (np.float32, np.int64) for w in weights.values())
    torch.manual_seed(1)
    dst = create_split(name, num_classes=10, in_channels=1, image_size=8)
    load_numpy_state(dst, {k: _read_only(v) for k, v in weights.items()})
    for key, value in state_to_numpy(dst).items():
        np.testing.assert_array_equal(value, weights[key])


def _read_only(a: np.ndarray) -> np.ndarray:
    """Like decoded wire arrays, which are read-only views."""
    a = a.copy()
    a.flags.writeable = False
    return a


def test_load_rejects_missing_unexpected_and_bad_shape(built):
    model = built[("cnn", "digits")]
    good = state_to_numpy(model)
    name = "wg.fc.weight"
    missing = {k: v for k, v in good.items() if k != name}
    with pytest.raises(ValueError, match=name):
        load_numpy_state(model, missing)
    with pytest.raises(ValueError, match="extra.weight"):
        load_numpy_state(model, {**good, "extra.weight": np.zeros(1, np.float32)})
    with pytest.raises(ValueError, match=name):
        load_numpy_state(model, {**good, name: np.zeros((3, 3), np.float32)})


def test_load_of_a_part_only(built):
    """Parts are sent separately (`weights` part="wc"), so they load on their own."""
    model = built[("cnn", "cifar")]
    part = state_to_numpy(model.wc)
    assert all(not k.startswith("wc.") for k in part)
    load_numpy_state(model.wc, part)


def test_resnet_split_points_configurable():
    torch.manual_seed(0)
    model = create_split("resnet18", num_classes=10, in_channels=1, image_size=8,
                         split=("layer2", "layer4"))
    assert model.wc_shape == (128, 4, 4) and model.we_shape == (512, 1, 1)
    with pytest.raises(ValueError):
        create_split("resnet18", num_classes=10, in_channels=1, image_size=8,
                     split=("layer3", "layer1"))


def test_unknown_model_raises():
    with pytest.raises(ValueError, match="unknown model"):
        create_split("nope", num_classes=10, in_channels=1, image_size=8)


def test_fedcnn_is_pi_class_with_a_thin_wc():
    """Issue 12's network: 0.5-1 M parameters in all, W_c a tiny share, the cnn's W_c output size."""
    torch.manual_seed(0)
    model = create_split("fedcnn", num_classes=10, in_channels=3, image_size=32)
    total = sum(p.numel() for p in model.parameters())
    wc = sum(p.numel() for p in model.wc.parameters())
    assert 500_000 <= total <= 1_000_000
    assert wc < 2_000
    assert model.wc_shape == (32, 16, 16) and model.we_shape == (128, 4, 4)
    with pytest.raises(ValueError, match="multiple of 8"):
        create_split("fedcnn", num_classes=10, in_channels=3, image_size=28)


@pytest.mark.parametrize("cfg", sorted(CONFIGS))
def test_fedcnn_wc_exports_to_onnx_with_dynamic_batch(cfg):
    """Thin devices run W_c through onnxruntime: the TorchScript export (dynamo=False, dynamic
    batch) must keep state-dict names and reproduce torch at any batch size."""
    from splitedge.exporters.onnx_export import export_module, max_abs_diff, run_onnx

    c, s = CONFIGS[cfg]
    torch.manual_seed(0)
    model = create_split("fedcnn", num_classes=10, in_channels=c, image_size=s)
    for m in model.wc.modules():  # non-trivial BN statistics, so a folded or misnamed BN would show
        if isinstance(m, torch.nn.BatchNorm2d):
            m.running_mean.uniform_(-0.1, 0.1)
            m.running_var.uniform_(0.5, 1.5)
    graph = export_module(model.wc, (c, s, s))
    assert {i.name for i in graph.graph.initializer} >= set(model.wc.state_dict()) - {
        n for n in model.wc.state_dict() if n.endswith("num_batches_tracked")}
    x = np.random.default_rng(0).standard_normal((5, c, s, s)).astype(np.float32)
    assert max_abs_diff(graph, model.wc, x) < 1e-4
    for batch in (1, 3):
        assert run_onnx(graph, x[:batch]).shape == (batch, *model.wc_shape)


@pytest.mark.parametrize("name", ["cnn", "fedcnn"])
def test_pre_activation_shares_weights_and_stops_before_the_final_relu(built, name):
    """H-SFP's pre_relu: the part without its final ReLU, same parameters and state names, so
    relu(pre(x)) is the part's output (a ReLU before a max-pool commutes with it)."""
    from splitedge.models import pre_activation

    model = built[(name, "cifar")].eval()
    x = torch.randn(4, 3, 32, 32)
    for part in (model.wc, model.we):
        pre = pre_activation(part)
        inp = x if part is model.wc else model.wc(x)
        with torch.no_grad():
            raw, out = pre(inp), part(inp)
        assert (raw < 0).any() and torch.allclose(torch.relu(raw), out)
        assert list(pre.state_dict()) == list(part.state_dict())
        assert all(a is b for a, b in zip(pre.parameters(), part.parameters()))
    with torch.no_grad():  # weights loaded into the part reach its pre-activation view
        next(model.wc.parameters()).mul_(2.0)
        assert torch.allclose(torch.relu(pre_activation(model.wc)(x)), model.wc(x))


def test_pre_activation_refuses_parts_whose_relu_is_inside_forward(built):
    from splitedge.models import pre_activation

    with pytest.raises(ValueError, match="does not end in an nn.ReLU"):
        pre_activation(built[("resnet18", "cifar")].wc)
    with pytest.raises(ValueError):
        pre_activation(built[("cnn", "cifar")].wg)  # ends in its classifier
