"""The controls FL users reach for first, each step against a hand-computed one: FedProx's
proximal term, SCAFFOLD's corrected step, option II control update and server update, and the
FedOpt server optimisers (FedAvgM, FedAdam, FedYogi)."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from parts import cloud_ctx, device_ctx, env, plan_for, report
from splitedge.methods.contract import DONE
from splitedge.methods.torch_utils import sgd
from splitedge.methods.training import Batch, train_step
from splitedge.models import state_to_numpy

N = 12


def _data(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (N, 8, 8, 1), dtype=np.uint8), rng.integers(0, 10, N).astype(np.int64)


def _ce_grads(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    """d CE / d w of a copy in train mode, as the device's step sees it."""
    twin = copy.deepcopy(model).train()
    loss = F.cross_entropy(twin(x), y)
    return list(torch.autograd.grad(loss, list(twin.parameters())))


def _device(method: str, **settings):
    ctx = device_ctx(method, "d0", momentum=0.0, weight_decay=0.0, device_lr=0.1, **settings)
    return ctx.method.device_part(ctx, _data(), "torch")


def _perturbed(model: torch.nn.Module, seed: int = 1) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))


def test_fedprox_step_adds_mu_times_the_distance_to_the_global_model() -> None:
    # Prepare: the round's global weights kept as the anchor, the model moved away from them
    dev = _device("fedprox", mu=0.5)
    dev.anchor = [p.detach().clone() for p in dev.model.parameters()]
    _perturbed(dev.model)
    x, y = dev.x, dev.y
    w = [p.detach().clone() for p in dev.model.parameters()]
    g = _ce_grads(dev.model, x, y)
    # Execute: one step of the device's loss terms (in train mode, as the loop runs it)
    dev.model.train()
    train_step(dev.forward, dev.method.loss_terms("device"), Batch(x, y),
               sgd(dev.model.parameters(), 0.1, 0.0, 0.0))
    # Assert: w' = w - lr (g + mu (w - w_global))
    for p, w0, g0, a in zip(dev.model.parameters(), w, g, dev.anchor):
        torch.testing.assert_close(p.detach(), w0 - 0.1 * (g0 + 0.5 * (w0 - a)), rtol=1e-5, atol=1e-6)


def test_scaffold_step_is_corrected_by_c_minus_c_i() -> None:
    dev = _device("scaffold")
    rng = np.random.default_rng(3)
    dev.c_global = {n: rng.normal(0, 0.1, a.shape).astype(np.float32) for n, a in dev.c_global.items()}
    dev.c_local = {n: rng.normal(0, 0.1, a.shape).astype(np.float32) for n, a in dev.c_local.items()}
    dev.correction = [torch.from_numpy(dev.c_global[n] - dev.c_local[n]) for n, _ in dev.model.named_parameters()]
    w = [p.detach().clone() for p in dev.model.parameters()]
    g = _ce_grads(dev.model, dev.x, dev.y)
    dev.model.train()
    train_step(dev.forward, dev.method.loss_terms("device"), Batch(dev.x, dev.y),
               sgd(dev.model.parameters(), 0.1, 0.0, 0.0))
    for (name, p), w0, g0 in zip(dev.model.named_parameters(), w, g):
        want = w0 - 0.1 * (g0 - torch.from_numpy(dev.c_local[name]) + torch.from_numpy(dev.c_global[name]))
        torch.testing.assert_close(p.detach(), want, rtol=1e-5, atol=1e-6)


def test_scaffold_option_two_control_update_after_k_steps() -> None:
    # Prepare: a device holding the global model and c, c_i = 0; batches of 4: K = 3 steps
    dev = _device("scaffold", device_batch=4)
    dev.version, dev.c_version = 0, 0
    dev.c_global = {n: np.full(a.shape, 0.01, np.float32) for n, a in dev.c_global.items()}
    x = {n: a.copy() for n, a in state_to_numpy(dev.model).items()}
    # Execute
    sent = list(dev.run_round(plan_for(1, versions={"model": 0, "c": 0})))
    # Assert: the model, then dc = c_i+ - c_i with c_i+ = c_i - c + (x - y) / (K lr), then DONE
    assert [getattr(m, "body", {}).get("part") for m in sent[:2]] == ["model", "dc"] and sent[-1] is DONE
    assert dev.steps == 3
    y = state_to_numpy(dev.model)
    for name, dc in sent[1].body["weights"].items():
        want = -0.01 + (x[name] - y[name]) / (3 * 0.1)
        np.testing.assert_allclose(dc, want, rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(dev.c_local[name], want, rtol=1e-4, atol=1e-6)
    assert sent[1].body["samples"] == 1  # one device, so the merges take the plain mean over devices


@pytest.mark.parametrize("private_reports, steps", [(False, 3), (True, 4)])
def test_scaffold_under_dp_derives_its_control_update_from_the_noised_model_it_sent(private_reports: bool,
                                                                                    steps: int) -> None:
    # Prepare: as above, with DP; with private reports the device reports 16 samples (the power
    # of two at or above its 12), so K is counted as 16 / 4 = 4 steps, not the 3 it took
    import dataclasses

    dev = _device("scaffold", device_batch=4, dp_sigma=1.0, dp_update_clip=1.0)
    dev.ctx = dataclasses.replace(dev.ctx, private_reports=private_reports)
    dev.version, dev.c_version = 0, 0
    dev.c_global = {n: np.full(a.shape, 0.01, np.float32) for n, a in dev.c_global.items()}
    x = {n: a.copy() for n, a in state_to_numpy(dev.model).items()}
    # Execute
    sent = list(dev.run_round(plan_for(1, versions={"model": 0, "c": 0})))
    # Assert: the model sent is noised (not the trained one), dc follows from it: post-processing,
    # one release counted
    y_sent, y_trained = sent[0].body["weights"], state_to_numpy(dev.model)
    assert dev.dp_releases == 1 and dev.steps == 3 and sent[0].body["samples"] == (16 if private_reports else 12)
    first = next(iter(y_sent))
    assert not np.allclose(y_sent[first], y_trained[first])
    for name, dc in sent[1].body["weights"].items():
        np.testing.assert_allclose(dc, -0.01 + (x[name] - y_sent[name]) / (steps * 0.1), rtol=1e-4, atol=1e-5)


def test_scaffold_server_update_of_model_and_control_variate() -> None:
    # Prepare: a cloud of a federation of 4 devices; two edges report 3 devices' dc between them
    ctx = cloud_ctx("scaffold", "cloud", server_lr=0.5, test=_data(5))
    ctx.view = SimpleNamespace(devices={f"d{i}": "e0" for i in range(4)})
    cloud = ctx.method.cloud_part(ctx)
    x = state_to_numpy(cloud.model)
    rng = np.random.default_rng(4)
    y = [{n: (a + rng.normal(0, 0.1, a.shape)).astype(a.dtype) if a.dtype.kind == "f" else a for n, a in x.items()}
         for _ in range(2)]
    params = set(cloud.c_global)
    dcs = [{n: rng.normal(0, 0.1, cloud.c_global[n].shape).astype(np.float32) for n in params} for _ in range(2)]
    reports = [report(f"e{i}", env("weights", {"part": "model", "version": 0, "samples": 100, "weights": y[i]}, f"e{i}"),
                      env("weights", {"part": "dc", "version": 0, "samples": (2, 1)[i], "weights": dcs[i]}, f"e{i}"))
               for i in range(2)]
    # Execute
    out, metrics = cloud.aggregate(plan_for(1, versions={"model": 0, "c": 0}), reports)
    # Assert: x <- x + lr_g (mean(y) - x); c <- c + (|S|/N) mean(dc) with |S| = 3 of N = 4
    new = state_to_numpy(cloud.model)
    for n in params:
        np.testing.assert_allclose(new[n], x[n] + 0.5 * ((y[0][n] + y[1][n]) / 2 - x[n]), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(cloud.c_global[n], 0.75 * (2 * dcs[0][n] + dcs[1][n]) / 3, rtol=1e-5, atol=1e-7)
    assert metrics["control_devices"] == 3
    assert {m.body["part"] for m in out} == {"model", "c"} and all(m.body["version"] == 1 for m in out)


@pytest.mark.parametrize("kind", ["avgm", "adam", "yogi"])
def test_server_optimisers_step_as_written(kind: str) -> None:
    from splitedge.methods.fedopt.server import ServerOptimiser

    lr, b1, b2, tau = 0.3, 0.9, 0.99, 1e-3
    opt = ServerOptimiser(kind, lr=lr, beta1=b1, beta2=b2, tau=tau, params=("w",))
    w = np.array([1.0, -2.0, 0.5])
    m, v, momentum = np.zeros(3), np.full(3, tau ** 2), np.zeros(3)
    for merged in (np.array([1.5, -2.5, 0.5]), np.array([0.0, 0.0, 3.0])):  # two rounds
        d = merged - w
        if kind == "avgm":
            momentum = b1 * momentum + d
            step = lr * momentum
        else:
            m = b1 * m + (1 - b1) * d
            v = b2 * v + (1 - b2) * d * d if kind == "adam" else v - (1 - b2) * d * d * np.sign(v - d * d)
            step = lr * m / (np.sqrt(v) + tau)
        new = opt.step({"w": w, "bn.running_mean": np.zeros(2)}, {"w": merged, "bn.running_mean": np.ones(2)})
        np.testing.assert_allclose(new["w"], w + step, rtol=1e-12)
        np.testing.assert_array_equal(new["bn.running_mean"], np.ones(2))  # buffers: as merged
        w = new["w"]


def test_fedopt_cloud_keeps_its_moments_across_a_restart() -> None:
    from splitedge.methods import snapshot

    ctx = cloud_ctx("fedadam", "cloud")
    cloud = ctx.method.cloud_part(ctx)
    merged = {n: a + 0.1 if a.dtype.kind == "f" else a for n, a in state_to_numpy(cloud.model).items()}
    cloud.server_update(merged)
    fresh = ctx.method.cloud_part(cloud_ctx("fedadam", "cloud"))
    fresh.restore_state(snapshot.loads(snapshot.dumps(cloud.resume_state())))
    assert fresh.server.m.keys() == cloud.server.m.keys() and fresh.server.m
    assert all(np.array_equal(fresh.server.v[k], cloud.server.v[k]) for k in cloud.server.v)


def test_a_negative_batchnorm_variance_is_refused_and_evaluation_survives_degenerate_features() -> None:
    """A FedAvg device that sent BatchNorm running_var negated crashed the cloud's evaluation
    (SVD did not converge): now the update is refused at the first tier, and evaluation skips
    what it cannot measure."""
    from splitedge.methods.checks import check_weight_map, weight_specs
    from splitedge.methods.metrics.evaluate import representation_measures
    from splitedge.protocol.errors import ProtocolError

    ctx = device_ctx("fedavg", "d0")
    weights = state_to_numpy(ctx.method.device_part(ctx, _data(), "torch").model)
    specs = weight_specs(weights)
    name = next(k for k in weights if k.endswith("running_var"))
    bad = {**weights, name: -weights[name]}
    with pytest.raises(ProtocolError) as err:
        check_weight_map(bad, specs)
    assert err.value.rule == "state.range"
    check_weight_map(weights, specs)  # the honest map passes
    assert representation_measures(np.full((8, 4), np.nan)) == {}
    assert representation_measures(np.ones((8, 4)))["effective_rank"] == 1.0
