"""Synthetic features drawn from per-class Gaussians (METHODS.md "Gaussian sampling").

numpy only. z = mu + sqrt(var + eps) * N(0, I), a diagonal Gaussian per class. With
mean_only=True the variance is treated as 0 (the paper's ablation), so z = mu + sqrt(eps) * noise:
the eps jitter is kept so repeated samples of one class are not bit-identical.
"""
from __future__ import annotations

import numpy as np

from splitedge.methods.moments import ClassMoments

CHUNK_ELEMENTS = 1 << 22  # ~4M values per noise chunk (16-32 MB) whatever D is


def allocate_counts(counts: np.ndarray, total: int, *, floor: int = 8, cap: int | None = None) -> np.ndarray:
    """Samples per class proportional to `counts`, then floor and cap.

    Largest-remainder rounding makes the proportional part sum to exactly `total`; floor and
    cap are applied afterwards, so the final sum can differ from `total` (a rare class still
    gets `floor` samples, a dominant one at most `cap`). Ties go to the lower class index.
    """
    counts = np.asarray(counts, dtype=np.int64)
    if total < 0 or floor < 0 or (cap is not None and cap < floor):
        raise ValueError(f"need total >= 0, floor >= 0 and cap >= floor; got {total}, {floor}, {cap}")
    if len(counts) == 0:
        return np.zeros(0, dtype=np.int64)
    if (counts < 1).any():
        raise ValueError("class counts must be >= 1")
    quota = counts * (total / counts.sum())
    per = np.floor(quota).astype(np.int64)
    short = total - int(per.sum())
    order = np.argsort(-(quota - per), kind="stable")
    per[order[:short]] += 1
    per = np.maximum(per, floor)
    return per if cap is None else np.minimum(per, cap)


def sample_features(m: ClassMoments, total: int, rng: np.random.Generator, *, eps: float = 1e-5,
                    floor: int = 8, cap: int | None = None, mean_only: bool = False,
                    dtype: np.dtype | type = np.float32) -> tuple[np.ndarray, np.ndarray]:
    """Draw shuffled synthetic features x [N, D] (dtype) and labels y int64 [N].

    Noise is generated chunk by chunk into the preallocated output, so memory stays ~N*D of
    `dtype` even for wide W_c features. Same rng state -> same samples.
    """
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    per = allocate_counts(m.counts, total, floor=floor, cap=cap)
    rows = np.repeat(np.arange(len(per)), per)[rng.permutation(int(per.sum()))]
    work = np.float32 if np.dtype(dtype).itemsize <= 4 else np.float64
    mu = m.mean.astype(work)
    std = np.sqrt((np.zeros_like(m.var) if mean_only else m.var) + eps).astype(work)
    x = np.empty((len(rows), m.dim), dtype=dtype)
    step = max(1, CHUNK_ELEMENTS // max(m.dim, 1))
    for start in range(0, len(rows), step):
        r = rows[start:start + step]
        noise = rng.standard_normal((len(r), m.dim), dtype=work)
        x[start:start + step] = mu[r] + std[r] * noise
    return x, m.classes[rows].astype(np.int64)
