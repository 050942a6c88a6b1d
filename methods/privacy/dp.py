"""Differential privacy of what a device sends: clipping plus Gaussian noise, on the device.

numpy only (a thin device runs it); the accountant that turns a noise multiplier into epsilon
is in accountant.py, where dp-accounting can be imported.

One convention everywhere: the noise multiplier `sigma` is the noise standard deviation divided
by the release's L2 sensitivity, so one release is a Gaussian mechanism with multiplier `sigma`
and accountant.epsilon(sigma, releases, delta) is its guarantee, whatever was released.

Per-class statistics (sample-level DP, add/remove-one-image adjacency)
-----------------------------------------------------------------------
Each image's feature vector x is first clipped to ||x||_2 <= C (scaled by min(1, C/||x||)).
The device then releases, for EVERY class 0..K-1 of the federation (a class it does not hold is
released as pure noise, otherwise the set of classes sent would itself leak), some of

    counts  n_c        [K]       one image changes one entry by 1:            sensitivity 1
    sums    S_c        [K, D]    one row by the vector x, ||x|| <= C:         sensitivity C
    second moments, one of
      sumsq Q_c        [K, D]    one row by x*x (elementwise); ||x*x||_2 = sqrt(sum x_i^4)
                                 <= sum x_i^2 = ||x||^2 <= C^2:                 sensitivity C^2
      diag  sum x*x    [D]       shared over classes, the same bound:          sensitivity C^2
      full  sum x x^T  [D, D]    shared; released as its upper triangle, whose
                                 L2 norm is <= ||x x^T||_F = ||x||^2 <= C^2:    sensitivity C^2

Each part divided by its sensitivity changes by at most 1 in L2, so the concatenation of the P
scaled parts changes by at most sqrt(P) (sqrt(3) for moments and head statistics, sqrt(2) for
class means). ONE Gaussian mechanism is applied to that concatenation: N(0, (sigma sqrt(P))^2)
on every scaled coordinate, i.e. noise of standard deviation sigma sqrt(P) Delta_i on part i in
its own units. Clipping and the release are independent of how the device batches its images.

Everything after the noise is post-processing and costs no privacy: classes whose noisy count
is below max(1, keep_sd * sigma sqrt(P)) are dropped (default keep_sd = 2: an absent class
survives with probability ~2.3 %; with sigma = 0 exactly the classes held are kept); counts are
rounded to integers >= 1 (never capped to the device's true sample count: the released total
exceeds it as often as the noise makes it); means are projected onto the ball ||mu|| <= C (where all clipped
features live); variances are clipped to [0, C^2] and a covariance's eigenvalues likewise.
Note a minimum count per class applied to the TRUE counts before the mechanism (floor.py) is
not DP (one image can move a whole class in or out); with DP on, this noisy-count rule
replaces it.

Weight updates (device-level local DP)
--------------------------------------
DP-FedAvg's clip-and-noise, done by each device on its own update (the edge is not trusted):
delta = weights - start is scaled to ||delta||_2 <= S over all float tensors, and the device
sends start + delta + noise. Any two datasets of the device (not just two differing in one
image) give clipped updates at most 2S apart, so the sensitivity is 2S and the noise is
N(0, (sigma 2S)^2) per coordinate. The guarantee is local DP of the update under
replace-the-device's-whole-dataset adjacency, which implies the same (epsilon, delta) for one
image. (Central DP-FedAvg adds N(0, (z S)^2) once to the SUM over devices, with add/remove-a-device
adjacency; that needs a trusted aggregator or secure aggregation.) Non-float entries (e.g.
BatchNorm's num_batches_tracked, which counts batches and so images) are sent as in `start`.

Randomness: pass an np.random.Generator seeded from OS entropy on a real device (the default);
a seed anyone can know makes the noise removable. Textbook floating-point Gaussian sampling is
known to leak through its low bits (Mironov 2012); this implementation does not address that.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from splitedge.methods.calibration.stats import HeadStats, symmetric_from_triu
from splitedge.methods.errors import NON_FINITE_FEATURES, RoundFailed
from splitedge.methods.moments import ClassMoments

Second = Literal["none", "class", "diag", "full"]
"""Which second moment a release carries: none (class means), per class sum of squares
(moments), or the shared diagonal / full second-moment matrix (head statistics)."""
SECONDS = ("none", "class", "diag", "full")
KEEP_SD = 2.0
"""Default rule: keep a class whose noisy count is at least max(1, KEEP_SD count-noise sds)."""


def clip_rows(x: np.ndarray, clip: float) -> np.ndarray:
    """Each row scaled by min(1, clip / ||row||_2) (float64); rows within the bound are unchanged."""
    if not clip > 0:
        raise ValueError(f"clip must be > 0, got {clip}")
    x = np.asarray(x, dtype=np.float64)
    norms = np.linalg.norm(x, axis=1)
    over = norms > clip
    scale = np.divide(clip, norms, out=np.ones_like(norms), where=over)
    return np.where(over[:, None], x * scale[:, None], x)


def gaussian_mechanism(parts: Sequence[tuple[np.ndarray, float]], sigma: float,
                       rng: np.random.Generator | None = None) -> list[np.ndarray]:
    """The one mechanism: `parts` are (exact query, its L2 sensitivity); one record changes every
    part by at most its sensitivity at once, so the scaled concatenation has sensitivity
    sqrt(len(parts)) and part i gets N(0, (sigma sqrt(P) Delta_i)^2) noise. sigma = 0: no noise."""
    if sigma < 0 or not math.isfinite(sigma):
        raise ValueError(f"sigma must be finite and >= 0, got {sigma}")
    if sigma == 0:
        return [np.array(q, dtype=np.float64) for q, _ in parts]
    rng = rng if rng is not None else np.random.default_rng()
    scale = sigma * math.sqrt(len(parts))
    return [np.asarray(q, dtype=np.float64) + rng.normal(0.0, scale * sens, np.shape(q)) for q, sens in parts]


def _triu(dim: int) -> tuple[np.ndarray, np.ndarray]:
    return np.triu_indices(dim)


class ClippedSums:
    """Exact per-class sums of clipped features over every class 0..K-1 of the federation:
    the query the mechanism noises. Streams batches (`add`), like the other accumulators."""

    def __init__(self, dim: int, num_classes: int, clip: float, second: Second = "class") -> None:
        if dim < 1 or num_classes < 1:
            raise ValueError(f"dim and num_classes must be >= 1, got {dim}, {num_classes}")
        if second not in SECONDS:
            raise ValueError(f"second must be one of {SECONDS}, got {second!r}")
        if not clip > 0:
            raise ValueError(f"clip must be > 0, got {clip}")
        self.dim, self.num_classes, self.clip, self.second = dim, num_classes, float(clip), second
        self.counts = np.zeros(num_classes)
        self.sums = np.zeros((num_classes, dim))
        shapes = {"none": None, "class": (num_classes, dim), "diag": (dim,), "full": (dim, dim)}
        self.sq = None if shapes[second] is None else np.zeros(shapes[second])

    def add(self, features: np.ndarray, labels: np.ndarray) -> None:
        """A batch: features [N, D], integer labels [N] in 0..K-1."""
        x = np.asarray(features, dtype=np.float64)
        y = np.asarray(labels)
        if x.ndim != 2 or x.shape[1] != self.dim or y.shape != (len(x),):
            raise ValueError(f"features must be [N, {self.dim}] with labels [N], got {x.shape}, {y.shape}")
        if len(y) and (not np.issubdtype(y.dtype, np.integer) or y.min() < 0 or y.max() >= self.num_classes):
            raise ValueError(f"labels must be integers in 0..{self.num_classes - 1}")
        if not np.isfinite(x).all():
            raise RoundFailed(NON_FINITE_FEATURES)
        x = clip_rows(x, self.clip)
        np.add.at(self.counts, y, 1.0)
        np.add.at(self.sums, y, x)
        if self.second == "class":
            np.add.at(self.sq, y, np.square(x))
        elif self.second == "diag":
            self.sq += np.square(x).sum(axis=0)
        elif self.second == "full":
            self.sq += x.T @ x

    def parts(self) -> list[tuple[np.ndarray, float]]:
        """(query, L2 sensitivity) pairs; the full second moment as its upper triangle."""
        c = self.clip
        out = [(self.counts, 1.0), (self.sums, c)]
        if self.second == "full":
            out.append((self.sq[_triu(self.dim)], c * c))
        elif self.sq is not None:
            out.append((self.sq, c * c))
        return out

    def release(self, sigma: float, rng: np.random.Generator | None = None) -> NoisySums:
        """The noised sums (the only thing that may leave the device)."""
        noisy = gaussian_mechanism(self.parts(), sigma, rng)
        sq = noisy[2] if len(noisy) > 2 else None
        if self.second == "full":
            sq = symmetric_from_triu(sq, self.dim)
        return NoisySums(noisy[0], noisy[1], sq, self.second, self.clip, sigma * math.sqrt(len(noisy)))


@dataclass(frozen=True, eq=False)
class NoisySums:
    """A release: noisy counts f8[K], sums f8[K, D], second moment (None, [K, D], [D] or [D, D]),
    the clip C and the count's noise sd (sigma sqrt(P)); the adapters below post-process it."""

    counts: np.ndarray
    sums: np.ndarray
    sq: np.ndarray | None
    second: str
    clip: float
    count_sd: float

    def kept(self, keep_sd: float = KEEP_SD) -> np.ndarray:
        """Classes (i8, sorted) whose noisy count is >= max(1, keep_sd * count_sd)."""
        return np.flatnonzero(self.counts >= max(1.0, keep_sd * self.count_sd)).astype(np.int64)

    def means(self, classes: np.ndarray) -> np.ndarray:
        """Noisy sums over noisy counts, projected onto the ball of radius C."""
        mu = self.sums[classes] / np.maximum(self.counts[classes], 1.0)[:, None]
        norms = np.linalg.norm(mu, axis=1)
        return np.where((norms > self.clip)[:, None], mu * (self.clip / np.maximum(norms, 1e-300))[:, None], mu)


def _int_counts(noisy: np.ndarray) -> np.ndarray:
    return np.maximum(np.rint(noisy), 1).astype(np.int64)


def capped_counts(counts: np.ndarray, samples: int) -> np.ndarray:
    """Noisy integer counts (>= 1) scaled down, when their total exceeds `samples`, a bound public
    to whoever applies it (an edge: the samples a device's hello announced, its manifest entry;
    never the device's true count, release.py), so that an edge's samples bound holds; each
    stays >= 1 (needs len <= samples)."""
    total = int(counts.sum())
    if total <= samples or not len(counts):
        return counts
    scaled = np.maximum(np.floor(counts * (samples / total)), 1).astype(np.int64)
    while int(scaled.sum()) > samples:  # the floors of 1 may still overshoot: take from the largest
        scaled[int(np.argmax(scaled))] -= 1
    return scaled


def moments_from(noisy: NoisySums, keep_sd: float = KEEP_SD) -> ClassMoments:
    """ClassMoments of the kept classes: mean S/n, unbiased var (Q - n mu^2)/(n - 1) clipped to
    [0, C^2] (0 when n < 2, as for one sample), integer counts >= 1."""
    if noisy.second != "class":
        raise ValueError("moments need per-class sums of squares (second='class')")
    k = noisy.kept(keep_sd)
    n = noisy.counts[k]
    raw = noisy.sums[k] / n[:, None]
    var = (noisy.sq[k] - n[:, None] * np.square(raw)) / np.maximum(n - 1.0, 1.0)[:, None]
    var = np.where((n >= 2)[:, None], np.clip(var, 0.0, noisy.clip ** 2), 0.0)
    if not len(k):
        return ClassMoments.empty(noisy.sums.shape[1])
    return ClassMoments(k, _int_counts(n), noisy.means(k), var)


def head_stats_from(noisy: NoisySums, keep_sd: float = KEEP_SD) -> HeadStats:
    """HeadStats of the kept classes: cov = (sum x x^T - sum_c n_c mu_c mu_c^T) / sum_c n_c with
    its eigenvalues (a diagonal's entries) clipped to [0, C^2]. May hold no class: such a record
    is not sent (check_head_stats refuses it); that choice sees only the release."""
    if noisy.second not in ("diag", "full"):
        raise ValueError("head statistics need the shared second moment (second='diag' or 'full')")
    k = noisy.kept(keep_sd)
    n = noisy.counts[k]
    dim = noisy.sums.shape[1]
    if not len(k):
        return HeadStats(k, np.zeros(0, np.int64), np.zeros((0, dim)), np.zeros((dim, dim)))
    raw = noisy.sums[k] / n[:, None]
    total = float(n.sum())
    limit = noisy.clip ** 2
    if noisy.second == "diag":
        cov = np.diag(np.clip((noisy.sq - (n[:, None] * np.square(raw)).sum(axis=0)) / total, 0.0, limit))
    else:
        cov = (noisy.sq - (raw * n[:, None]).T @ raw) / total
        cov = (cov + cov.T) / 2
        values, vectors = np.linalg.eigh(cov)
        if values.min() < 0 or values.max() > limit:
            cov = (vectors * np.clip(values, 0.0, limit)) @ vectors.T
    return HeadStats(k, _int_counts(n), noisy.means(k), cov)


def class_means_from(noisy: NoisySums, keep_sd: float = KEEP_SD) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(classes i8[K'], counts i8[K'] >= 1, means f8[K', D]) of the kept classes: prototypes
    (fedproto/protos.py protos_body) and mean logits (cflhkd) take these."""
    k = noisy.kept(keep_sd)
    return k, _int_counts(noisy.counts[k]), noisy.means(k)


def _sums(features: np.ndarray, labels: np.ndarray, num_classes: int, clip: float, second: Second) -> ClippedSums:
    x = np.asarray(features)
    x = x.reshape(len(x), int(np.prod(x.shape[1:])))
    acc = ClippedSums(x.shape[1], num_classes, clip, second)
    acc.add(x, labels)
    return acc


def dp_moments(features: np.ndarray, labels: np.ndarray, num_classes: int, *, clip: float, sigma: float,
               rng: np.random.Generator | None = None, keep_sd: float = KEEP_SD) -> ClassMoments:
    """Per-class moments (H-SFP `moments`) of features [N, ...] under the mechanism above."""
    return moments_from(_sums(features, labels, num_classes, clip, "class").release(sigma, rng), keep_sd)


def dp_head_stats(features: np.ndarray, labels: np.ndarray, num_classes: int, *, clip: float, sigma: float,
                  rng: np.random.Generator | None = None, cov: Literal["full", "diag"] = "full",
                  keep_sd: float = KEEP_SD) -> HeadStats:
    """Head statistics (calibration/stats.py) with the covariance the run sends (`calib_cov`)."""
    return head_stats_from(_sums(features, labels, num_classes, clip, cov).release(sigma, rng), keep_sd)


def dp_class_means(features: np.ndarray, labels: np.ndarray, num_classes: int, *, clip: float, sigma: float,
                   rng: np.random.Generator | None = None,
                   keep_sd: float = KEEP_SD) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-class counts and means (FedProto prototypes, CFLHKD mean logits)."""
    return class_means_from(_sums(features, labels, num_classes, clip, "none").release(sigma, rng), keep_sd)


# -- weight updates ----------------------------------------------------------------------------

def _floats(start: Mapping[str, np.ndarray]) -> list[str]:
    return [k for k in start if np.asarray(start[k]).dtype.kind == "f"]


def clip_update(weights: Mapping[str, np.ndarray], start: Mapping[str, np.ndarray],
                clip: float) -> dict[str, np.ndarray]:
    """delta = weights - start over the float entries (float64), scaled to global L2 norm <= clip."""
    if not clip > 0:
        raise ValueError(f"clip must be > 0, got {clip}")
    if set(weights) != set(start):
        raise ValueError("weights and start hold different tensors")
    delta = {k: np.asarray(weights[k], np.float64) - np.asarray(start[k], np.float64) for k in _floats(start)}
    norm = math.sqrt(sum(float(np.square(d).sum()) for d in delta.values()))
    if not math.isfinite(norm):
        raise RoundFailed("local training diverged (the update is not finite): nothing is released this round")
    scale = min(1.0, clip / norm) if norm > 0 else 1.0
    return {k: d * scale for k, d in delta.items()}


def dp_weights(weights: Mapping[str, np.ndarray], start: Mapping[str, np.ndarray], *, clip: float, sigma: float,
               rng: np.random.Generator | None = None) -> dict[str, np.ndarray]:
    """What the device sends instead of `weights`: start + clipped update + N(0, (2 sigma clip)^2)
    on every float coordinate (sensitivity 2 clip, see the module docstring), in the dtypes of
    `start`; non-float entries are `start`'s."""
    delta = clip_update(weights, start, clip)
    noisy = gaussian_mechanism([(np.concatenate([d.ravel() for d in delta.values()] or [np.zeros(0)]), 2 * clip)],
                               sigma, rng)[0]
    out, at = {}, 0
    for k, v in start.items():
        v = np.asarray(v)
        if k in delta:
            out[k] = (v.astype(np.float64) + noisy[at:at + v.size].reshape(v.shape)).astype(v.dtype)
            at += v.size
        else:
            out[k] = v.copy()
    return out
