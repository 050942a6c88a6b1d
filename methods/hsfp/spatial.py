"""Spatially correlated Gaussian features for H-SFP (issue 12, suspect 1). numpy only.

The plain sampler draws every position of a [C, H, W] feature map independently, so after the
global average pool a class's synthetic variance is about 1/(H W) of its per-position variance,
while real maps are strongly correlated across positions (hsfp-diagnose measures both). Here
each sample's noise mixes one draw per channel, shared by all its positions, with independent
per-position draws:
    z[c, p] = mu[c, p] + sqrt(var[c, p] + eps) * (sqrt(rho) * n[c] + sqrt(1 - rho) * e[c, p])
with n, e ~ N(0, 1). Every position keeps exactly its mean and variance (the moments on the
wire are unchanged); rho = 0 is the plain sampler's distribution, rho = 1 makes positions of a
channel move together, which bounds the pooled variance from above.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from splitedge.methods.moments import ClassMoments
from splitedge.methods.sampling import allocate_counts


def correlated_features(m: ClassMoments, total: int, rng: np.random.Generator, shape: Sequence[int], *,
                        rho: float, eps: float = 1e-5, floor: int = 8, mean_only: bool = False,
                        chunk: int = 256) -> tuple[np.ndarray, np.ndarray]:
    """Shuffled synthetic features x float32 [N, C*H*W] and labels int64 [N] (as sample_features)."""
    c, positions = int(shape[0]), int(np.prod(shape[1:]))
    if c * positions != m.dim or not 0.0 <= rho <= 1.0:
        raise ValueError(f"shape {tuple(shape)} does not fit dimension {m.dim}, or rho {rho} not in [0, 1]")
    per = allocate_counts(m.counts, total, floor=floor)
    rows = np.repeat(np.arange(len(per)), per)[rng.permutation(int(per.sum()))]
    mu = m.mean.astype(np.float32).reshape(len(per), c, positions)
    std = np.sqrt((np.zeros_like(m.var) if mean_only else m.var) + eps).astype(np.float32)
    std = std.reshape(len(per), c, positions)
    x = np.empty((len(rows), c, positions), dtype=np.float32)
    shared, own = np.float32(np.sqrt(rho)), np.float32(np.sqrt(1.0 - rho))
    for start in range(0, len(rows), chunk):
        r = rows[start:start + chunk]
        noise = shared * rng.standard_normal((len(r), c, 1), dtype=np.float32)
        noise = noise + own * rng.standard_normal((len(r), c, positions), dtype=np.float32)
        x[start:start + chunk] = mu[r] + std[r] * noise
    return x.reshape(len(rows), -1), m.classes[rows].astype(np.int64)
