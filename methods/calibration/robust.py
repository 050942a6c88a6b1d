"""Robust merges of head statistics: what one source (a device at its edge, an edge at the cloud)
can do to the calibrated head is bounded, as for feature moments (methods/moments.py).

A source's record is its class means and its within-class covariance; the exact merge adds the
spread of the sources' class means around the merged ones (the between-source scatter). A
scaled record moves all three, so each rule bounds all three:

- "clip": the reference is this merge's own median (class means coordinate-wise, the covariance
  of median trace); each source's class means are pulled back to within `clip_k` reference
  standard deviations (sqrt of the reference trace) of the reference mean, a covariance whose
  trace exceeds `clip_k`^2 times the reference's is scaled down to it; then the exact merge.
- "trimmed" / "median": the class means are the coordinate-wise trimmed (count-weighted) means
  of the sources left after dropping `trim` of them (the median: all but the middle one or two)
  at each end; the within-class covariance is the count-weighted mean of the covariances left
  after dropping as many by trace at each end; in the between-source scatter each source's
  means are winsorised to the range of the means kept.

Counts stay exact sums: they are bounded by what each sender announced (runtime/inbound.py).
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import numpy as np

from splitedge.methods.calibration.stats import HeadStats, merge_head_stats
from splitedge.methods.moments import ROBUST_MERGES, dropped

Drop = Callable[[int], int]


def robust_head_merge(parts: Sequence[HeadStats], how: str = "none", *, clip_k: float = 2.0,
                      trim: float = 0.2) -> HeadStats:
    """Merge `parts` by `how` (ROBUST_MERGES); "none" is merge_head_stats itself, bit for bit."""
    if how not in ROBUST_MERGES:
        raise ValueError(f"robust merge must be one of {ROBUST_MERGES}, got {how!r}")
    if how == "none" or len(parts) < 2:
        return merge_head_stats(parts)
    if how == "clip":
        return merge_head_stats(clipped_sources(parts, clip_k))
    return trimmed_head_merge(parts, lambda m: dropped(how, m, trim))


def _classes(parts: Sequence[HeadStats]) -> tuple[np.ndarray, list[list[tuple[int, int]]]]:
    """The union of classes and, per class, the (source, row) pairs holding it."""
    if len({p.dim for p in parts}) != 1:
        raise ValueError("head statistics of different dimensions")
    classes = np.unique(np.concatenate([p.classes for p in parts]))
    rows: list[list[tuple[int, int]]] = [[] for _ in classes]
    for k, p in enumerate(parts):
        for i, j in enumerate(np.searchsorted(classes, p.classes).tolist()):
            rows[j].append((k, i))
    return classes, rows


def _by_trace(parts: Sequence[HeadStats], drop: int) -> list[int]:
    """The sources kept when `drop` covariances are dropped at each end of the trace ranking
    (ties ranked by count, then position, so the merge does not depend on arrival order)."""
    order = sorted(range(len(parts)), key=lambda k: (float(np.trace(parts[k].cov)), parts[k].total, k))
    return order[drop:len(parts) - drop]


def trimmed_head_merge(parts: Sequence[HeadStats], drop: Drop) -> HeadStats:
    """The trimmed rule of the module docstring; `drop(m)` sources are dropped at each end of m."""
    classes, rows = _classes(parts)
    dim = parts[0].dim
    counts = np.zeros(len(classes), dtype=np.int64)
    centre = np.zeros((len(classes), dim))
    between = np.zeros((dim, dim))
    for j, held in enumerate(rows):
        n = np.array([parts[k].counts[i] for k, i in held], dtype=np.float64)
        mu = np.stack([parts[k].mean[i] for k, i in held])
        counts[j] = int(n.sum())
        b = max(0, min(int(drop(len(held))), (len(held) - 1) // 2))
        ranked = np.sort(mu, axis=0)
        lo, hi = ranked[b], ranked[len(held) - 1 - b]
        kept = np.argsort(mu, axis=0, kind="stable")[b:len(held) - b]
        weights = n[kept]
        centre[j] = (weights * np.take_along_axis(mu, kept, 0)).sum(0) / weights.sum(0)
        d = np.clip(mu, lo, hi) - centre[j]  # winsorised to the kept range
        between += (d * n[:, None]).T @ d
    kept = _by_trace(parts, max(0, min(int(drop(len(parts))), (len(parts) - 1) // 2)))
    n_kept = np.array([parts[k].total for k in kept], dtype=np.float64)
    within = sum(parts[k].cov * w for k, w in zip(kept, n_kept)) / n_kept.sum()
    total = counts.sum()
    cov = within + between / total
    return HeadStats(classes, counts, centre, (cov + cov.T) / 2)


def clipped_sources(parts: Sequence[HeadStats], k: float) -> list[HeadStats]:
    """Each source with its class means clipped to the reference ball and its covariance's
    trace capped (the "clip" rule); a source nothing is clipped from is returned as it is."""
    classes, rows = _classes(parts)
    centre = np.stack([np.median(np.stack([parts[s].mean[i] for s, i in held]), axis=0) for held in rows])
    median_trace = float(np.trace(parts[_by_trace(parts, (len(parts) - 1) // 2)[0]].cov))
    radius = k * math.sqrt(max(median_trace, 0.0))
    out = []
    for p in parts:
        ref = centre[np.searchsorted(classes, p.classes)]
        dist = np.sqrt(np.square(p.mean - ref).sum(axis=1))
        over = dist > radius if radius > 0 else np.zeros(len(dist), bool)
        trace = float(np.trace(p.cov))
        too_wide = median_trace > 0 and trace > k * k * median_trace
        if not (over.any() or too_wide):
            out.append(p)
            continue
        mean = p.mean.copy()
        mean[over] = ref[over] + (p.mean[over] - ref[over]) * (radius / dist[over])[:, None]
        cov = p.cov * (k * k * median_trace / trace) if too_wide else p.cov
        out.append(HeadStats(p.classes, p.counts, mean, cov))
    return out
