"""What a device's statistics look like as sums, so that secure aggregation can add them up.

Secure aggregation (secagg.py) gives the edge only the sum over its devices of each array they
mask. The per-class statistics devices send are mean and variance forms of sums: here each
kind has its sum form over EVERY class of the federation (zeros for a class the device does not
hold, so the set of classes it holds is hidden too) and the way back from the summed form to
the message the edge's part merges as if one device had sent it.

    moments       counts i8[K], sums f8[K, D], sumsq f8[K, D]         -> ClassMoments
    prototypes    holders i8[K], sums f8[K, D] (of the device's means) -> means over devices
                  (FedProto weighs each device alike: holders counts the devices with the class)
    logits        counts i8[K], sums f8[K, C]                         -> count-weighted mean logits
    head stats    counts i8[K], sums f8[K, D], second f8[D(D+1)/2]     -> HeadStats (full cov)
                  (second: the upper triangle of sum x x^T over all the device's samples)
    weights       samples n, n x every array                           -> the weighted average

numpy only: thin devices use it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from splitedge.methods.calibration.stats import HeadStats, cov_form, head_stats_from_arrays, symmetric_from_triu
from splitedge.methods.moments import ClassMoments, moments_from_body


def _dense(classes: np.ndarray, counts: np.ndarray, mean: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    n = np.zeros(k, np.int64)
    sums = np.zeros((k, mean.shape[1]))
    n[classes] = counts
    sums[classes] = mean * counts[:, None]
    return n, sums


def moments_sums(body: Mapping[str, Any], num_classes: int) -> dict[str, np.ndarray]:
    """A `moments` body as its sums over every class."""
    m = moments_from_body(body)
    n, sums = _dense(m.classes, m.counts, m.mean, num_classes)
    sumsq = np.zeros_like(sums)
    sumsq[m.classes] = (m.counts - 1)[:, None] * m.var + m.counts[:, None] * np.square(m.mean)
    return {"counts": n, "sums": sums, "sumsq": sumsq}


def moments_of_sums(sums: Mapping[str, np.ndarray]) -> ClassMoments:
    """The moments of the union of the devices' data from their summed sums (classes present
    only); a variance the fixed-point rounding took below 0 is 0."""
    n, s, q = np.asarray(sums["counts"], np.int64), np.asarray(sums["sums"]), np.asarray(sums["sumsq"])
    present = np.flatnonzero(n > 0)
    if not len(present):
        return ClassMoments.empty(s.shape[1])
    cn = n[present].astype(np.float64)[:, None]
    mean = s[present] / cn
    m2 = np.maximum(q[present] - cn * np.square(mean), 0.0)
    var = np.where(cn > 1, m2 / np.maximum(cn - 1, 1), 0.0)
    return ClassMoments(present.astype(np.int64), n[present], mean, var)


def prototype_sums(body: Mapping[str, Any], num_classes: int) -> dict[str, np.ndarray]:
    """A device's prototypes (a `moments` body whose merge weighs devices alike) as, per class,
    1 and its mean where it has the class, zeros elsewhere."""
    m = moments_from_body(body)
    holders = np.zeros(num_classes, np.int64)
    sums = np.zeros((num_classes, m.mean.shape[1]))
    holders[m.classes], sums[m.classes] = 1, m.mean
    return {"holders": holders, "sums": sums}


def prototypes_of_sums(sums: Mapping[str, np.ndarray]) -> ClassMoments:
    """The mean over devices of their class means, with counts = the devices holding each class
    (what FedProto's edge forwards, methods/fedproto/protos.py); var is 0 (means only)."""
    n, s = np.asarray(sums["holders"], np.int64), np.asarray(sums["sums"])
    present = np.flatnonzero(n > 0)
    mean = s[present] / n[present].astype(np.float64)[:, None]
    return ClassMoments(present.astype(np.int64), n[present], mean, np.zeros_like(mean))


def logits_sums(body: Mapping[str, Any], num_classes: int) -> dict[str, np.ndarray]:
    """A `logits` body (class-wise mean logits with counts) as its sums over every class."""
    classes = np.asarray(body["classes"], np.int64)
    counts = np.asarray(body["counts"], np.int64)
    n, sums = _dense(classes, counts, np.asarray(body["logits"], np.float64), num_classes)
    return {"counts": n, "sums": sums}


def logits_of_sums(sums: Mapping[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(classes, counts, count-weighted mean logits) of the classes in the sum."""
    n, s = np.asarray(sums["counts"], np.int64), np.asarray(sums["sums"])
    present = np.flatnonzero(n > 0)
    return present.astype(np.int64), n[present], s[present] / n[present].astype(np.float64)[:, None]


def head_stats_sums(arrays: Mapping[str, Any], num_classes: int) -> dict[str, np.ndarray]:
    """A head-statistics record's arrays as sums over every class (the covariance travels as
    the upper triangle of the second moment; a diagonal record keeps its diagonal)."""
    h = head_stats_from_arrays(arrays)
    n, sums = _dense(h.classes, h.counts, h.mean, num_classes)
    second = h.cov * h.total + (h.mean * h.counts[:, None]).T @ h.mean  # sum over samples of x x^T
    diag = cov_form(arrays["cov"], h.dim) == "diag"
    return {"counts": n, "sums": sums, "second": np.diagonal(second).copy() if diag else second[np.triu_indices(h.dim)]}


def head_stats_of_sums(sums: Mapping[str, np.ndarray]) -> HeadStats:
    """HeadStats of the union from summed sums: cov = (sum x x^T - sum_c n_c mu_c mu_c^T) / n."""
    n, s, packed = np.asarray(sums["counts"], np.int64), np.asarray(sums["sums"]), np.asarray(sums["second"])
    dim = s.shape[1]
    present = np.flatnonzero(n > 0)
    counts = n[present]
    mean = s[present] / counts[:, None]
    between = (mean * counts[:, None]).T @ mean
    if cov_form(packed, dim) == "diag":
        cov = np.diag(np.maximum(packed - np.diagonal(between), 0.0) / max(int(counts.sum()), 1))
    else:
        cov = (symmetric_from_triu(packed, dim) - between) / max(int(counts.sum()), 1)
        cov = (cov + cov.T) / 2
    return HeadStats(present.astype(np.int64), counts, mean, cov)


def weights_sums(body: Mapping[str, Any], alike: bool = False) -> dict[str, np.ndarray]:
    """A `weights` body as sums: `samples` n, and n x each array (float64; integer buffers such
    as BatchNorm's batch counter too), so the sum over devices is FedAvg's numerator. `alike`:
    n = 1, every device weighed alike (distributed DP: its noise covers one device's update)."""
    n = 1 if alike else int(body["samples"])
    out = {"samples": np.array([n], np.int64)}
    for name, arr in body["weights"].items():
        out["w." + name] = np.asarray(arr, np.float64) * n
    return out


def weights_of_sums(sums: Mapping[str, np.ndarray], dtypes: Mapping[str, str]) -> tuple[int, dict[str, np.ndarray]]:
    """(total samples, the sample-weighted average of every array in its wire dtype) from summed
    sums. Integer buffers come out as their rounded weighted mean (a clear merge takes their
    maximum, which no sum can give); ValueError when no sample is in the sum."""
    total = int(np.asarray(sums["samples"]).reshape(-1)[0])
    if total < 1:
        raise ValueError("no sample in the sum")
    out = {}
    for name, dtype in dtypes.items():
        mean = np.asarray(sums["w." + name], np.float64) / total
        kind = np.dtype(dtype)
        out[name] = (np.rint(mean) if kind.kind in "iu" else mean).astype(kind)
    return total, out
