"""Robust merges of what a peer sends besides moments and head statistics: weight maps (every
method that averages models) and per-class mean tables without variances (FedProto's
prototypes, CFLHKD's class-mean logits). numpy only, so edges and the cloud run them.

The rules are the run's `robust` setting (ROBUST_MERGES), as for moments (methods/moments.py)
and head statistics (methods/calibration/robust.py):

- "none": the exact, count-weighted merge (average_states, bit for bit).
- "clip": norm clipping against the federation's own statistics. For weights, each source's
  *update* (its weights minus the model it trained from, `reference`) is clipped per tensor to
  `clip_k` times the median update norm of that tensor over the sources, then averaged and added
  to the reference. Per tensor, because a BatchNorm buffer and a convolution differ in scale by
  orders of magnitude and one norm over the whole map would let a scaled buffer hide in the
  convolutions' budget. For class-mean tables, each source's class mean is pulled back to within
  `clip_k` times the median distance of the sources from their coordinate-wise median.
- "trimmed": coordinate-wise, the `trim` fraction of sources with the smallest and largest
  values dropped at each end, the count-weighted mean of the rest.
- "median": the same with only the middle one or two sources left.

Trimming and the median move with a common shift of every source, so they are the same on
updates as on weights; only clipping needs the reference (without one: the coordinate-wise
median of the sources). With two sources no rule can tell the outlier from the other: trimming
keeps both, and clipping at `clip_k` >= 2 clips neither. Integer buffers (BatchNorm's
num_batches_tracked) take the maximum, as in the exact merge. Counts stay the exact sums; they
are bounded by what each sender announced (runtime/inbound.py).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from splitedge.methods.averaging import WeightMap, average_states, check_parts
from splitedge.methods.moments import ROBUST_MERGES, ClassMoments, dropped, trimmed_merge


def robust_average(parts: Sequence[tuple[WeightMap, int]], how: str = "none", *,
                   reference: WeightMap | None = None, clip_k: float = 2.0, trim: float = 0.2) -> dict[str, np.ndarray]:
    """Merge weight maps by `how` (module docstring); "none" is average_states itself. A
    `reference` lacking a name or of another shape is ignored for that tensor."""
    if how not in ROBUST_MERGES:
        raise ValueError(f"robust merge must be one of {ROBUST_MERGES}, got {how!r}")
    if how == "none" or len(parts) < 3:
        return average_states(parts)
    check_parts(parts)
    counts = np.array([float(n) for _, n in parts])
    by_count = np.argsort(counts, kind="stable")  # equal values rank by count: the merge is order-free
    counts = counts[by_count]
    out: dict[str, np.ndarray] = {}
    for name in parts[0][0]:
        first = np.asarray(parts[0][0][name])
        if first.dtype.kind != "f":
            out[name] = np.asarray(np.max(np.stack([w[name] for w, _ in parts]), axis=0), dtype=first.dtype)
            continue
        stacked = np.stack([np.asarray(parts[k][0][name], dtype=np.float64) for k in by_count.tolist()])
        ref = None if reference is None else reference.get(name)
        if how == "clip":
            merged = _clipped(stacked, counts, ref, clip_k)
        else:
            merged = _trimmed(stacked, counts, dropped(how, len(parts), trim))
        out[name] = np.asarray(merged, dtype=first.dtype)
    return out


def _trimmed(stacked: np.ndarray, counts: np.ndarray, b: int) -> np.ndarray:
    """Coordinate-wise count-weighted mean of stacked [m, ...] after dropping b at each end."""
    m = len(stacked)
    if b <= 0:
        return np.tensordot(counts / counts.sum(), stacked, axes=1)
    order = np.argsort(stacked, axis=0, kind="stable")[b:m - b]
    kept = np.take_along_axis(stacked, order, 0)
    weight = counts[order]
    return (weight * kept).sum(axis=0) / weight.sum(axis=0)


def _clipped(stacked: np.ndarray, counts: np.ndarray, ref: np.ndarray | None, k: float) -> np.ndarray:
    """ref + the count-weighted mean of the updates, each clipped to k x their median norm."""
    if ref is None or np.shape(ref) != stacked.shape[1:]:
        ref = np.median(stacked, axis=0)
    delta = stacked - np.asarray(ref, dtype=np.float64)
    norms = np.sqrt(np.square(delta).reshape(len(delta), -1).sum(axis=1))
    bound = k * float(np.median(norms))
    scale = np.divide(bound, norms, out=np.ones_like(norms), where=norms > bound)
    return ref + np.tensordot(counts * scale / counts.sum(), delta, axes=1)


def robust_class_means(parts: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray]], how: str = "none", *,
                       clip_k: float = 2.0, trim: float = 0.2) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """parts: (classes i8[K], counts i8[K], means [K, D]) per source; returns (classes, summed
    counts, merged means f8) over the union of classes, sorted. "none" is the count-weighted mean."""
    if how not in ROBUST_MERGES:
        raise ValueError(f"robust merge must be one of {ROBUST_MERGES}, got {how!r}")
    moments = [ClassMoments(np.asarray(c), np.asarray(n), np.asarray(mu, dtype=np.float64),
                            np.zeros(np.shape(mu))) for c, n, mu in parts if len(c)]
    if not moments:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros((0, 0))
    if how == "clip":
        moments = _clip_means(moments, clip_k)
    merged = trimmed_merge(moments, lambda m: dropped(how, m, trim))
    return merged.classes, merged.counts, merged.mean


def _clip_means(parts: list[ClassMoments], k: float) -> list[ClassMoments]:
    """Each source's class mean pulled back onto the ball of k x the median distance of the
    class's sources from their coordinate-wise median (a class held by fewer than three sources
    is left alone)."""
    holders: dict[int, list[tuple[int, int]]] = {}
    for s, p in enumerate(parts):
        for i, c in enumerate(p.classes.tolist()):
            holders.setdefault(c, []).append((s, i))
    means = [p.mean.copy() for p in parts]
    for held in holders.values():
        if len(held) < 3:
            continue
        mu = np.stack([parts[s].mean[i] for s, i in held])
        centre = np.median(mu, axis=0)
        dist = np.sqrt(np.square(mu - centre).sum(axis=1))
        bound = k * float(np.median(dist))
        for j, (s, i) in enumerate(held):
            if dist[j] > bound:
                means[s][i] = centre + (mu[j] - centre) * (bound / dist[j])
    return [ClassMoments(p.classes, p.counts, m, p.var) for p, m in zip(parts, means)]


def robust_rule(cfg: Any) -> dict[str, Any]:
    """The run's robust setting (a MethodConfig's) as keywords for the merges above."""
    return {"how": cfg.robust, "clip_k": cfg.robust_clip_k, "trim": cfg.robust_trim}
