"""What the thin layers' parity tests share: their tolerance, the error they measure, and one
training pass of a torch module and its numpy twin on the same input and upstream gradient."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

GRAD_TOL = 1e-4
"""Largest error relative to torch's largest value, for outputs and gradients (float32 rounding
is about 1e-7 of it)."""


def rel_err(a: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(a - ref).max() / (np.abs(ref).max() + 1e-12))


def both_passes(module: torch.nn.Module, net: Any, x: np.ndarray, rng: np.random.Generator) -> dict[str, Any]:
    """`module` (torch autograd) and `net` (numpy layers) forward in training mode on `x`, then
    backward from the same random upstream gradient: the outputs and the input gradients, and
    torch's output and input for what else a test reads."""
    xt = torch.from_numpy(x).requires_grad_()
    out_t = module(xt)
    upstream = rng.standard_normal(tuple(out_t.shape)).astype(np.float32)
    out_t.backward(torch.from_numpy(upstream))
    out = net.forward(x, train=True)
    dx = net.backward(upstream.copy())  # backward consumes the gradient it is given
    return {"out": out, "dx": dx, "out_t": out_t.detach().numpy(), "dx_t": xt.grad.numpy()}
