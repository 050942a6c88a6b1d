"""ONNX export of W_c and the global model: names, dynamic batch, parity, fp16/int8 variants, CLI."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
import torch

from splitedge.exporters.onnx_export import ParityError, export_module, max_abs_diff, run_onnx, run_torch
from splitedge.exporters.suite import export_split
from splitedge.exporters.variants import to_fp16, to_int8
from splitedge.methods.data.datasets import load_dataset
from splitedge.methods.data.preprocess import to_input
from splitedge.models import create_split, state_to_numpy


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def randomise_bn(module: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Non-trivial BN statistics, so a folded or mis-named BN would show in parity."""
    gen = torch.Generator().manual_seed(seed)
    for m in module.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            m.running_mean.copy_(torch.randn(m.num_features, generator=gen) * 0.1)
            m.running_var.copy_(torch.rand(m.num_features, generator=gen) + 0.5)
            m.weight.data.copy_(torch.rand(m.num_features, generator=gen) + 0.5)
    return module.eval()


@pytest.fixture(scope="module")
def digits():
    train, test, info = load_dataset("digits")
    return to_input(test[0][:200], info.mean, info.std), to_input(train[0][:64], info.mean, info.std)


@pytest.fixture(scope="module")
def cnn():
    torch.manual_seed(0)
    return randomise_bn(create_split("cnn", num_classes=10, in_channels=1, image_size=8))


@pytest.fixture(scope="module")
def resnet():
    torch.manual_seed(1)
    return randomise_bn(create_split("resnet18", num_classes=10, in_channels=3, image_size=32))


@pytest.fixture(scope="module")
def cifar_like():
    return np.random.default_rng(0).standard_normal((16, 3, 32, 32)).astype(np.float32)


def test_initializers_keep_state_dict_names_and_bn_nodes(cnn):
    # Execute: fresh BN layers share values, which the exporter de-duplicates behind Identity
    fresh = create_split("cnn", num_classes=10, in_channels=1, image_size=8)
    model = export_module(fresh.wc, (1, 8, 8))
    # Assert
    state = fresh.wc.state_dict()
    inits = {i.name for i in model.graph.initializer}
    assert inits == {k for k in state if not k.endswith("num_batches_tracked")}
    assert [n.op_type for n in model.graph.node].count("BatchNormalization") == 2
    assert "Identity" not in {n.op_type for n in model.graph.node}
    meta = {p.key: p.value for p in model.metadata_props}
    assert json.loads(meta["splitedge.unused_state"]) == sorted(k for k in state if k.endswith("num_batches_tracked"))


@pytest.mark.parametrize("graph", ["wc", "model"])
def test_cnn_digits_parity_and_dynamic_batch(cnn, digits, graph):
    # Prepare
    x, _ = digits
    module = cnn.wc if graph == "wc" else cnn
    # Execute
    model = export_module(module, (1, 8, 8), part=graph)
    diff = max_abs_diff(model, module, x)
    # Assert
    assert diff < 1e-4
    for batch in (1, 7):
        assert run_onnx(model, x[:batch]).shape == run_torch(module, x[:batch]).shape


@pytest.mark.parametrize("graph", ["wc", "model"])
def test_resnet18_cifar_shape_parity_and_dynamic_batch(resnet, cifar_like, graph):
    module = resnet.wc if graph == "wc" else resnet
    model = export_module(module, (3, 32, 32), part=graph)
    assert max_abs_diff(model, module, cifar_like) < 1e-4
    for batch in (1, 7):
        assert run_onnx(model, cifar_like[:batch]).shape[0] == batch


def test_parity_failure_raises(cnn, digits):
    # Prepare: a graph whose first conv weight no longer matches torch
    model = export_module(cnn.wc, (1, 8, 8))
    init = next(i for i in model.graph.initializer if i.name == "block1.conv.weight")
    init.CopyFrom(onnx.numpy_helper.from_array(onnx.numpy_helper.to_array(init) * 1.5, init.name))
    # Execute / Assert
    with pytest.raises(ParityError):
        max_abs_diff(model, cnn.wc, digits[0])


def test_cnn_variants_report_size_and_parity(cnn, digits, tmp_path):
    # Execute
    rows = export_split(cnn, digits[0], tmp_path, fp16=True, int8=True, calibration=digits[1])
    # Assert
    by = {(r.graph, r.variant): r for r in rows}
    assert set(by) == {(g, v) for g in ("wc", "model") for v in ("fp32", "fp16", "int8")}
    for graph in ("wc", "model"):
        assert by[(graph, "fp32")].max_abs_diff < 1e-4
        assert by[(graph, "fp16")].bytes < 0.6 * by[(graph, "fp32")].bytes
        assert by[(graph, "int8")].bytes < by[(graph, "fp16")].bytes
        assert by[(graph, "fp16")].rel_diff < 2e-2 and by[(graph, "int8")].rel_diff < 0.25
    assert by[("model", "int8")].top1_agreement >= 0.9
    assert all((tmp_path / f"{n}.onnx").exists() for n in ("wc", "wc.fp16", "wc.int8", "model", "model.int8"))


def test_resnet18_wc_fp16_and_int8(resnet, cifar_like):
    base = export_module(resnet.wc, (3, 32, 32))
    ref = run_torch(resnet.wc, cifar_like)
    scale = float(np.abs(ref).max())
    fp16 = to_fp16(base)
    assert {i.name for i in fp16.graph.initializer} == {i.name for i in base.graph.initializer}
    assert max_abs_diff(fp16, resnet.wc, cifar_like, tol=None, reference=ref) < 1e-2 * scale
    assert max_abs_diff(to_int8(base, cifar_like), resnet.wc, cifar_like, tol=None, reference=ref) < 0.1 * scale


def test_export_cli_from_checkpoint(cnn, tmp_path, capsys):
    # Prepare: a cloud checkpoint as the coordinator writes it (0-d counters saved as (1,))
    from safetensors.numpy import save_file

    from splitedge.cli import main

    state = {k: np.ascontiguousarray(v) for k, v in state_to_numpy(cnn).items()}
    save_file(state, str(tmp_path / "model.safetensors"))
    # Execute
    code = main(["export", "--checkpoint", str(tmp_path / "model.safetensors"), "--dataset", "digits",
                 "--out", str(tmp_path / "onnx"), "--fp16", "--samples", "64"])
    # Assert
    out = capsys.readouterr().out
    report = json.loads(out.strip().splitlines()[-1])
    assert code == 0 and report["model"] == "cnn" and "| wc | fp16 |" in out
    assert {(v["graph"], v["variant"]) for v in report["variants"]} == {
        ("wc", "fp32"), ("wc", "fp16"), ("model", "fp32"), ("model", "fp16")}
    assert all(v["max_abs_diff"] < 1e-4 for v in report["variants"] if v["variant"] == "fp32")


def test_top1_agreement_counts_only_what_torch_decides() -> None:
    """A near-tie flipped by a difference the export is allowed is no disagreement; a decided
    sample flipped is."""
    import numpy as np

    from splitedge.exporters.suite import top1_agreement

    ref = np.array([[1.0, 0.0], [0.5, 0.5 + 1e-7], [0.0, 2.0]], np.float32)
    tie_flipped = np.array([[1.0, 0.0], [0.5 + 1e-7, 0.5], [0.0, 2.0]], np.float32)
    assert top1_agreement(tie_flipped, ref, diff=1e-6) == 1.0
    decided_flipped = np.array([[0.0, 1.0], [0.5, 0.5], [0.0, 2.0]], np.float32)
    assert top1_agreement(decided_flipped, ref, diff=1e-6) == 0.5
