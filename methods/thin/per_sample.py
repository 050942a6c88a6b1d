"""Per-sample gradients of the numpy layers, for DP-SGD on a thin device (methods/privacy/dpsgd.py).

A backward pass through a `Sequential` that keeps each sample's parameter gradient instead of
their sum: a convolution's weight gradient per sample is its output gradient times its own
unfolded windows (a grouped one's, tap by tap: methods/thin/grouped.py), a linear layer's the
outer product of its own rows, a frozen BatchNorm's the per-sample sums over positions. Needs a
training forward with every BatchNorm frozen (`BatchNorm2d.frozen`): batch statistics would make
each sample's output depend on the others.
"""

from __future__ import annotations

import numpy as np

from splitedge.methods.thin.layers import BatchNorm2d, Conv2d, Linear, MaxPool2d, ReLU, ReLU6, Sequential

F32 = np.float32


def freeze_norms(seq: Sequential, frozen: bool = True) -> None:
    """Every BatchNorm of `seq` normalises by its running statistics in training (or no longer)."""
    for _, layer in seq.named():
        if isinstance(layer, BatchNorm2d):
            layer.frozen = frozen


def per_sample_backward(seq: Sequential, grad: np.ndarray) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """({state name: [N, ...] float64 gradient of each sample}, the input's gradient) of `seq`
    after a training forward with its BatchNorms frozen, for the output gradient `grad` [N, ...]
    (of a loss that is a sum of per-sample terms, so row i of `grad` is sample i's alone)."""
    out: dict[str, np.ndarray] = {}
    for prefix, layer in reversed(list(seq.named())):
        if isinstance(layer, Conv2d):
            assert layer._saved_x is not None, "backward before a training forward"
            out[prefix + "weight"] = layer.sample_weight_grads(grad, layer._saved_x)
            grad = layer.backward_input(grad)
        elif isinstance(layer, BatchNorm2d):
            if not layer.frozen or layer._saved_xhat is None:
                raise ValueError("per-sample gradients need a training forward with BatchNorm frozen")
            out[prefix + "weight"] = (grad.astype(np.float64) * layer._saved_xhat).sum(axis=(2, 3))
            out[prefix + "bias"] = grad.astype(np.float64).sum(axis=(2, 3))
            grad = layer.frozen_input_grad(grad)
        elif isinstance(layer, Linear):
            x = layer._saved_x
            out[prefix + "weight"] = grad.astype(np.float64)[:, :, None] * x[:, None, :]
            out[prefix + "bias"] = grad.astype(np.float64)
            grad = layer.backward(grad)
            layer.grads.clear()
        elif isinstance(layer, (ReLU, ReLU6, MaxPool2d)):
            grad = layer.backward(grad)
        else:
            raise ValueError(f"no per-sample gradient for {type(layer).__name__}")
    return out, grad
