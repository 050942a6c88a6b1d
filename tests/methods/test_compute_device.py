"""`--device auto|cpu|cuda` (methods/compute.py): resolved once at a node's start, refused in one
line where torch sees no GPU or the method is not ported to one, and on a CPU-only box `auto` is
exactly the CPU run. The GPU branches are tested by making torch report a GPU (no CUDA tensor is
faked); the one test that trains on a real GPU skips where there is none."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch

from parts import cloud_ctx, edge_ctx
from splitedge.methods import compute
from splitedge.methods.compute import CPU, Compute, resolve
from splitedge.methods.contract import Unsupported

NO_GPU = not torch.cuda.is_available()


@pytest.fixture
def one_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch reports one CUDA device (only what resolve asks; nothing runs on it)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)


@pytest.fixture
def no_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_auto_and_cpu_are_the_cpu_without_a_gpu(no_gpu: None) -> None:
    assert resolve("auto") == CPU and resolve("cpu") == CPU


def test_auto_finds_the_gpu_and_cuda_names_it(one_gpu: None) -> None:
    assert resolve("auto") == Compute("cuda", asked=False)
    assert resolve("cuda") == Compute("cuda", asked=True)
    assert resolve("cuda:0") == Compute("cuda:0", asked=True)
    assert resolve("cpu") == CPU


@pytest.mark.parametrize("request_, says", [
    ("cuda", "--device cuda: torch sees no CUDA device (a CPU-only torch, or no driver); use --device cpu or auto"),
    ("cuda:1", "--device cuda:1: torch sees no CUDA device"),
    ("gpu", "--device takes auto, cpu, cuda or cuda:N, got 'gpu'"),
])
def test_a_gpu_torch_cannot_see_is_one_line_naming_the_fix(no_gpu: None, request_: str, says: str) -> None:
    with pytest.raises(ValueError) as exc:
        resolve(request_)
    assert str(exc.value).startswith(says) and "\n" not in str(exc.value)


def test_a_gpu_index_past_those_torch_sees_is_refused(one_gpu: None) -> None:
    with pytest.raises(ValueError, match=r"--device cuda:1: torch sees 1 CUDA device \(cuda:0\)"):
        resolve("cuda:1")


def test_a_method_not_ported_refuses_a_named_gpu_and_leaves_a_found_one_unused(caplog, monkeypatch) -> None:
    monkeypatch.setattr(compute, "_said", set())
    # Execute / Assert: a ported method keeps the GPU; one not ported refuses the named GPU in one line
    assert Compute("cuda", asked=True).for_method("fedavg", True) == Compute("cuda", asked=True)
    with pytest.raises(ValueError, match=r"^method hsfp runs on the CPU only so far; use --device cpu or auto$"):
        Compute("cuda", asked=True).for_method("hsfp", False)
    # ... and with auto computes on the CPU, said once however many parts are built
    with caplog.at_level(logging.WARNING, logger="splitedge.methods.compute"):
        assert [Compute("cuda").for_method("hsfp", False) for _ in range(3)] == [CPU] * 3
    assert sum("hsfp runs on the CPU only so far" in r.getMessage() for r in caplog.records) == 1


def test_parts_get_their_device_through_the_context() -> None:
    """The method's parts builder narrows the node's device for a method not ported (its parts then
    compute on the CPU), refuses a named GPU for it (the node leaves: Unsupported), and hands a
    ported method's parts the node's device as `Part.device`."""
    ctx = edge_ctx("hsfp")
    ctx.compute = Compute("cuda", asked=False)
    assert ctx.method.edge_part(ctx).device == "cpu"
    ctx = edge_ctx("hsfp")
    ctx.compute = Compute("cuda", asked=True)
    with pytest.raises(Unsupported, match="method hsfp runs on the CPU only so far"):
        ctx.method.edge_part(ctx)
    ctx = edge_ctx("fedavg")
    ctx.compute = Compute("cuda:1", asked=True)
    assert ctx.method.edge_part(ctx).device == "cuda:1"  # FedAvg's edge only averages numpy maps
    assert cloud_ctx("fedavg").method.cloud_part(cloud_ctx("fedavg")).device == "cpu"  # the default context


@pytest.mark.parametrize("method", ["fedavg", "fedprox", "scaffold", "fedadam", "fedavgm", "fedyogi"])
def test_the_fedavg_family_is_ported(method: str) -> None:
    from splitedge.methods.registry import get_method

    assert get_method(method).runs_on_cuda


@pytest.mark.skipif(not NO_GPU, reason="refuses only where torch sees no GPU")
def test_sim_device_cuda_without_a_gpu_is_one_line_before_any_work(tmp_path: Path, capsys) -> None:
    from splitedge.cli import main

    out = tmp_path / "run"
    code = main(["sim", "--method", "fedavg", "--device", "cuda", "--out", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err == ["splitedge sim: error: --device cuda: torch sees no CUDA device (a CPU-only torch, "
                                 "or no driver); use --device cpu or auto"]
    assert not out.exists()  # nothing started: no run folder claimed


def test_sim_device_cuda_for_a_method_not_ported_is_one_line_before_any_work(one_gpu: None, tmp_path: Path,
                                                                               capsys) -> None:
    from splitedge.cli import main

    out = tmp_path / "run"
    code = main(["sim", "--method", "hsfp", "--device", "cuda", "--out", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err == ["splitedge sim: error: method hsfp runs on the CPU only so far; use --device cpu "
                                 "or auto"]
    assert not out.exists()


@pytest.mark.skipif(not NO_GPU, reason="auto picks the GPU here: the equality holds on a CPU-only box")
def test_fedavg_on_cpu_is_the_default_run_bit_for_bit(tmp_path: Path) -> None:
    from splitedge.sim import SimSettings, run_sim

    common = dict(rounds=2, devices=4, edges=2, method="fedavg", alpha=0.5, seed=5, max_train=400, max_test=200)
    default = run_sim(SimSettings(**common, out=tmp_path / "default"))
    cpu = run_sim(SimSettings(**common, device="cpu", out=tmp_path / "cpu"))
    assert default["closed_on_quorum"] and cpu["closed_on_quorum"]
    assert default["accuracy_per_round"] == cpu["accuracy_per_round"]
    served = [(tmp_path / name / "model.safetensors").read_bytes() for name in ("default", "cpu")]
    assert served[0] == served[1]


@pytest.mark.skipif(NO_GPU, reason="no CUDA device: torch sees no GPU on this machine, so the FedAvg run on cuda "
                                   "is skipped (the CPU paths above cover the mechanism)")
def test_fedavg_learns_on_cuda(tmp_path: Path) -> None:
    from splitedge.sim import SimSettings, run_sim

    summary = run_sim(SimSettings(rounds=3, devices=4, edges=2, method="fedavg", seed=0, device="cuda",
                                  out=tmp_path / "cuda"))
    assert summary["status"] == "complete"
    assert summary["final_accuracy"] > 0.5  # digits, 10 classes: chance is 0.1
    assert np.isfinite(summary["accuracy_per_round"]).all()
