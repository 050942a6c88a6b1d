"""Synthetic features drawn from per-class Gaussians (METHODS.md "Gaussian sampling").

numpy only. z = mu + sqrt(var + eps) * N(0, I), a diagonal Gaussian per class. With
mean_only=True the variance is treated as 0 (the paper's ablation), so z = mu + sqrt(eps) * noise:
the eps jitter is kept so repeated samples of one class are not bit-identical.

Three options change what is drawn, never the moments on the wire (issue 12):
- `balance`: every class gets the same number of samples instead of a share proportional to
  its count, so a tier's synthetic set does not inherit its label skew;
- `parts` (a mixture): each source's class Gaussian (a device's at an edge, an edge's at the
  cloud) is one component, drawn in proportion to its count, its variance shrunk toward the
  merged one by `shrink`, so a class spread over sources keeps their separate modes;
- `rho` (spatial correlation, needs the per-sample map `shape` [C, H, W]): each sample's noise
  mixes one draw per channel shared by all its positions with independent per-position draws,
      z[c, p] = mu[c, p] + sqrt(var[c, p] + eps) * (sqrt(rho) * n[c] + sqrt(1 - rho) * e[c, p]),
  so every position keeps its mean and variance while the pooled variance is no longer about
  1/(H W) of the per-position one (real maps are strongly correlated across positions).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from splitedge.methods.moments import ClassMoments, rows_in

CHUNK_ELEMENTS = 1 << 22  # ~4M values per noise chunk (16-32 MB) whatever D is
CORRELATED_CHUNK = 256  # samples per chunk when positions are correlated


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


def mixture_components(merged: ClassMoments, parts: Sequence[ClassMoments], *,
                       shrink: float) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Every (source, class) Gaussian: (row of its class in `merged` [M], weight within its class
    [M], mean [M, D], variance [M, D] = (1 - shrink) var_source + shrink var_merged)."""
    if not 0.0 <= shrink <= 1.0:
        raise ValueError(f"shrink must be in [0, 1], got {shrink}")
    rows, counts, means, variances = [], [], [], []
    for p in parts:
        at = rows_in(merged, p)
        rows.append(at)
        counts.append(p.counts)
        means.append(p.mean)
        variances.append((1.0 - shrink) * p.var + shrink * merged.var[at])
    row = np.concatenate(rows) if rows else np.zeros(0, np.int64)
    count = np.concatenate(counts).astype(np.float64) if counts else np.zeros(0)
    per_class = np.bincount(row, weights=count, minlength=len(merged.classes))
    weight = count / per_class[row] if len(row) else count
    dim = merged.dim
    return (row, weight, np.concatenate(means) if means else np.zeros((0, dim)),
            np.concatenate(variances) if variances else np.zeros((0, dim)))


def sample_features(m: ClassMoments, total: int, rng: np.random.Generator, *, eps: float = 1e-5,
                    floor: int = 8, cap: int | None = None, mean_only: bool = False,
                    dtype: np.dtype | type = np.float32, balance: bool = False,
                    parts: Sequence[ClassMoments] | None = None, shrink: float = 0.5,
                    rho: float = 0.0, shape: Sequence[int] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Draw shuffled synthetic features x [N, D] (dtype) and labels y int64 [N].

    Noise is generated chunk by chunk into the preallocated output, so memory stays ~N*D of
    `dtype` even for wide W_c features. Same rng state -> same samples; the defaults draw
    exactly what the plain sampler always drew.
    """
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    if rho and (shape is None or int(np.prod(shape)) != m.dim or len(shape) < 2 or not 0.0 < rho <= 1.0):
        raise ValueError(f"spatial rho {rho} needs rho in [0, 1] and a map shape whose size is {m.dim}, "
                         f"got {None if shape is None else tuple(shape)}")
    per = allocate_counts(np.ones_like(m.counts) if balance else m.counts, total, floor=floor, cap=cap)
    rows = np.repeat(np.arange(len(per)), per)[rng.permutation(int(per.sum()))]
    work = np.float32 if np.dtype(dtype).itemsize <= 4 else np.float64
    labels = m.classes[rows].astype(np.int64)
    mean, var = m.mean, m.var
    if parts:  # each sample's class row -> one of that class's components, by count
        row_of, weight, mean, var = mixture_components(m, parts, shrink=shrink)
        picked = np.empty(len(rows), dtype=np.int64)
        for k in range(len(per)):
            at, own = np.flatnonzero(rows == k), np.flatnonzero(row_of == k)
            if len(at) and not len(own):
                raise ValueError(f"class {m.classes[k]} of the merged moments is in none of the parts")
            if len(at):
                picked[at] = rng.choice(own, size=len(at), p=weight[own])
        rows = picked
    mu = mean.astype(work)
    std = np.sqrt((np.zeros_like(var) if mean_only else var) + eps).astype(work)
    x = np.empty((len(rows), m.dim), dtype=dtype)
    if rho:
        _fill_correlated(x, mu, std, rows, rng, int(shape[0]), rho, work)
        return x, labels
    step = max(1, CHUNK_ELEMENTS // max(m.dim, 1))
    for start in range(0, len(rows), step):
        r = rows[start:start + step]
        noise = rng.standard_normal((len(r), m.dim), dtype=work)
        np.multiply(noise, std[r], out=noise)  # in place: the same values as mu[r] + std[r] * noise,
        np.add(noise, mu[r], out=x[start:start + step])  # two chunk-sized temporaries fewer
    return x, labels


def _fill_correlated(x: np.ndarray, mu: np.ndarray, std: np.ndarray, rows: np.ndarray, rng: np.random.Generator,
                     channels: int, rho: float, work: type) -> None:
    """x [N, C*P] <- mu + std * (sqrt(rho) * per-channel draw + sqrt(1 - rho) * per-position draw)."""
    positions = x.shape[1] // channels
    shared, own = work(np.sqrt(rho)), work(np.sqrt(1.0 - rho))
    mu, std = mu.reshape(len(mu), channels, positions), std.reshape(len(std), channels, positions)
    out = x.reshape(len(x), channels, positions)
    for start in range(0, len(rows), CORRELATED_CHUNK):
        r = rows[start:start + CORRELATED_CHUNK]
        noise = shared * rng.standard_normal((len(r), channels, 1), dtype=work)
        noise = noise + own * rng.standard_normal((len(r), channels, positions), dtype=work)
        out[start:start + CORRELATED_CHUNK] = mu[r] + std[r] * noise
