"""Prototype merging (numpy only, so edges and the cloud need no torch).

The unweighted mean over devices composes across tiers when each tier forwards, per class,
its mean over devices together with the number of devices behind it: an edge sends
mean_e = sum_{d in e} p_d / m_e with counts = m_e (devices holding the class, NOT samples),
and the cloud's count-weighted mean sum_e m_e mean_e / sum_e m_e equals sum_d p_d / m exactly.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np


def merge_protos(parts: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray]], how: str = "none", *,
                 clip_k: float = 2.0, trim: float = 0.2) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """parts: (classes i8[K], weights i8[K], means [K, D]); returns (classes, summed weights,
    weighted means in float64) over the union of classes, sorted; `how` is the run's robust
    rule (methods/robust.py; "none": the weighted mean)."""
    if how != "none":
        from splitedge.methods.robust import robust_class_means

        return robust_class_means(parts, how, clip_k=clip_k, trim=trim)
    sums: dict[int, np.ndarray] = {}
    weights: dict[int, int] = {}
    for classes, counts, means in parts:
        for c, n, mu in zip(classes.tolist(), counts.tolist(), np.asarray(means, dtype=np.float64)):
            sums[c] = sums.get(c, 0.0) + n * mu
            weights[c] = weights.get(c, 0) + int(n)
    classes = np.array(sorted(sums), dtype=np.int64)
    counts = np.array([weights[c] for c in classes.tolist()], dtype=np.int64)
    if not len(classes):
        return classes, counts, np.zeros((0, 0))
    means = np.stack([sums[c] / weights[c] for c in classes.tolist()])
    return classes, counts, means


SPACE, PROTOS = "rep", "protos"
"""Prototypes live in the representation space f (loss.py) and are versioned as "protos"."""


def check_protos(body: Mapping[str, Any], num_classes: int, dim: int | None = None) -> int:
    """Refuse prototypes outside the representation space, the model's classes or the
    federation's dimension (`dim`; None: the first message sets it, for the numpy-only edge and
    cloud, which have no model to ask). Returns the dimension."""
    from splitedge.methods.checks import check_space, check_stats

    check_space(body, SPACE)
    dim = body["mean"].shape[1] if dim is None else dim
    check_stats(body, "mean", dim=dim, num_classes=num_classes)
    return dim


def protos_body(classes: np.ndarray, counts: np.ndarray, means: np.ndarray, dtype: str, version: int) -> dict[str, Any]:
    """A `moments` body with var = 0 (FedProto sends means only), in space "rep", computed
    with global prototypes of `version` (0: none yet)."""
    arr = np.ascontiguousarray(means, dtype=np.dtype(dtype).newbyteorder("<"))
    return {"classes": np.asarray(classes, dtype=np.int64), "counts": np.asarray(counts, dtype=np.int64),
            "mean": arr, "var": np.zeros_like(arr), "space": SPACE, "versions": {PROTOS: int(version)}}


def weighted_accuracy(infos: Sequence[Mapping[str, Any]], key: str = "accuracy") -> tuple[float, int]:
    """Sample-weighted mean of `key` (the personalised accuracy, or the effective rank) in done
    infos that have one, with the total `eval_samples`."""
    rows = [(float(i[key]), int(i["eval_samples"])) for i in infos
            if key in i and int(i.get("eval_samples", 0)) > 0]
    total = sum(n for _, n in rows)
    if not total:
        return float("nan"), 0
    return sum(a * n for a, n in rows) / total, total
