"""Torch steps the H-SFP edge and cloud share: batches of synthetic features, output moments."""

from __future__ import annotations

from typing import Callable, Iterator, Sequence

import numpy as np
import torch
from torch import nn

from splitedge.methods.moments import ClassMoments, MomentAccumulator
from splitedge.methods.training import Batch


def minibatches(n: int, size: int, gen: torch.Generator) -> list[torch.Tensor]:
    order = torch.randperm(n, generator=gen)
    return [order[i:i + size] for i in range(0, n, size) if len(order[i:i + size]) >= 2]


def sample_batches(x: np.ndarray, y: np.ndarray, shape: Sequence[int], *, batch: int,
                   seed: int) -> Callable[[], Iterator[Batch]]:
    """Shuffled minibatches of flattened synthetic features reshaped to `shape`, one epoch per call."""
    xt = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)).reshape(len(x), *shape)
    yt = torch.from_numpy(np.asarray(y, dtype=np.int64))
    gen = torch.Generator().manual_seed(seed)

    def epoch() -> Iterator[Batch]:
        for idx in minibatches(len(yt), batch, gen):
            yield Batch(xt[idx], yt[idx])

    return epoch


@torch.no_grad()
def output_moments(module: nn.Module, x: np.ndarray, y: np.ndarray, shape: Sequence[int],
                   *, batch: int = 256) -> ClassMoments:
    """Per-class moments (float64) of the flattened outputs of `module` on inputs `x`."""
    module.eval()
    acc: MomentAccumulator | None = None
    for i in range(0, len(y), batch):
        xt = torch.from_numpy(np.ascontiguousarray(x[i:i + batch], dtype=np.float32))
        out = module(xt.reshape(len(xt), *shape)).reshape(len(xt), -1).numpy()
        acc = acc or MomentAccumulator(out.shape[1])
        acc.add(out, y[i:i + batch])
    assert acc is not None, "no samples"
    return acc.result()


def with_counts(m: ClassMoments, reference: ClassMoments) -> ClassMoments:
    """Moments of synthetic outputs carry the real per-class counts, so upper tiers weight them right."""
    counts = dict(zip(reference.classes.tolist(), reference.counts.tolist()))
    return ClassMoments(classes=m.classes, counts=np.array([counts[c] for c in m.classes.tolist()], dtype=np.int64),
                        mean=m.mean, var=m.var)
