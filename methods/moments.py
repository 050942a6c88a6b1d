"""Per-class feature moments (count, mean, unbiased variance) and their exact merge.

numpy only: devices without torch compute these. Everything is float64 internally; the wire
dtype (f2/f4/f8) is chosen only when a message body is built.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from splitedge.methods.errors import NON_FINITE_FEATURES, RoundFailed

WIRE_DTYPES = {"f2": np.dtype("<f2"), "f4": np.dtype("<f4"), "f8": np.dtype("<f8")}


class PerClassStats:
    """What per-class statistics with `counts` [K] and `mean` [K, D] share (ClassMoments,
    headstats.HeadStats)."""

    counts: np.ndarray
    mean: np.ndarray

    @property
    def dim(self) -> int:
        return int(self.mean.shape[1])

    @property
    def total(self) -> int:
        return int(self.counts.sum())


RAW_FLOATS = frozenset(np.dtype(t) for t in (np.float16, np.float32, np.float64))
"""Float dtypes ClassMoments holds as given (the wire's f2/f4/f8, native byte order): widening
them to float64 is exact, so reading them widened inside an operation gives what a float64 copy
would, without the copy."""


@dataclass(frozen=True, eq=False, init=False)
class ClassMoments(PerClassStats):
    """Moments of the classes present: classes i8[K] (unique, >= 0), counts i8[K] (>= 1),
    mean f8[K,D], var f8[K,D] (unbiased, ddof=1; 0 where the count is 1).

    Means and variances of a narrower float dtype (a decoded f4 or f2 body) are held as they
    came, not copied to float64 per message: `raw_mean` / `raw_var` are the arrays held, which
    the exact merge accumulates in float64 without widening them first; `mean` / `var` are
    float64 on every access (a widened copy when the moments hold a narrower dtype: bind it
    once rather than read it in a loop). Widening is exact, so every result is as it was when
    the moments held float64 copies."""

    classes: np.ndarray
    counts: np.ndarray
    mean: np.ndarray  # float64 properties, assigned below the class; the arrays held are raw_mean / raw_var
    var: np.ndarray

    def __init__(self, classes: Any, counts: Any, mean: Any, var: Any) -> None:
        classes, counts = np.asarray(classes), np.asarray(counts)
        if classes.dtype.kind not in "iu" or counts.dtype.kind not in "iu":
            raise ValueError("classes and counts must be integer arrays")
        classes = classes.astype(np.int64, copy=False).reshape(-1)
        counts = counts.astype(np.int64, copy=False).reshape(-1)
        raw_mean, raw_var = _held(mean), _held(var)
        _check_shapes(classes, counts, raw_mean, raw_var)
        object.__setattr__(self, "classes", classes)
        object.__setattr__(self, "counts", counts)
        object.__setattr__(self, "_raw_mean", raw_mean)  # not fields: a snapshot keeps (and restores) the four above
        object.__setattr__(self, "_raw_var", raw_var)

    @property
    def dim(self) -> int:
        return int(self.raw_mean.shape[1])

    @property
    def raw_mean(self) -> np.ndarray:
        """The means as held (float16, float32 or float64)."""
        return self.__dict__["_raw_mean"]

    @property
    def raw_var(self) -> np.ndarray:
        """The variances as held (float16, float32 or float64)."""
        return self.__dict__["_raw_var"]

    @classmethod
    def _merged(cls, classes: np.ndarray, counts: np.ndarray, mean: np.ndarray, var: np.ndarray) -> ClassMoments:
        """A merge's result of checked parts of at most float32 (merge_moments): unique sorted
        classes, counts >= 1, variances >= 0 by construction, and finite, since float64 sums of
        float32 values and their squares times int64 counts cannot overflow; not checked again."""
        m = object.__new__(cls)
        for name, value in (("classes", classes), ("counts", counts), ("_raw_mean", mean), ("_raw_var", var)):
            object.__setattr__(m, name, value)
        return m

    @classmethod
    def empty(cls, dim: int) -> ClassMoments:
        """No classes yet (a device with no data still reports its feature dimension)."""
        z = np.zeros((0, dim))
        return cls(np.zeros(0, np.int64), np.zeros(0, np.int64), z, z.copy())


ClassMoments.mean = property(lambda self: np.asarray(self.raw_mean, dtype=np.float64),  # type: ignore[assignment]
                             doc="Class means, float64 (widened on access from a narrower dtype held).")
ClassMoments.var = property(lambda self: np.asarray(self.raw_var, dtype=np.float64),  # type: ignore[assignment]
                            doc="Unbiased class variances, float64 (widened on access from a narrower dtype held).")


def _held(values: Any) -> np.ndarray:
    """An array of RAW_FLOATS as it is; anything else as float64 (a copy, as ever)."""
    a = np.asarray(values)
    return a if a.dtype in RAW_FLOATS and a.dtype.isnative else np.asarray(a, dtype=np.float64)


def _check_shapes(classes: np.ndarray, counts: np.ndarray, mean: np.ndarray, var: np.ndarray) -> None:
    """Reject malformed moments early: a bad merge input would silently corrupt every tier above."""
    k = len(classes)
    if counts.shape != (k,):
        raise ValueError(f"counts shape {counts.shape} != ({k},)")
    if mean.ndim != 2 or mean.shape[0] != k or var.shape != mean.shape:
        raise ValueError(f"mean {mean.shape} / var {var.shape} must both be [{k}, D]")
    named = classes.tolist()  # a set of k ints: cheaper than np.unique for a message's few classes
    if len(set(named)) != k or (k and min(named) < 0):
        raise ValueError("classes must be unique and >= 0")
    if k and counts.min() < 1:
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
            raise RoundFailed(NON_FINITE_FEATURES)
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

    One float64 accumulation per call: the result's mean and M2 and one scratch pair are
    allocated once, every part is added in place (its rows as a slice when its classes are
    consecutive ones of the union), and the parts' arrays are read as held (f4/f2 widened
    inside each operation, never copied whole). The operations and their order per element
    are those of the plain formula (mean += mu_k * (n_k / n); M2 += (n_k - 1) var_k +
    n_k (mu_k - mean)^2, parts in order), so the result is the same to the bit.
    """
    if not parts:
        raise ValueError("merge_moments needs at least one part")
    dims = {p.dim for p in parts}
    if len(dims) != 1:
        raise ValueError(f"parts have different feature dimensions: {sorted(dims)}")
    dim = dims.pop()
    classes = np.unique(np.concatenate([p.classes for p in parts]))
    rows = [_rows_of(classes, p.classes) for p in parts]
    n = np.zeros(len(classes), dtype=np.int64)
    for p, at in zip(parts, rows):
        n[at] += p.counts
    widest = max((len(p.classes) for p in parts), default=0)
    mean, m2 = np.zeros((len(classes), dim)), np.zeros((len(classes), dim))
    scratch, scratch2 = np.empty((widest, dim)), np.empty((widest, dim))
    for p, at in zip(parts, rows):
        k = len(p.classes)
        if k:
            term = np.multiply(p.raw_mean, (p.counts / n[at])[:, None], out=scratch[:k])
            _add_rows(mean, at, term)
    for p, at in zip(parts, rows):
        k = len(p.classes)
        if not k:
            continue
        counts = p.counts.astype(np.float64)[:, None]
        within = np.multiply(p.raw_var, counts - 1.0, out=scratch[:k])
        between = np.subtract(p.raw_mean, mean[at], out=scratch2[:k])
        np.square(between, out=between)
        np.multiply(between, counts, out=between)
        np.add(within, between, out=within)
        _add_rows(m2, at, within)
    var = _var_from_m2_inplace(m2, n)
    if all(p.raw_mean.itemsize <= 4 and p.raw_var.itemsize <= 4 for p in parts):
        return ClassMoments._merged(classes, n, mean, var)
    return ClassMoments(classes, n, mean, var)  # float64 parts can overflow: checked as ever


def _rows_of(classes: np.ndarray, part: np.ndarray) -> slice | np.ndarray:
    """The rows of `classes` (sorted, unique) holding `part`'s classes: a slice when they are
    consecutive rows in order (the usual case: a view, no gather or scatter copy), else an index array."""
    at = np.searchsorted(classes, part)
    rows = at.tolist()
    if rows and rows == list(range(rows[0], rows[0] + len(rows))):
        return slice(rows[0], rows[0] + len(rows))
    return at


def _add_rows(acc: np.ndarray, at: slice | np.ndarray, term: np.ndarray) -> None:
    """acc[at] += term, in place for a slice (an index array gathers, adds and scatters: the same sums)."""
    if isinstance(at, slice):
        np.add(acc[at], term, out=acc[at])
    else:
        acc[at] += term


def _var_from_m2_inplace(m2: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """_var_from_m2 written into `m2` (the same values, no temporaries)."""
    np.maximum(m2, 0.0, out=m2)
    np.divide(m2, np.maximum(counts - 1, 1)[:, None].astype(np.float64), out=m2)
    m2[counts <= 1] = 0.0
    return m2


def moments_to_body(m: ClassMoments, dtype: str = "f4", *, space: str = "wc",
                    versions: Mapping[str, int] | None = None) -> dict[str, Any]:
    """Body of a `moments` message for feature `space`, computed with the model `versions`;
    mean/var cast to the wire dtype, all little-endian."""
    if dtype not in WIRE_DTYPES:
        raise ValueError(f"dtype must be one of {sorted(WIRE_DTYPES)}, got {dtype!r}")
    with np.errstate(over="ignore"):  # overflow is reported below as a ValueError
        mean = np.ascontiguousarray(m.raw_mean, dtype=WIRE_DTYPES[dtype])  # as held: f4 -> f8 -> wire is f4 -> wire
        var = np.ascontiguousarray(m.raw_var, dtype=WIRE_DTYPES[dtype])
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


# -- robust merges (an option; the exact merge above stays the default) ---------------------

ROBUST_MERGES = ("none", "clip", "trimmed", "median")
"""How moments of several sources (devices at an edge, edges at the cloud) are combined:
"none" the exact merge; "clip" each source's class mean pulled back to within `clip_k` reference
standard deviations (and its variance capped likewise) before the exact merge; "trimmed" a
coordinate-wise count-weighted mean of the sources left after dropping the `trim` fraction with
the smallest and largest values at each end; "median" the same with only the middle one or two
sources left."""


def robust_merge(parts: Sequence[ClassMoments], how: str = "none", *, reference: ClassMoments | None = None,
                 clip_k: float = 2.0, trim: float = 0.2) -> ClassMoments:
    """Merge `parts` by `how` (ROBUST_MERGES). "none" is merge_moments itself (bit for bit).

    Counts are always the exact sums (they are bounded by what each sender announced); only
    means and variances are made robust. With at most two sources holding a class, "trimmed"
    and "median" cannot tell an outlier from the others and merge that class exactly."""
    if how == "none":
        return merge_moments(parts)
    if how == "clip":
        return clipped_merge(parts, reference, k=clip_k)
    if how in ("trimmed", "median"):
        return trimmed_merge(parts, lambda m: dropped(how, m, trim))
    raise ValueError(f"robust merge must be one of {ROBUST_MERGES}, got {how!r}")


def dropped(how: str, m: int, trim: float = 0.2) -> int:
    """Sources dropped at each end of `m` by "trimmed" (ceil(trim m)) or "median" (all but the
    middle one (m odd) or two (m even)); never so many that nothing is left; 0 for other rules.
    The one count every robust merge (moments, head statistics, weights, tables) trims by."""
    if how == "median":
        return (m - 1) // 2
    return min(math.ceil(trim * m - 1e-9), (m - 1) // 2) if how == "trimmed" else 0


def _sources(parts: Sequence[ClassMoments]) -> tuple[int, np.ndarray, list[list[tuple[int, int]]]]:
    """Feature dimension, the union of classes, and per class the (part, row) pairs holding it."""
    if not parts:
        raise ValueError("a merge needs at least one part")
    dims = {p.dim for p in parts}
    if len(dims) != 1:
        raise ValueError(f"parts have different feature dimensions: {sorted(dims)}")
    classes = np.unique(np.concatenate([p.classes for p in parts]))
    rows: list[list[tuple[int, int]]] = [[] for _ in classes]
    for k, p in enumerate(parts):
        for i, j in enumerate(np.searchsorted(classes, p.classes).tolist()):
            rows[j].append((k, i))
    return dims.pop(), classes, rows


def trimmed_merge(parts: Sequence[ClassMoments], drop: Any) -> ClassMoments:
    """Coordinate-wise trimmed merge: per class and feature, the sources are ranked by their
    mean and `drop(m)` of the m sources are dropped at each end; the mean is the count-weighted
    mean of the rest. The variance is merged the same way: within-source variance pooled over
    the sources left after the same trimming by variance, plus the between-source term of the
    kept means,
        var = [(N_S - |S|) W + sum_S n_k (mu_k - mu)^2] / (N_S - 1),  W = sum_T (n_k-1) var_k / sum_T (n_k-1),
    which is the exact merge's formula when nothing is dropped."""
    dim, classes, rows = _sources(parts)
    counts = np.zeros(len(classes), dtype=np.int64)
    mean, var = np.zeros((len(classes), dim)), np.zeros((len(classes), dim))
    for j, held in enumerate(rows):
        n = np.array([parts[k].counts[i] for k, i in held], dtype=np.int64)
        mu = np.stack([parts[k].raw_mean[i] for k, i in held]).astype(np.float64, copy=False)  # rows, widened
        v = np.stack([parts[k].raw_var[i] for k, i in held]).astype(np.float64, copy=False)
        counts[j] = sum(int(c) for c in n)
        mean[j], var[j] = _trimmed_class(n.astype(np.float64), mu, v, int(drop(len(held))))
    return ClassMoments(classes, counts, mean, var)


def _trimmed_class(n: np.ndarray, mu: np.ndarray, v: np.ndarray, b: int) -> tuple[np.ndarray, np.ndarray]:
    """One class: n [m], mu and v [m, D]; b sources dropped at each end of every coordinate."""
    m = len(n)
    b = max(0, min(b, (m - 1) // 2))
    by_count = np.argsort(n, kind="stable")  # equal values rank by count: the merge is then order-free
    n, mu, v = n[by_count], mu[by_count], v[by_count]
    if b == 0:
        keep_mu, keep_v = mu, v
        n_mu = n_v = np.broadcast_to(n[:, None], mu.shape)
    else:
        by_mean = np.argsort(mu, axis=0, kind="stable")[b:m - b]
        by_var = np.argsort(v, axis=0, kind="stable")[b:m - b]
        keep_mu, n_mu = np.take_along_axis(mu, by_mean, 0), n[by_mean]
        keep_v, n_v = np.take_along_axis(v, by_var, 0), n[by_var]
    total = n_mu.sum(axis=0)
    centre = (n_mu * keep_mu).sum(axis=0) / total
    dof_v = (n_v - 1).sum(axis=0)
    within = np.divide((n_v - 1) * keep_v, dof_v, out=np.zeros_like(keep_v), where=dof_v > 0).sum(axis=0)
    m2 = (total - len(keep_mu)) * within + (n_mu * np.square(keep_mu - centre)).sum(axis=0)
    spread = np.divide(np.maximum(m2, 0.0), total - 1, out=np.zeros_like(m2), where=total > 1)
    return centre, spread


SPREAD_ROUNDOFF = 1e-12
"""A reference variance below this times (1 + ||mean||^2) is float round-off, not spread."""


def clipped_merge(parts: Sequence[ClassMoments], reference: ClassMoments | None, *, k: float) -> ClassMoments:
    """Exact merge of the parts after clipping each class mean to within k reference standard
    deviations of the reference mean, ||mu_k - mu_ref|| <= k sqrt(sum_d var_ref) (the mean is
    moved towards the reference onto that sphere), and scaling a variance whose total exceeds
    k^2 sum_d var_ref down to it. The reference is the caller's running one (the last merge of
    the same feature space and model version); for a class it lacks, the coordinate-wise
    median of this merge's sources. A class whose reference variance is 0 is not clipped.
    A part nothing is clipped from enters the exact merge unchanged."""
    dim, classes, rows = _sources(parts)
    ref_mean, ref_var = np.full((len(classes), dim), np.nan), np.zeros((len(classes), dim))
    if reference is not None and reference.dim == dim:
        row = {c: i for i, c in enumerate(reference.classes.tolist())}
        for j, c in enumerate(classes.tolist()):
            if c in row:
                ref_mean[j], ref_var[j] = reference.mean[row[c]], reference.var[row[c]]
    missing = np.isnan(ref_mean).any(axis=1)
    if missing.any():
        fallback = trimmed_merge(parts, lambda m: dropped("median", m))
        ref_mean[missing], ref_var[missing] = fallback.mean[missing], fallback.var[missing]
    # a reference spread no larger than the round-off of merging means of this size is none: a
    # median source with variance 0, shifted by 1e3, came back as 1e-10, and clipping to that
    # radius pulled every source onto the centre
    total = ref_var.sum(axis=1)
    ref_spread = np.where(total > SPREAD_ROUNDOFF * (1.0 + np.square(ref_mean).sum(axis=1)), total, 0.0)
    clipped = []
    for p in parts:
        at = np.searchsorted(classes, p.classes)
        centre, spread = ref_mean[at], ref_spread[at]
        p_mean, p_var = p.mean, p.var  # float64, widened once
        radius = k * np.sqrt(spread)
        dist = np.sqrt(np.square(p_mean - centre).sum(axis=1))
        over = (dist > radius) & (spread > 0)
        total_var = p_var.sum(axis=1)
        too_wide = (total_var > k * k * spread) & (spread > 0)
        if not (over.any() or too_wide.any()):
            clipped.append(p)
            continue
        mean, var = p_mean.copy(), p_var.copy()
        mean[over] = centre[over] + (p_mean[over] - centre[over]) * (radius[over] / dist[over])[:, None]
        var[too_wide] = p_var[too_wide] * (k * k * spread[too_wide] / total_var[too_wide])[:, None]
        clipped.append(ClassMoments(p.classes, p.counts, mean, var))
    return merge_moments(clipped)


def rows_in(whole: PerClassStats, part: ClassMoments) -> np.ndarray:
    """The row of `whole` holding each of `part`'s classes; ValueError unless `part` has
    `whole`'s dimension and only classes `whole` has (as when `part` was merged into it)."""
    at = np.searchsorted(whole.classes, part.classes)
    if part.dim != whole.dim or (at >= len(whole.classes)).any() or (whole.classes[at] != part.classes).any():
        raise ValueError("the part's classes and dimension must be in the whole")
    return at


def moments_without(whole: ClassMoments, part: ClassMoments) -> ClassMoments | None:
    """The moments of `whole`'s samples that are not `part`'s (`part` merged into `whole`
    before): counts and sums subtracted exactly, in float64. Classes left with no sample are
    dropped (None if none is left); variances lost to rounding are clipped at 0."""
    at = rows_in(whole, part)
    w_mean, p_mean = whole.mean, part.mean  # float64, widened once
    n, s1 = whole.counts.copy(), w_mean * whole.counts[:, None]
    ss = np.maximum(whole.counts - 1, 0)[:, None] * whole.var + whole.counts[:, None] * np.square(w_mean)
    if (n[at] < part.counts).any():
        raise ValueError("the part counts more samples of a class than the whole")
    n[at] -= part.counts
    s1[at] -= p_mean * part.counts[:, None]
    ss[at] -= np.maximum(part.counts - 1, 0)[:, None] * part.var + part.counts[:, None] * np.square(p_mean)
    keep = n > 0
    if not keep.any():
        return None
    n, s1, ss = n[keep], s1[keep], ss[keep]
    mean = s1 / n[:, None]
    return ClassMoments(whole.classes[keep], n, mean, _var_from_m2(ss - n[:, None] * np.square(mean), n))
