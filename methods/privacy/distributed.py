"""Distributed differential privacy: devices share the noise of one release behind a secure sum.

With local DP (dp.py, `dp_devices` 1) every device adds the run's whole noise, N(0, (sigma
Delta)^2) per scaled coordinate, so the sum an edge merges from m devices carries sqrt(m) times
the noise that makes any one of them private. Behind secure aggregation the edge sees only that
sum, so each device may add a share of it (Kairouz et al. 2021, "The distributed discrete
Gaussian mechanism"; here continuous Gaussians encoded in fixed point):

    each device: noise N(0, (sigma Delta)^2 / t) with t = the run's `dp_devices`
    the sum of m >= t devices: N(0, (sigma Delta)^2 m / t), at least the noise of one release

One image changes one device's contribution, hence the sum, by at most Delta (per-class
statistics: the release's sensitivity; weights: 2 x dp_update_clip, each device weighed alike),
so the sum is a Gaussian mechanism with multiplier sigma sqrt(m / t) >= sigma: the accountant's
epsilon for sigma holds against the edge, the cloud and the broker. (Up to the fixed-point
rounding: the edge sees the sum of each device's rounded noisy values, not the rounding of the
noisy sum. Kairouz et al. make this exact by rounding the data first and adding discrete
Gaussian noise on the integer grid, at the price of sqrt(d) grid steps of sensitivity; here a
step is 2^-24 against a clip of order 1, so the difference is of order sqrt(d) 2^-24 relative
(4e-6 for 10 x 512 values), well below what the accountant rounds, but it is not proven here.) It holds as long as at least
t devices whose noise the observer does not know are in the sum: the edge aborts a sum of fewer
(secagg.py `min_survivors`, which every device checks too before it reveals a share), and t
counts honest devices, so with c devices colluding with the edge choose t <= m - c.

What differs from a local release, and why:
- A device sends its RAW noisy sums over every class (counts as floats, sums, second moments),
  never post-processed on its own: a device's own release is only private at sigma / sqrt(t),
  so nothing computed from it alone may leave it (no per-device class filter, no withheld
  report, no clustering signal: a method with such a message is refused, DevicePart.clear_private).
- The edge post-processes the SUM as dp.py post-processes one release (kept classes by the
  sum's noisy count, integer counts, means onto the clip's ball, variances into [0, C^2]), then
  applies the run's minimum count per class and caps the counts to the contributors' announced
  samples. All of that is post-processing: it costs no privacy.
- Weights are averaged with every device alike (a device's sample count would scale its update,
  and so its sensitivity, beyond what the shared noise covers).
numpy only: a thin device runs its half.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from splitedge.methods.calibration.stats import symmetric_from_triu
from splitedge.methods.privacy.dp import SECONDS, NoisySums, capped_counts


def shares_noise(cfg: Any) -> bool:
    """Whether this run's devices add a share of the noise each (`dp_devices` > 1 with DP on)."""
    return getattr(cfg, "dp_sigma", 0.0) > 0 and int(getattr(cfg, "dp_devices", 1)) > 1


def device_sigma(cfg: Any) -> float:
    """The noise multiplier one device releases at: sigma, or sigma / sqrt(dp_devices) when it
    shares the noise of a secure sum."""
    return cfg.dp_sigma / math.sqrt(cfg.dp_devices) if shares_noise(cfg) else cfg.dp_sigma


def min_survivors(cfg: Any) -> int:
    """The fewest devices a secure sum may hold: dp_devices when they share the noise, else 1."""
    return int(cfg.dp_devices) if shares_noise(cfg) else 1


def release_sums(noisy: NoisySums) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """A device's raw release as the arrays a secure sum adds (float64: counts are noisy) and
    what the edge needs beside them to post-process the sum (its second moment's form, the clip)."""
    values = {"counts": np.asarray(noisy.counts, np.float64), "sums": np.asarray(noisy.sums, np.float64)}
    if noisy.sq is not None:
        sq = np.asarray(noisy.sq, np.float64)
        values["second"] = sq[np.triu_indices(sq.shape[0])] if noisy.second == "full" else sq
    return values, {"second": noisy.second, "clip": float(noisy.clip)}


def sum_release(values: Mapping[str, np.ndarray], form: Mapping[str, Any], *, sigma: float, share: int,
                devices: int) -> NoisySums:
    """The summed raw releases of `devices` devices as one release for dp.py's post-processing:
    its count noise sd is sigma sqrt(P) sqrt(devices / share) (P: the parts released). ValueError
    when the form or the arrays do not fit."""
    second, clip = form.get("second"), float(form.get("clip", 0))
    if second not in SECONDS or not clip > 0 or devices < 1 or share < 1:
        raise ValueError(f"a distributed DP sum needs a second moment form, clip > 0 and devices and share >= 1, "
                         f"got {second!r}, {clip}, {devices} and {share}")
    counts, sums = np.asarray(values["counts"], np.float64), np.asarray(values["sums"], np.float64)
    if counts.ndim != 1 or sums.ndim != 2 or len(sums) != len(counts):
        raise ValueError(f"counts [K] and sums [K, D] expected, got {counts.shape} and {sums.shape}")
    sq = None
    if second != "none":
        sq = np.asarray(values["second"], np.float64)
        if second == "full":
            dim = sums.shape[1]
            if sq.shape != (dim * (dim + 1) // 2,):
                raise ValueError(f"the second moment's upper triangle has {sq.shape}, not ({dim * (dim + 1) // 2},)")
            sq = symmetric_from_triu(sq, dim)
    parts = 2 if second == "none" else 3
    return NoisySums(counts, sums, sq, second, clip, sigma * math.sqrt(parts) * math.sqrt(devices / share))


def fitted(classes: np.ndarray, counts: np.ndarray, min_count: int,
           samples: int | None) -> tuple[np.ndarray, np.ndarray]:
    """(rows kept, their counts) of a post-processed sum: the run's minimum count per class on
    the summed noisy counts, then the counts capped to the contributors' announced `samples`
    (None: unknown, uncapped) so that the edge's samples bound holds."""
    rows = np.asarray(counts) >= min_count
    kept = np.asarray(counts)[rows].astype(np.int64)
    if samples is not None and len(kept) <= samples:
        kept = capped_counts(kept, samples)
    return rows, kept
