"""BatchNorm running statistics under differential privacy: one private release per round.

Without it, a DP device sends its BatchNorm running statistics as it received them (they are
estimates of its own features, and a weight update's noise would drive variances below 0), so
under DP a model's running statistics are never learned and its own head sits at chance.

What a device releases instead: the mean, over its images, of each image's per-channel input
moments to every BatchNorm layer, `[mean over positions of x, mean over positions of x^2]` for
each layer in order (`layout`), taken with the model it RECEIVED (public) in eval mode. So each
image's vector depends on that image alone, and one image changes the clipped sum by at most
the clip: the release is the class-means mechanism of dp.py with a single class (count and sum,
sensitivity sqrt(2), `dp_bn_clip` the L2 clip of each image's whole vector). After the noise
(post-processing): running_mean = the mean of x, running_var = mean of x^2 - mean^2, floored.

Layer by layer: each layer's moments are taken with the layers before it normalised by the
statistics just released for them (post-processing of earlier releases), so every layer sees
its input as the served model will; normalised by the received statistics instead, a layer's
input was scaled for an earlier model and the next model sat at chance for a round. L such
releases at noise multiplier sigma sqrt(L) each compose exactly to one at sigma (Gaussian
mechanisms compose as 1/sigma^2 = sum 1/sigma_i^2: Dong, Roth and Su's Gaussian DP, and alike in
Renyi DP), so they are counted as one release. The statistics still describe the received
weights, a round behind the trained ones; as the weights settle they converge. numpy only: the
taps that produce the per-image vectors live beside each backend (torch_utils.norm_input_moments).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from splitedge.methods.privacy.dp import ClippedSums, class_means_from

Layout = list[tuple[str, int]]
"""(BatchNorm module name, channels) in the order the per-image vectors concatenate them."""
VAR_FLOOR = 1e-4
"""Least variance a noisy release may leave: 0 would divide a channel by sqrt(eps) ~ 3e-3."""


def sequential_sigma(sigma: float, layers: int) -> float:
    """Each of `layers` sequential releases' noise multiplier, for all of them to cost one at `sigma`."""
    return sigma * math.sqrt(layers)


def layout_dim(layout: Layout) -> int:
    return 2 * sum(c for _, c in layout)


def norm_statistics(mean: np.ndarray, layout: Layout) -> dict[str, np.ndarray]:
    """The per-image moments' mean [2 sum C] -> `{name.running_mean, name.running_var}` (float32)."""
    out, at = {}, 0
    for name, c in layout:
        m, q = mean[at:at + c], mean[at + c:at + 2 * c]
        at += 2 * c
        out[f"{name}.running_mean"] = m.astype(np.float32)
        out[f"{name}.running_var"] = np.maximum(q - m * m, VAR_FLOOR).astype(np.float32)
    return out


def released_norm_statistics(vectors: Iterable[np.ndarray], layout: Layout, *, clip: float, sigma: float,
                             rng: np.random.Generator | None = None) -> dict[str, np.ndarray]:
    """One Gaussian release of the clipped per-image vectors' count and sum; their mean as
    running statistics. Empty when the noisy count kept nothing (the caller keeps what it had)."""
    sums = ClippedSums(layout_dim(layout), 1, clip, "none")
    for v in vectors:
        sums.add(v, np.zeros(len(v), np.int64))
    classes, _, means = class_means_from(sums.release(sigma, rng))
    return norm_statistics(means[0], layout) if len(classes) else {}


def with_statistics(weights: Mapping[str, np.ndarray], statistics: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """`weights` with the released running statistics in place of the ones it carries (each cast
    to the dtype and shape it replaces)."""
    out = dict(weights)
    for k, v in statistics.items():
        if k in out:
            out[k] = np.asarray(v, dtype=out[k].dtype).reshape(out[k].shape)
    return out
