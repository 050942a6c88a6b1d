"""Module state <-> weight maps (`dict[str, np.ndarray]`), the torch-free form weights
travel in. BatchNorm buffers are included because the slow-scale average covers them."""
from __future__ import annotations

import itertools
from typing import Mapping

import numpy as np
import torch
from torch import nn

__all__ = ["state_to_numpy", "load_numpy_state", "device_of"]


def device_of(module: nn.Module) -> torch.device:
    """Where `module` computes: its first parameter's (or buffer's) device, the CPU when it has none."""
    for tensor in itertools.chain(module.parameters(), module.buffers()):
        return tensor.device
    return torch.device("cpu")


def state_to_numpy(module: nn.Module) -> dict[str, np.ndarray]:
    """Parameters and buffers in state-dict order; floats as float32, integers as int64."""
    out: dict[str, np.ndarray] = {}
    for name, tensor in module.state_dict().items():
        arr = tensor.detach().cpu().numpy()
        dtype = np.int64 if np.issubdtype(arr.dtype, np.integer) else np.float32
        out[name] = np.array(arr, dtype=dtype, copy=True)
    return out


def _check_names_shapes(expected: Mapping[str, torch.Tensor],
                        weights: Mapping[str, np.ndarray]) -> None:
    """ValueError naming the first missing, unexpected or mis-shaped entry."""
    missing = [n for n in expected if n not in weights]
    unexpected = [n for n in weights if n not in expected]
    if missing or unexpected:
        raise ValueError(f"weight names do not match: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")
    for name, tensor in expected.items():
        shape = tuple(np.shape(weights[name]))
        if shape != tuple(tensor.shape):
            raise ValueError(f"{name!r}: shape {shape} != expected {tuple(tensor.shape)}")


def load_numpy_state(module: nn.Module, weights: Mapping[str, np.ndarray]) -> None:
    """Load a weight map into `module` in place, each array cast to the tensor's dtype.

    Validates first, so a bad map (e.g. from a peer or the wrong model) leaves the module
    untouched and raises ValueError naming the mismatch.
    """
    expected = module.state_dict()
    _check_names_shapes(expected, weights)
    for name, value in weights.items():
        if not np.issubdtype(np.asarray(value).dtype, np.number):
            raise ValueError(f"{name!r}: dtype {np.asarray(value).dtype} is not numeric")
    # np.array copies, so read-only views from the wire are fine for torch.
    state = {name: torch.as_tensor(np.array(weights[name]), dtype=t.dtype)
             for name, t in expected.items()}
    module.load_state_dict(state, strict=True)
