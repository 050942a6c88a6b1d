"""Sample-level DP (issue 53, item 3a): DP-SGD on the torch device and in the thin numpy trainer.

Per-sample clipping is the loop of single-image gradients clipped; removing one image moves a
step's noiseless sum by at most the clip; the accountant's epsilon is dp-accounting's for the
same (q, sigma, steps, delta) composed with the other releases; combinations whose releases have
no bounded sensitivity at one image are refused in one line before any work; a digits federation
with DP-SGD runs end to end and reports its epsilon."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from splitedge.methods.config import ModelSpec
from splitedge.methods.contract import DeviceContext
from splitedge.methods.privacy.accountant import run_epsilon, sigma_for_epsilon
from splitedge.methods.privacy.dpsgd import clip_per_sample, steps
from splitedge.methods.privacy.dpsgd_torch import clipped_sum, per_sample_grads
from splitedge.methods.registry import create_method, default_config
from splitedge.methods.thin.layers import BatchNorm2d
from splitedge.methods.thin.losses import etf_cross_entropy
from splitedge.methods.thin.layers import global_avg_pool, global_avg_pool_backward
from splitedge.methods.thin.per_sample import freeze_norms
from splitedge.methods.thin.trainer import SupConTrainer
from splitedge.methods.thin.augment import two_views

SAMPLE = {"dp_sigma": 1.0, "dp_unit": "sample", "dp_sample_rate": 0.25, "dp_grad_clip": 0.5}


def _torch_part(method: str, n: int = 10, **extra):
    """A torch device part of `method` under DP-SGD holding `n` random digit-sized images."""
    m = create_method(method, default_config(method, ModelSpec(), **{**SAMPLE, **extra}))
    rng = np.random.default_rng(0)
    data = (rng.integers(0, 256, (n, 8, 8, 1)).astype(np.uint8), np.arange(n) % 10)
    part = m.device_part(DeviceContext("d0", m, rng), data, "torch")
    part.model.eval()  # BatchNorm frozen, as DP-SGD trains
    return part


def _loop_clipped(part, idx, clip: float, loss_of=None) -> dict[str, torch.Tensor]:
    """The oracle: each image's own gradient by autograd, one at a time, clipped, summed."""
    out: dict[str, torch.Tensor] = {}
    loss_of = loss_of or part.sample_loss
    for i in idx:
        part.model.zero_grad()
        loss, _ = loss_of(part.x[i:i + 1], part.y[i:i + 1])
        loss.backward()
        grads = {k: p.grad.double().clone() for k, p in part.model.named_parameters()}
        norm = math.sqrt(sum(float(g.pow(2).sum()) for g in grads.values()))
        for k, g in grads.items():
            out[k] = out.get(k, 0) + g * min(1.0, clip / norm)
    return out


@pytest.mark.parametrize("method", ["fedavg", "fedprox"])
def test_torch_per_sample_clipping_is_the_loop_of_single_images_clipped(method: str) -> None:
    part = _torch_part(method, **({"mu": 1.0} if method == "fedprox" else {}))
    if method == "fedprox":  # the proximal term reads the parameters functional_call swaps in
        part.anchor = [p.detach().clone() + 0.05 for p in part.model.parameters()]
    grads, _ = per_sample_grads(part.model, part.sample_loss, part.x, part.y)
    got = clipped_sum(grads, 0.5)
    want = _loop_clipped(part, range(len(part.y)), 0.5)
    norms = torch.sqrt(sum(g.double().reshape(len(part.y), -1).pow(2).sum(1) for g in grads.values()))
    assert (norms > 0.5).sum() >= 3  # the clip binds, so the test would see a wrong scale
    for k in want:
        assert torch.allclose(got[k], want[k], rtol=1e-4, atol=1e-6), k


def test_fedproto_s_per_sample_clipping_is_the_loop_of_single_images_clipped() -> None:
    # FedProto's loss reads its image's own class prototype: a per-image loss, so DP-SGD applies,
    # and its prototypes, of the model DP-SGD trained, compose with its steps (docs/privacy.md)
    part = _torch_part("fedproto", n=12, dp_clip=1.0)
    rng = torch.Generator().manual_seed(0)
    extra = {"protos": torch.randn(10, part.dim, generator=rng), "has_proto": torch.arange(10) % 3 != 0}
    loss_of = lambda x, y: part.sample_loss(x, y, extra)  # noqa: E731
    grads, terms = per_sample_grads(part.model, loss_of, part.x, part.y)
    assert float(terms["proto"].abs().sum()) > 0  # the prototype term is on
    got, want = clipped_sum(grads, 0.5), _loop_clipped(part, range(len(part.y)), 0.5, loss_of)
    for k in want:
        assert torch.allclose(got[k], want[k], rtol=1e-4, atol=1e-6), k


def test_removing_one_image_moves_the_noiseless_sum_by_at_most_the_clip() -> None:
    part = _torch_part("fedavg", n=12)
    clip = 0.5
    full = clipped_sum(per_sample_grads(part.model, part.sample_loss, part.x, part.y)[0], clip)
    for drop in (0, 7):
        keep = [i for i in range(len(part.y)) if i != drop]
        less = clipped_sum(per_sample_grads(part.model, part.sample_loss, part.x[keep], part.y[keep])[0], clip)
        moved = math.sqrt(sum(float((full[k] - less[k]).pow(2).sum()) for k in full))
        assert moved <= clip * (1 + 1e-6) and moved > 0.9 * clip, moved  # the clip binds on every image here


def _thin_trainer() -> SupConTrainer:
    """The thin cnn W_c with random weights and BatchNorm statistics, trained toward the ETF."""
    t = SupConTrainer("cnn", 1, proj_dim=8, lr=0.05, tau=0.1, seed=0, target="etf", classes=10, etf_seed=0)
    rng = np.random.default_rng(3)
    state = t.wc.state()
    t.load({k: (rng.normal(0, 0.3, v.shape).astype(v.dtype) if k.endswith("weight") else
                np.abs(rng.normal(1, 0.2, v.shape)).astype(v.dtype) if k.endswith("running_var") else
                rng.normal(0, 0.1, v.shape).astype(v.dtype) if v.dtype.kind == "f" else v)
            for k, v in state.items()})
    return t


def _thin_loop(t: SupConTrainer, views: np.ndarray, y: np.ndarray) -> list[dict[str, np.ndarray]]:
    """The oracle: for each image, the ordinary (batched) backward of its two views alone."""
    b, out = len(y), []
    for i in range(b):
        pair = np.ascontiguousarray(views[[i, b + i]])
        fmap = t.wc.forward(pair, train=True)
        _, dpooled = etf_cross_entropy(global_avg_pool(fmap), np.array([y[i], y[i]]), t.etf, t.etf_tau)
        t.opt.zero_grad()
        t.wc.backward(global_avg_pool_backward(dpooled, fmap.shape))
        out.append({name: layer.grads[key].astype(np.float64) for name, layer, key in t.opt.params})
    return out


def test_numpy_per_sample_clipping_is_the_loop_of_single_images_clipped() -> None:
    t = _thin_trainer()
    x = np.random.default_rng(1).normal(0, 1, (6, 1, 8, 8)).astype(np.float32)
    y = np.array([0, 1, 2, 3, 4, 5])
    freeze_norms(t.wc)
    running = {k: v.copy() for k, v in t.wc.state().items() if "running" in k}
    grads, _ = t.sample_grads(x, y, np.random.default_rng(7))
    loop = _thin_loop(t, two_views(x, np.random.default_rng(7)), y)  # the same augmentation draws
    for i, single in enumerate(loop):
        for k, g in single.items():
            assert np.allclose(grads[k][i], g, rtol=2e-3, atol=2e-6), (k, i, np.abs(grads[k][i] - g).max())
    clip = 0.3
    norms = [math.sqrt(sum(float(np.square(g).sum()) for g in s.values())) for s in loop]
    assert sum(n > clip for n in norms) >= 3, norms
    got = {k: g.sum(axis=0) for k, g in clip_per_sample(grads, clip).items()}
    for k in got:
        want = sum(s[k] * min(1.0, clip / n) for s, n in zip(loop, norms))
        assert np.allclose(got[k], want, rtol=2e-3, atol=2e-6), k
    assert all(np.array_equal(v, t.wc.state()[k]) for k, v in running.items())  # frozen: statistics untouched


def test_numpy_removing_one_image_moves_the_sum_by_at_most_the_clip() -> None:
    t = _thin_trainer()
    x = np.random.default_rng(2).normal(0, 1, (5, 1, 8, 8)).astype(np.float32)
    y = np.array([1, 1, 4, 7, 9])
    freeze_norms(t.wc)
    grads, _ = t.sample_grads(x, y, np.random.default_rng(4))
    full = {k: g.sum(axis=0) for k, g in clip_per_sample(grads, 0.3).items()}
    for drop in range(5):
        keep = [i for i in range(5) if i != drop]
        less, _ = t.sample_grads(x[keep], y[keep], _same_views(x, keep, 4))
        less = {k: g.sum(axis=0) for k, g in clip_per_sample(less, 0.3).items()}
        moved = math.sqrt(sum(float(np.square(full[k] - less[k]).sum()) for k in full))
        assert moved <= 0.3 * (1 + 1e-5), moved


def _same_views(x: np.ndarray, keep: list[int], seed: int):
    """A generator whose crop_flip draws give the kept images the views they had in the full batch."""
    class Replay:
        def __init__(self) -> None:
            self.rng, self.calls = np.random.default_rng(seed), 0

        def integers(self, low, high, size):
            return self.rng.integers(low, high, len(x))[keep]

        def random(self, size):
            return self.rng.random(len(x))[keep]
    return Replay()


def test_a_thin_dpsgd_round_trains_with_frozen_statistics() -> None:
    t = _thin_trainer()
    cfg = default_config("hsfp", ModelSpec(), device_target="etf", local_epochs=1, **SAMPLE).method
    before = t.wc.state()
    images = np.random.default_rng(0).integers(0, 256, (20, 8, 8, 1)).astype(np.uint8)
    losses = t.train_dpsgd(images, np.arange(20) % 10, (0.5,), (0.25,), cfg, np.random.default_rng(0))
    after = t.wc.state()
    assert steps(cfg) == 4 and math.isfinite(losses["total"])
    assert not np.array_equal(before["block1.conv.weight"], after["block1.conv.weight"])
    assert all(np.array_equal(before[k], after[k]) for k in before if "running" in k or "num_batches" in k)
    assert not any(layer.frozen for _, layer in t.wc.named() if isinstance(layer, BatchNorm2d))


def test_the_accountant_is_dp_accounting_for_the_same_steps() -> None:
    import dp_accounting as dpa

    q, sigma, n_steps, releases, delta = 0.05, 1.1, 600, 4, 1e-5
    for method, accountant in (("rdp", dpa.rdp.RdpAccountant), ("pld", dpa.pld.PLDAccountant)):
        acc = accountant()
        acc.compose(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(sigma)), n_steps)
        assert run_epsilon(sigma, 0, n_steps, q, delta, method) == pytest.approx(acc.get_epsilon(delta), rel=1e-9)
        acc.compose(dpa.GaussianDpEvent(sigma), releases)  # the device's other releases, composed
        assert run_epsilon(sigma, releases, n_steps, q, delta, method) == pytest.approx(acc.get_epsilon(delta),
                                                                                       rel=1e-9)
    # subsampling amplifies: the same steps without it spend far more
    assert run_epsilon(sigma, n_steps, 0, 0.0, delta) > 10 * run_epsilon(sigma, 0, n_steps, q, delta)
    sigma8 = sigma_for_epsilon(8.0, 0, delta, steps=n_steps, sample_rate=q)
    assert run_epsilon(sigma8, 0, n_steps, q, delta) == pytest.approx(8.0, rel=1e-3)


def test_the_accountant_drops_only_dp_accounting_s_warning_of_orders_it_leaves_out(caplog) -> None:
    # dp-accounting warns, for every DP-SGD epsilon, that fractional orders 1.1 to 1.5 did not
    # converge and are left out; the figure is the same either way, and no other warning is hidden
    import logging

    import dp_accounting as dpa

    from splitedge.methods.privacy.accountant import UNCONVERGED

    q, sigma, n_steps, delta = 0.1, 1.0, 60, 1e-5
    acc = dpa.rdp.RdpAccountant()
    with caplog.at_level(logging.WARNING, logger="absl"):
        acc.compose(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(sigma)), n_steps)
    assert any(r.getMessage().startswith(UNCONVERGED) for r in caplog.records), caplog.records
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="absl"):
        got = run_epsilon(sigma, 2, n_steps, q, delta)
        logging.getLogger("absl").warning("another absl warning")
    acc.compose(dpa.GaussianDpEvent(sigma), 2)
    assert got == acc.get_epsilon(delta)  # to the bit
    assert [r.getMessage() for r in caplog.records] == ["another absl warning"]
    assert logging.getLogger("absl").filters == []  # only while it computes


@pytest.mark.parametrize("method, settings, message", [
    ("cflhkd", {"dp_clip": 1.0}, "cflhkd's devices have no DP-SGD form"),
    ("fedmar", {"dp_clip": 1.0}, "fedmar's devices have no DP-SGD form"),
    ("hsfp", {"dp_clip": 1.0}, "refuses device_target=supcon"),
    ("scaffold", {}, "scaffold's devices have no DP-SGD form"),
    ("simsiam", {}, "simsiam's devices have no DP-SGD form"),
    ("fedavg", {"feddecorr_beta": 0.1}, "refuses feddecorr_beta > 0"),
    ("fedavg", {"dp_grad_clip": 0.0}, "needs dp_grad_clip > 0"),
    ("fedavg", {"dp_sample_rate": 0.0}, "dp_sample_rate in \\(0, 1\\]"),
    ("fedavg", {"dp_devices": 2, "secagg": "plus"}, "leave dp_devices at 1"),
])
def test_releases_unbounded_at_one_image_are_refused_before_any_work(method: str, settings: dict,
                                                                      message: str) -> None:
    from splitedge.cloud.options import build_run_config
    from splitedge.methods.data.datasets import load_dataset

    info = load_dataset("digits", max_train=10, max_test=10)[2]
    with pytest.raises(ValueError, match=message) as err:
        build_run_config(method, info, None, 0, {**SAMPLE, **settings})
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("method, settings, message", [
    ("fedproto", {"dp_clip": 1.0}, "dp_unit=device refuses fedproto: its prototypes and head statistics are computed "
                                   "with the personal model it trains without DP-SGD"),
    ("hsfp", {"dp_clip": 1.0, "moments_of": "local"}, "dp_unit=device refuses moments_of=local"),
])
def test_statistics_of_a_model_trained_without_dpsgd_are_refused_at_the_device_unit(method: str, settings: dict,
                                                                                     message: str) -> None:
    # Trained without DP-SGD on the same images, the model moves with every image, and so does
    # every image's vector: no bound holds at one image, nor at the device (docs/privacy.md).
    from splitedge.cloud.options import build_run_config
    from splitedge.methods.data.datasets import load_dataset

    info = load_dataset("digits", max_train=10, max_test=10)[2]
    with pytest.raises(ValueError, match=message) as err:
        build_run_config(method, info, None, 0, {"dp_sigma": 1.0, "dp_unit": "device", "dp_update_clip": 1.0,
                                                 **settings})
    assert "\n" not in str(err.value)


def test_accepted_sample_level_runs_need_no_update_clip() -> None:
    from splitedge.cloud.options import build_run_config
    from splitedge.methods.data.datasets import load_dataset

    info = load_dataset("digits", max_train=10, max_test=10)[2]
    for method, extra in (("fedavg", {}), ("fedprox", {}), ("fedadam", {}), ("hsfp-cal", {"device_target": "etf",
                          "dp_clip": 1.0, "dp_head_clip": 1.0, "dp_bn_clip": 5.0}),
                          ("fedproto", {"dp_clip": 1.0}), ("hsfp", {"device_target": "etf", "dp_clip": 1.0,
                                                                    "moments_of": "local"})):
        assert build_run_config(method, info, None, 0, {**SAMPLE, **extra}).method.dp_unit == "sample"


def _sim(url: str, run: str, out: Path, method: str, backends: tuple[str, ...], **extra) -> list[dict]:
    from splitedge.sim import SimSettings, run_sim

    torch.set_num_threads(1)
    s = SimSettings(rounds=2, devices=4, edges=2, broker=url, run=run, out=out, method=method, backends=backends,
                    max_train=400, max_test=200, deadline_s=120.0, overrides={**SAMPLE, **extra})
    run_sim(s)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("method, backends, extra, releases", [
    ("fedavg", ("torch",), {"dp_bn_clip": 5.0}, 1),  # the BatchNorm statistics of the received model
    ("hsfp", ("torch", "onnx"), {"device_target": "etf", "dp_clip": 5.0, "ic": 1}, 1),  # the moments
    # statistics of the model the device trained with DP-SGD: FedProto's prototypes, the moments
    # of H-SFP's local W_c (torch and the thin trainer), each one release a round
    ("fedproto", ("torch",), {"dp_clip": 5.0}, 1),
    ("hsfp", ("torch", "onnx"), {"device_target": "etf", "dp_clip": 5.0, "ic": 1, "moments_of": "local"}, 1),
])
def test_a_digits_federation_with_dpsgd_reports_its_epsilon(embedded_broker, tmp_path, method: str,
                                                           backends: tuple[str, ...], extra: dict,
                                                           releases: int) -> None:
    records = _sim(embedded_broker.url, f"dpsgd-{method}", tmp_path / method, method, backends, **extra)
    cfg = default_config(method, ModelSpec(), **{**SAMPLE, **extra}).method
    assert len(records) == 2
    for r in records:
        assert r["dp_unit"] == "sample" and r["dp_sample_rate"] == 0.25
        assert r["dp_sgd_steps_total"] == steps(cfg) * r["round"]
        assert r["dp_releases_total"] >= releases * r["round"]
        assert r["dp_epsilon"] == pytest.approx(run_epsilon(1.0, r["dp_releases_total"], r["dp_sgd_steps_total"],
                                                            0.25, 1e-5))
        assert r.get("accuracy") is None or math.isfinite(r["accuracy"])
    assert records[-1]["dp_epsilon"] > records[0]["dp_epsilon"] > 0
