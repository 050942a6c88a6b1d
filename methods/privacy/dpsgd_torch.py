"""DP-SGD on a torch device (methods/privacy/dpsgd.py says the mechanism and why it is one image's).

Per-sample gradients come from torch.func (vmap over grad of a functional call), so any forward
and loss terms a part already has serve, as long as each image's loss reads that image alone.
Torch devices only: the thin device's numpy DP-SGD is methods/thin/per_sample.py.
"""

from __future__ import annotations

import secrets
from typing import Any, Callable, Sequence

import numpy as np
import torch
from torch import nn

from splitedge.methods.budget import checkpoint
from splitedge.methods.privacy.dpsgd import poisson_batch, steps
from splitedge.methods.privacy.release import entropy_rng

LossOf = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, dict[str, torch.Tensor]]]
"""(inputs of ONE sample with a leading axis of 1, its label [1]) -> (its loss, term values)."""
Load = Callable[[np.ndarray], tuple[torch.Tensor, torch.Tensor]]
"""Indices of images -> (their inputs [n, ...], labels [n])."""
CHUNK = 16
"""Samples per vmap call: bounds the per-sample gradients held at once (16 x the trained size)."""


class _Call(nn.Module):
    """`fn` run with `module`'s parameters swapped by functional_call (the part's own forward,
    which may call any method of its model, and read its parameters, as FedProx's does)."""

    def __init__(self, module: nn.Module, fn: LossOf) -> None:
        super().__init__()
        self.module, self.fn = module, fn

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return self.fn(x, y)


def per_sample_grads(module: nn.Module, loss_of: LossOf, x: torch.Tensor,
                     y: torch.Tensor) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """({parameter name: [n, ...] gradient of each sample's own loss}, {term: [n] values}) of
    `module`'s trainable parameters, the module as it is (call it in eval mode: BatchNorm frozen)."""
    from torch.func import functional_call, grad, vmap

    call = _Call(module, loss_of)
    names = [k for k, p in module.named_parameters() if p.requires_grad]
    params = {f"module.{k}": p.detach() for k, p in module.named_parameters() if p.requires_grad}
    frozen = {f"module.{k}": p.detach() for k, p in module.named_parameters() if not p.requires_grad}
    frozen.update({f"module.{k}": b for k, b in module.named_buffers()})

    def one(p: dict[str, torch.Tensor], xi: torch.Tensor, yi: torch.Tensor) -> Any:
        loss, parts = functional_call(call, ({**p, **frozen}), (xi[None], yi[None]))
        return loss, parts

    grads, parts = vmap(grad(one, has_aux=True), in_dims=(None, 0, 0))(params, x, y)
    return {k: grads[f"module.{k}"] for k in names}, parts


def clipped_sum(grads: dict[str, torch.Tensor], clip: float) -> dict[str, torch.Tensor]:
    """Each sample's gradient scaled to global L2 norm <= clip over all names, then summed (float64)."""
    n = len(next(iter(grads.values())))
    norms = torch.sqrt(sum(g.double().reshape(n, -1).pow(2).sum(1) for g in grads.values()))
    if not torch.isfinite(norms).all():
        raise ValueError("a per-sample gradient is not finite")
    scale = torch.clamp(clip / norms.clamp_min(1e-300), max=1.0)
    return {k: (g.double() * scale.reshape((n,) + (1,) * (g.dim() - 1))).sum(0) for k, g in grads.items()}


def train_dpsgd(part: Any, module: nn.Module, loss_of: LossOf, load: Load, n: int, opt: Any,
                trained: Sequence[nn.Module] = ()) -> dict[str, float]:
    """One round of DP-SGD (dpsgd.steps(cfg) steps) on `part`'s `n` images: Poisson draw at the
    run's dp_sample_rate, per-sample gradients clipped to dp_grad_clip, their sum noised at
    dp_sigma and divided by device_batch, then `opt.step()`. `module` (and `trained`) run in eval
    mode (BatchNorm frozen). Noise and draws from the OS's entropy. Returns the mean of each
    term over the images drawn."""
    cfg = part.cfg
    rng, gen = entropy_rng(), torch.Generator().manual_seed(secrets.randbits(63))
    params = [(k, p) for k, p in module.named_parameters() if p.requires_grad]
    sums: dict[str, float] = {}
    seen = 0
    for m in (module, *trained):
        m.eval()
    for _ in range(steps(cfg)):
        checkpoint()  # the round's time budget and memory ceiling (runtime/guard.py)
        idx = poisson_batch(n, cfg.dp_sample_rate, rng)
        total = {k: torch.zeros(p.shape, dtype=torch.float64, device=p.device) for k, p in params}
        for start in range(0, len(idx), CHUNK):
            x, y = load(idx[start:start + CHUNK])
            grads, parts = per_sample_grads(module, loss_of, x, y)
            for k, v in clipped_sum(grads, cfg.dp_grad_clip).items():
                total[k] += v
            for k, v in parts.items():
                sums[k] = sums.get(k, 0.0) + float(v.detach().double().sum())
            seen += len(y)
        opt.zero_grad()
        with torch.no_grad():
            for k, p in params:
                noise = torch.normal(0.0, cfg.dp_sigma * cfg.dp_grad_clip, p.shape, generator=gen,
                                     dtype=torch.float64).to(p.device)  # drawn on the CPU: gen is a CPU generator
                p.grad = ((total[k] + noise) / cfg.device_batch).to(p.dtype)
        opt.step()
    return {k: v / max(seen, 1) for k, v in sums.items()}


def terms_loss(terms: Sequence[Any], out: Any, batch: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """methods.training.total_loss without leaving the graph (its float() cannot run under vmap):
    the weighted sum and each term's value, with "total"."""
    parts = {t.name: t.fn(out, batch) for t in terms}
    total = sum(t.weight * parts[t.name] for t in terms)
    return total, {**parts, "total": total}
