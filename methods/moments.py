"""Per-class feature moments (count, mean, unbiased variance) and their exact merge.

numpy only: devices without torch compute these. Everything is float64 internally; the wire
dtype (f2/f4/f8) is chosen only when a message body is built.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

WIRE_DTYPES = {"f2": np.dtype("<f2"), "f4": np.dtype("<f4"), "f8": np.dtype("<f8")}


@dataclass(frozen=True, eq=False)
class ClassMoments:
    """Moments of the classes present: classes i8[K] (unique, >= 0), counts i8[K] (>= 1),
    mean f8[K,D], var f8[K,D] (unbiased, ddof=1; 0 where the count is 1)."""

    classes: np.ndarray
    counts: np.ndarray
    mean: np.ndarray
    var: np.ndarray

    def __post_init__(self) -> None:
        classes, counts = np.asarray(self.classes), np.asarray(self.counts)
        if classes.dtype.kind not in "iu" or counts.dtype.kind not in "iu":
            raise ValueError("classes and counts must be integer arrays")
        classes = classes.astype(np.int64, copy=False).reshape(-1)
        counts = counts.astype(np.int64, copy=False).reshape(-1)
        mean = np.asarray(self.mean, dtype=np.float64)
        var = np.asarray(self.var, dtype=np.float64)
        _check_shapes(classes, counts, mean, var)
        object.__setattr__(self, "classes", classes)
        object.__setattr__(self, "counts", counts)
        object.__setattr__(self, "mean", mean)
        object.__setattr__(self, "var", var)

    @property
    def dim(self) -> int:
        return int(self.mean.shape[1])

    @property
    def total(self) -> int:
        return int(self.counts.sum())

    @classmethod
    def empty(cls, dim: int) -> ClassMoments:
        """No classes yet (a device with no data still reports its feature dimension)."""
        z = np.zeros((0, dim))
        return cls(np.zeros(0, np.int64), np.zeros(0, np.int64), z, z.copy())


def _check_shapes(classes: np.ndarray, counts: np.ndarray, mean: np.ndarray, var: np.ndarray) -> None:
    """Reject malformed moments early: a bad merge input would silently corrupt every tier above."""
    k = len(classes)
    if counts.shape != (k,):
        raise ValueError(f"counts shape {counts.shape} != ({k},)")
    if mean.ndim != 2 or mean.shape[0] != k or var.shape != mean.shape:
        raise ValueError(f"mean {mean.shape} / var {var.shape} must both be [{k}, D]")
    if len(np.unique(classes)) != k or (classes < 0).any():
        raise ValueError("classes must be unique and >= 0")
    if (counts < 1).any():
        raise ValueError("counts must be >= 1")
    if not (np.isfinite(mean).all() and np.isfinite(var).all()) or (var < 0).any():
        raise ValueError("mean/var must be finite and var >= 0")


class MomentAccumulator:
    """Streaming per-class moments over batches, numerically stable for large means.

    Each batch is reduced with a two-pass (centred) sum per class and merged into the running
    state with Chan et al.'s pairwise update, so the result matches one-shot np.var(ddof=1)
    even when features sit far from zero.
    """

    def __init__(self, dim: int) -> None:
        if dim < 1:
            raise ValueError(f"dim must be >= 1, got {dim}")
        self.dim = dim
        self._state: dict[int, tuple[int, np.ndarray, np.ndarray]] = {}  # class -> (n, mean, M2)

    def add(self, features: np.ndarray, labels: np.ndarray) -> None:
        """Accumulate a batch: features [N, D] of any float dtype, integer labels [N]."""
        x, y = self._checked(features, labels)
        if len(y) == 0:
            return
        order = np.argsort(y, kind="stable")
        x, y = x[order], y[order]
        classes, starts, counts = np.unique(y, return_index=True, return_counts=True)
        means = np.add.reduceat(x, starts, axis=0) / counts[:, None]
        m2 = np.add.reduceat(np.square(x - np.repeat(means, counts, axis=0)), starts, axis=0)
        for c, n, mu, s in zip(classes.tolist(), counts.tolist(), means, m2):
            self._merge_one(c, n, mu, s)

    def _checked(self, features: np.ndarray, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        x = np.asarray(features)
        y = np.asarray(labels)
        if x.ndim != 2 or x.shape[1] != self.dim:
            raise ValueError(f"features must be [N, {self.dim}], got {x.shape}")
        if y.shape != (x.shape[0],) or not np.issubdtype(y.dtype, np.integer):
            raise ValueError(f"labels must be integer [{x.shape[0]}], got {y.dtype} {y.shape}")
        if (y < 0).any():
            raise ValueError("labels must be >= 0")
        x = x.astype(np.float64)
        if not np.isfinite(x).all():
            raise ValueError("features contain NaN or inf")
        return x, y.astype(np.int64)

    def _merge_one(self, c: int, n_b: int, mean_b: np.ndarray, m2_b: np.ndarray) -> None:
        """Chan et al. pairwise update: exact, and free of the sum-of-squares cancellation."""
        if c not in self._state:
            self._state[c] = (n_b, mean_b, m2_b)
            return
        n_a, mean_a, m2_a = self._state[c]
        n = n_a + n_b
        delta = mean_b - mean_a
        self._state[c] = (n, mean_a + delta * (n_b / n), m2_a + m2_b + np.square(delta) * (n_a * n_b / n))

    def result(self) -> ClassMoments:
        """Moments so far, sorted by class."""
        if not self._state:
            return ClassMoments.empty(self.dim)
        classes = np.array(sorted(self._state), dtype=np.int64)
        counts = np.array([self._state[c][0] for c in classes.tolist()], dtype=np.int64)
        mean = np.stack([self._state[c][1] for c in classes.tolist()])
        m2 = np.stack([self._state[c][2] for c in classes.tolist()])
        return ClassMoments(classes, counts, mean, _var_from_m2(m2, counts))


def _var_from_m2(m2: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Unbiased variance; 0 for single-sample classes (and no negative rounding residue)."""
    denom = np.maximum(counts - 1, 1)[:, None].astype(np.float64)
    return np.where(counts[:, None] > 1, np.maximum(m2, 0.0) / denom, 0.0)


def compute_moments(features: np.ndarray, labels: np.ndarray) -> ClassMoments:
    """One-shot moments of a whole array."""
    if np.ndim(features) != 2:
        raise ValueError(f"features must be [N, D], got shape {np.shape(features)}")
    acc = MomentAccumulator(np.shape(features)[1])
    acc.add(features, labels)
    return acc.result()


def merge_moments(parts: Sequence[ClassMoments]) -> ClassMoments:
    """Exact merge (METHODS.md); classes may differ between parts.

    Computed in the algebraically identical centred form
    var = [sum (n_k-1) var_k + sum n_k (mu_k - mu)^2] / (n-1)
    rather than "+ sum n_k mu_k^2 - n mu^2", which cancels catastrophically for large means.
    Since counts travel with the result, merges compose (device -> edge -> cloud).
    """
    if not parts:
        raise ValueError("merge_moments needs at least one part")
    dims = {p.dim for p in parts}
    if len(dims) != 1:
        raise ValueError(f"parts have different feature dimensions: {sorted(dims)}")
    dim = dims.pop()
    classes = np.unique(np.concatenate([p.classes for p in parts]))
    n = np.zeros(len(classes), dtype=np.int64)
    for p in parts:
        n[np.searchsorted(classes, p.classes)] += p.counts
    mean = np.zeros((len(classes), dim))
    for p in parts:
        idx = np.searchsorted(classes, p.classes)
        mean[idx] += p.mean * (p.counts / n[idx])[:, None]
    m2 = np.zeros((len(classes), dim))
    for p in parts:
        idx = np.searchsorted(classes, p.classes)
        m2[idx] += (p.counts - 1)[:, None] * p.var + p.counts[:, None] * np.square(p.mean - mean[idx])
    return ClassMoments(classes, n, mean, _var_from_m2(m2, n))


def moments_to_body(m: ClassMoments, dtype: str = "f4", *, space: str = "wc",
                    versions: Mapping[str, int] | None = None) -> dict[str, Any]:
    """Body of a `moments` message for feature `space`, computed with the model `versions`;
    mean/var cast to the wire dtype, all little-endian."""
    if dtype not in WIRE_DTYPES:
        raise ValueError(f"dtype must be one of {sorted(WIRE_DTYPES)}, got {dtype!r}")
    with np.errstate(over="ignore"):  # overflow is reported below as a ValueError
        mean = np.ascontiguousarray(m.mean, dtype=WIRE_DTYPES[dtype])
        var = np.ascontiguousarray(m.var, dtype=WIRE_DTYPES[dtype])
    if not (np.isfinite(mean).all() and np.isfinite(var).all()):
        raise ValueError(f"moments overflow {dtype}; use a wider dtype")
    return {
        "classes": np.ascontiguousarray(m.classes, dtype="<i8"),
        "counts": np.ascontiguousarray(m.counts, dtype="<i8"),
        "mean": mean, "var": var,
        "space": space, "versions": {k: int(v) for k, v in (versions or {}).items()},
    }


def moments_from_body(body: Mapping[str, Any]) -> ClassMoments:
    """ClassMoments (float64) from a `moments` body; ValueError if malformed."""
    missing = {"classes", "counts", "mean", "var"} - set(body)
    if missing:
        raise ValueError(f"moments body lacks {sorted(missing)}")
    mean, var = np.asarray(body["mean"]), np.asarray(body["var"])
    if mean.dtype.kind != "f" or var.dtype.kind != "f":
        raise ValueError("mean/var must be float arrays")
    return ClassMoments(np.asarray(body["classes"]), np.asarray(body["counts"]), mean, var)
