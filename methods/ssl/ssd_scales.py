"""SSD's dimension-scaling targets (METHODS.md "SSD"), drawn once by the cloud. numpy only.

The cloud draws one random orthonormal basis Q and gives each device k a disjoint set of
floor(dim/K) basis directions; device k's scale vector d_k is alpha on its set and 1 elsewhere.
Each device then receives (Q, d_k) and pulls its projections towards normalize(x Q diag(d_k) Q^T)
(`methods.ssl_losses.dsr_loss`). This module stays torch-free so the cloud (or a thin tool)
can draw the targets without the training stack.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def random_orthonormal(dim: int, rng: np.random.Generator) -> np.ndarray:
    """A Haar-distributed orthonormal [dim, dim] matrix, float32.

    QR of a Gaussian matrix alone is biased (numpy's R diagonal signs are not random); scaling
    column j by sign(R_jj) makes Q uniform over O(dim) (Mezzadri 2007). Drawn in float64 and
    cast last, so Q^T Q = I holds to float32 precision.
    """
    q, r = np.linalg.qr(rng.standard_normal((dim, dim)))
    signs = np.where(np.diag(r) < 0, -1.0, 1.0)     # sign(0) would zero a column; treat 0 as +
    return (q * signs).astype(np.float32)


def disjoint_directions(dim: int, k: int, rng: np.random.Generator) -> list[np.ndarray]:
    """K disjoint, sorted index sets of floor(dim/K) directions each.

    A random permutation of range(dim) cut into K consecutive chunks; the dim mod K leftover
    directions belong to nobody (every device gets the same number, as in the paper).
    """
    size = dim // k
    perm = rng.permutation(dim)
    return [np.sort(perm[i * size:(i + 1) * size]) for i in range(k)]


def _check(dim: int, devices: Sequence[str], alpha: float) -> None:
    if not devices:
        raise ValueError("devices must name at least one device")
    if len(set(devices)) != len(devices):
        raise ValueError(f"device ids must be unique, got {list(devices)}")
    if len(devices) > dim:
        raise ValueError(f"K={len(devices)} devices need dim >= K, got dim={dim}")
    if not alpha > 0:
        raise ValueError(f"alpha must be > 0, got {alpha}")


def dsr_scales(dim: int, devices: Sequence[str], alpha: float,
               rng: np.random.Generator) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """(Q [dim, dim], {device id: d_k [dim]}), both float32.

    Devices get their sets in the given order. Q is drawn before the permutation, so a seed
    fixes both. d_k = alpha on device k's directions and 1 elsewhere.
    """
    _check(dim, devices, alpha)
    q = random_orthonormal(dim, rng)
    scales = {}
    for device, idx in zip(devices, disjoint_directions(dim, len(devices), rng)):
        d = np.ones(dim, dtype=np.float32)
        d[idx] = alpha
        scales[device] = d
    return q, scales
