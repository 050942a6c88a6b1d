"""Image preprocessing shared by every backend (numpy only, so the ONNX device can use it)."""

from __future__ import annotations

from typing import Sequence

import numpy as np


def to_input(x: np.ndarray, mean: Sequence[float], std: Sequence[float]) -> np.ndarray:
    """uint8 images [N, H, W, C] -> normalised float32 [N, C, H, W]."""
    if x.dtype != np.uint8 or x.ndim != 4:
        raise ValueError(f"expected uint8 images [N,H,W,C], got {x.dtype} {x.shape}")
    m = np.asarray(mean, dtype=np.float32).reshape(1, -1, 1, 1)
    s = np.asarray(std, dtype=np.float32).reshape(1, -1, 1, 1)
    out = x.transpose(0, 3, 1, 2).astype(np.float32) / 255.0
    return (out - m) / s


def batches(n: int, size: int) -> list[slice]:
    """Slices covering range(n) in order, `size` at a time."""
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]
