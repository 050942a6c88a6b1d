"""A thin device's private BatchNorm statistics: the per-image input moments of
methods/privacy/norm_stats.py, taken by the numpy W_c (torch devices: torch_utils.private_norms)."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import numpy as np

from splitedge.methods.privacy.norm_stats import Layout
from splitedge.methods.privacy.release import private_norm_statistics
from splitedge.methods.thin.layers import BatchNorm2d, Sequential


def norm_layout(wc: Sequential) -> Layout:
    """(name, channels) of every BatchNorm in forward order."""
    return [(prefix.rstrip("."), int(layer.buffers["running_mean"].shape[0]))
            for prefix, layer in wc.named() if isinstance(layer, BatchNorm2d)]


def input_moments(wc: Sequential, inputs: Iterable[np.ndarray], only: str) -> Iterator[np.ndarray]:
    """Per batch, each image's [mean over positions of x, of x^2] per channel of the input of
    BatchNorm `only`, in eval mode (the forward stops there)."""
    for x in inputs:
        out = np.ascontiguousarray(x, dtype=np.float32)
        for prefix, layer in wc.named():
            if prefix.rstrip(".") == only:
                a = out.astype(np.float64)
                yield np.concatenate([a.mean(axis=(2, 3)), (a * a).mean(axis=(2, 3))], axis=1)
                break
            out = layer.forward(out, train=False)


def private_norms(part: Any, wc: Sequential, received: Mapping[str, np.ndarray],
                  inputs: Callable[[], Iterable[np.ndarray]]) -> dict[str, np.ndarray]:
    """With DP and `dp_bn_clip` > 0: the private release of the BatchNorm statistics of W_c as
    `received`, layer by layer (release.private_norm_statistics), on a copy of `wc`. Else nothing."""
    if not (part.cfg.dp_sigma > 0 and part.cfg.dp_bn_clip > 0):
        return {}
    work = copy.deepcopy(wc)
    work.load(dict(received))
    return private_norm_statistics(part, norm_layout(work), lambda name: input_moments(work, inputs(), name),
                                   lambda stats: work.load({**work.state(), **stats}))
