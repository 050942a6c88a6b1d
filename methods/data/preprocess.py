"""Image preprocessing shared by every backend (numpy only, so the ONNX device can use it)."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from splitedge.methods.budget import checkpoint


def to_input(x: np.ndarray, mean: Sequence[float], std: Sequence[float]) -> np.ndarray:
    """uint8 images [N, H, W, C] -> normalised float32 [N, C, H, W]. Every batch of images a
    node's compute loads passes here (the thin trainer's too), so it is also where the round's
    budget is checked (methods/budget.py)."""
    checkpoint()  # the round's time budget and memory ceiling (runtime/guard.py)
    if x.dtype != np.uint8 or x.ndim != 4:
        raise ValueError(f"expected uint8 images [N,H,W,C], got {x.dtype} {x.shape}")
    m = np.asarray(mean, dtype=np.float32).reshape(1, -1, 1, 1)
    s = np.asarray(std, dtype=np.float32).reshape(1, -1, 1, 1)
    out = x.transpose(0, 3, 1, 2).astype(np.float32) / 255.0
    return (out - m) / s


def batches(n: int, size: int) -> list[slice]:
    """Slices covering range(n) in order, `size` at a time."""
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]


def accumulate(features: Any, data: tuple[Any, np.ndarray], mean: Sequence[float], std: Sequence[float],
               accumulator: Any, batch: int, keep: np.ndarray | None = None) -> Any:
    """A device's uint8 images through `features` (normalised images -> features), `batch` at a
    time, into a float64 `accumulator(dim)` (per-class moments, head statistics); its result.
    `keep` (bool [N]) leaves the other samples out (a minimum count per class); batches with
    none kept are not run (but the first, whose features give the dimension). ValueError when
    the device holds no data."""
    x, y = data
    acc = None
    for sl in batches(len(y), batch):
        checkpoint()  # the round's time budget and memory ceiling (runtime/guard.py)
        rows = None if keep is None else np.asarray(keep[sl], dtype=bool)
        if rows is not None and acc is not None and not rows.any():
            continue
        feats = np.asarray(features(to_input(x[sl], mean, std)))
        feats = feats.reshape(len(feats), -1)
        acc = acc or accumulator(feats.shape[1])
        acc.add(feats if rows is None else feats[rows], y[sl] if rows is None else np.asarray(y[sl])[rows])
    if acc is None:
        raise ValueError("device has no local data")
    return acc.result()
