"""Splits of a data set across devices: IID, Dirichlet label skew, and per-device feature skew.

numpy only; every function takes an explicit np.random.Generator so runs are reproducible
without global seeds. Index splits are lists of sorted int64 arrays that cover every sample
exactly once.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def _check_parts(labels: np.ndarray, n_parts: int) -> np.ndarray:
    y = np.asarray(labels)
    if y.ndim != 1:
        raise ValueError(f"labels must be 1-d, got shape {y.shape}")
    if not 1 <= n_parts <= len(y):
        raise ValueError(f"n_parts must be in [1, {len(y)}], got {n_parts}")
    return y


def iid(labels: np.ndarray, n_parts: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Uniform shuffle cut into near-equal parts (sizes differ by at most 1)."""
    y = _check_parts(labels, n_parts)
    return [np.sort(p).astype(np.int64) for p in np.array_split(rng.permutation(len(y)), n_parts)]


def dirichlet(labels: np.ndarray, n_parts: int, alpha: float, rng: np.random.Generator,
              min_size: int = 10, *, balance: bool = True, max_tries: int = 1000) -> list[np.ndarray]:
    """NIID-Bench label skew: for each class, proportions ~ Dir(alpha * 1) over the parts.

    balance=True (the default, as in NIID-Bench's code) zeroes a part's share of further classes
    once it holds >= N / n_parts samples, which keeps part sizes from running away at small alpha.
    The whole draw is repeated until every part has >= min_size samples.
    """
    y = _check_parts(labels, n_parts)
    if alpha <= 0:
        raise ValueError(f"alpha must be > 0, got {alpha}")
    if n_parts * min_size > len(y):
        raise ValueError(f"{n_parts} parts x min_size {min_size} > {len(y)} samples")
    for _ in range(max_tries):
        parts = _dirichlet_draw(y, n_parts, alpha, rng, balance)
        if min(len(p) for p in parts) >= min_size:
            return parts
    raise ValueError(f"no Dirichlet(alpha={alpha}) split with every part >= {min_size} samples "
                     f"after {max_tries} tries; raise alpha or lower min_size")


def _dirichlet_draw(y: np.ndarray, n_parts: int, alpha: float, rng: np.random.Generator,
                    balance: bool) -> list[np.ndarray]:
    """One NIID-Bench draw: per class, shuffle its indices and cut them by Dirichlet proportions."""
    chunks: list[list[np.ndarray]] = [[] for _ in range(n_parts)]
    sizes = np.zeros(n_parts, dtype=np.int64)
    for c in np.unique(y):
        idx = rng.permutation(np.flatnonzero(y == c))
        p = rng.dirichlet(np.full(n_parts, alpha))
        if balance:
            p = p * (sizes < len(y) / n_parts)
        p = p / p.sum() if p.sum() > 0 else np.full(n_parts, 1.0 / n_parts)
        cuts = (np.cumsum(p) * len(idx)).astype(np.int64)[:-1]
        for j, piece in enumerate(np.split(idx, cuts)):
            chunks[j].append(piece)
            sizes[j] += len(piece)
    return [np.sort(np.concatenate(ch)).astype(np.int64) for ch in chunks]


def dirichlet_per_device(labels: np.ndarray, n_parts: int, alpha: float, rng: np.random.Generator) -> list[np.ndarray]:
    """Label skew for many parts (Hsu et al. 2019): each part's class mix ~ Dir(alpha * 1_K) and
    part sizes as equal as possible; a part takes its classes' shares from per-class pools, and
    what a pool can no longer give comes from the part's other classes that still have samples
    (in proportion to its mix). Unlike NIID-Bench's per-class draw, no part can end up nearly
    empty, so it splits e.g. CIFAR-10 over 1,000 devices at alpha 0.3."""
    y = _check_parts(labels, n_parts)
    if alpha <= 0:
        raise ValueError(f"alpha must be > 0, got {alpha}")
    classes = np.unique(y)
    pools = [rng.permutation(np.flatnonzero(y == c)) for c in classes]
    used = np.zeros(len(classes), dtype=np.int64)
    sizes = [len(a) for a in np.array_split(np.arange(len(y)), n_parts)]
    parts = []
    for size in sizes:
        mix = rng.dirichlet(np.full(len(classes), alpha))
        want = rng.multinomial(size, mix)
        taken: list[np.ndarray] = []
        while size > 0:
            left = np.array([len(p) for p in pools]) - used
            want = np.minimum(want, left)
            for c in np.flatnonzero(want):
                taken.append(pools[c][used[c]:used[c] + want[c]])
                used[c] += want[c]
            size -= int(want.sum())
            left = np.array([len(p) for p in pools]) - used
            if size > 0:  # some classes ran dry: the rest from this part's classes that have samples
                weights = mix * (left > 0)
                weights = weights / weights.sum() if weights.sum() > 0 else (left > 0) / (left > 0).sum()
                want = rng.multinomial(size, weights)
        parts.append(np.sort(np.concatenate(taken)).astype(np.int64))
    return parts


@dataclass(frozen=True)
class SkewParams:
    """A device's fixed augmentation: rotate by rotation_k * 90 degrees, add a per-channel shift."""

    rotation_k: int
    colour_shift: tuple[float, ...]  # in pixel units (0..255 scale), one per RGB channel


def feature_skew(n_parts: int, rng: np.random.Generator, *, max_shift: float = 0.2,
                 rotate: bool = True) -> list[SkewParams]:
    """Per-part augmentation parameters for feature-skew experiments (clustered and SSL methods).

    Rotations are balanced (part i gets (perm of i) % 4 quarter turns) so every rotation group
    is populated; colour shifts are uniform in [-max_shift, max_shift] * 255 per channel.
    """
    if n_parts < 1 or not 0 <= max_shift <= 1:
        raise ValueError(f"need n_parts >= 1 and 0 <= max_shift <= 1, got {n_parts}, {max_shift}")
    ks = rng.permutation(np.arange(n_parts) % 4) if rotate else np.zeros(n_parts, dtype=np.int64)
    shifts = rng.uniform(-max_shift, max_shift, size=(n_parts, 3)) * 255.0
    return [SkewParams(int(k), tuple(float(v) for v in s)) for k, s in zip(ks, shifts)]


def apply_feature_skew(x: np.ndarray, params: SkewParams) -> np.ndarray:
    """Apply a part's skew to uint8 images [N, H, W, C] (square); grey images get the mean shift."""
    if x.ndim != 4 or x.dtype != np.uint8 or x.shape[1] != x.shape[2]:
        raise ValueError(f"expected square uint8 images [N,H,W,C], got {x.dtype} {x.shape}")
    shift = np.asarray(params.colour_shift)
    shift = shift[: x.shape[3]] if x.shape[3] == len(shift) else np.full(x.shape[3], shift.mean())
    out = np.rot90(x, k=params.rotation_k, axes=(1, 2)).astype(np.float32) + shift.astype(np.float32)
    return np.clip(np.rint(out), 0, 255).astype(np.uint8)
