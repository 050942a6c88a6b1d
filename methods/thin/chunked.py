"""One training step of W_c a few samples at a time, exactly as on the whole batch: what keeps a
thin device's memory flat in the batch size.

A training step on a batch holds every layer's activations for backward: for the cnn's W_c and a
SupCon batch of 64 images in two views that is ~65 MB, most of a 100 MB device. Only BatchNorm
couples the samples of a batch (its statistics in forward, the sums of its gradients in
backward); every other layer is per sample. So a step can run in chunks, recomputing each chunk's
forward instead of keeping it (as gradient checkpointing does):

- forward: one pass per BatchNorm, in depth order, adds up that layer's batch mean and variance
  over the chunks, the layers below it normalising with the statistics already known; a last
  pass gives the reduced output (the pooled features SupCon needs, [B, C]: small);
- the loss and everything above W_c run on the whole reduced output, as before;
- backward: one pass per BatchNorm, from the top one down, recomputes a chunk's forward keeping
  its activations, back-propagates it to that BatchNorm and adds up its gradient sums
  (sum(grad), sum(grad * xhat)) and the weight gradients of the layers between it and the next
  BatchNorm above; a last pass reaches the input and the layers under the first BatchNorm.

With K BatchNorm layers that is 2K + 2 forwards and K + 1 backwards of the batch instead of one
each (the cnn: K = 2, fedcnn: K = 1), for a peak of one chunk's activations. The result equals
the whole-batch step to float32 rounding (tests/test_thin_trainer.py); the running statistics
are updated once per step with the whole batch's, as torch does.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from splitedge.methods.thin.layers import F32, BatchNorm2d, Conv2d, Layer, Sequential, channel_sums

Reduce = Callable[[np.ndarray], np.ndarray]
ReduceBackward = Callable[[np.ndarray, tuple[int, ...]], np.ndarray]


class ChunkedStep:
    """Forward and backward of a Sequential W_c over a batch in chunks of `chunk` samples."""

    def __init__(self, wc: Sequential, chunk: int) -> None:
        if chunk < 1:
            raise ValueError(f"a chunk holds at least one sample, got {chunk}")
        self.leaves: list[Layer] = [layer for _, layer in wc.named()]
        self.norms = [i for i, layer in enumerate(self.leaves) if isinstance(layer, BatchNorm2d)]
        self.chunk = int(chunk)
        self.stats: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # leaf -> the batch's (mean, invstd)

    def _chunks(self, n: int) -> range:
        return range(0, n, self.chunk)

    def _forward(self, x: np.ndarray, stop: int, keep_from: int) -> np.ndarray:
        """Leaves [0, stop) on a chunk with the batch's BatchNorm statistics; layers from
        `keep_from` keep what their backward needs."""
        out = np.array(x, dtype=F32)  # layers work in place on what they are given
        for i in range(stop):
            layer, keep = self.leaves[i], i >= keep_from
            if i in self.stats:
                mean, invstd = self.stats[i]
                out = layer.forward_fixed(out, mean, invstd, keep)  # type: ignore[attr-defined]
            else:
                out = layer.forward(out, train=keep)
        return out

    def forward(self, x: np.ndarray, reduce: Reduce) -> tuple[np.ndarray, tuple[int, ...]]:
        """The reduced output of the whole batch in training mode (running statistics updated),
        and one chunk's output shape [*, C, H, W] for the backward."""
        self.stats = {}
        n = len(x)
        for b in self.norms:
            bn: BatchNorm2d = self.leaves[b]  # type: ignore[assignment]
            total = total_sq = None
            count = 0
            for start in self._chunks(n):
                h = self._forward(x[start:start + self.chunk], b, keep_from=len(self.leaves))
                s, sq = channel_sums(h), channel_sums(h, h)
                total, total_sq = (s, sq) if total is None else (total + s, total_sq + sq)
                count += h.shape[0] * h.shape[2] * h.shape[3]
            mean = total / count
            var = np.maximum(total_sq / count - mean * mean, 0.0)  # biased: what normalises the batch
            bn._update_running(mean, var * count / max(count - 1, 1))
            self.stats[b] = (mean.astype(F32), (1.0 / np.sqrt(var + bn.eps)).astype(F32))
        parts, shape = [], ()
        for start in self._chunks(n):
            out = self._forward(x[start:start + self.chunk], len(self.leaves), keep_from=len(self.leaves))
            shape = out.shape[1:]
            parts.append(reduce(out))
        return np.concatenate(parts), shape

    def backward(self, x: np.ndarray, grad_out: np.ndarray, reduce_backward: ReduceBackward,
                 shape: tuple[int, ...]) -> None:
        """Set every layer's `grads` for the gradient `grad_out` of the reduced output."""
        n = len(x)
        sums: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # BatchNorm leaf -> (dgamma, dbeta) of the batch
        counts: dict[int, int] = {}  # BatchNorm leaf -> values per channel in the batch
        targets = list(reversed(self.norms)) + [-1]  # -1: the input
        for t, target in enumerate(targets):
            above = targets[t - 1] if t else len(self.leaves)  # this pass's weights: leaves (target, above)
            weight_grads: dict[int, np.ndarray] = {}
            dgamma = dbeta = None
            count = 0
            for start in self._chunks(n):
                xc = x[start:start + self.chunk]
                self._forward(xc, len(self.leaves), keep_from=max(target, 0))
                g = reduce_backward(grad_out[start:start + len(xc)], (len(xc),) + tuple(shape))
                for i in range(len(self.leaves) - 1, target, -1):
                    g = self._backward_leaf(i, g, sums, counts, want_weights=target < i < above, into=weight_grads)
                if target >= 0:
                    bn: BatchNorm2d = self.leaves[target]  # type: ignore[assignment]
                    dg, db = bn.grad_sums(g)
                    dgamma, dbeta = (dg, db) if dgamma is None else (dgamma + dg, dbeta + db)
                    count += g.shape[0] * g.shape[2] * g.shape[3]
                    bn.forget()
                for layer in self.leaves:
                    layer.forget()
            for i, dw in weight_grads.items():
                self.leaves[i].grads["weight"] = dw.astype(F32)
            if target >= 0:
                sums[target], counts[target] = (dgamma, dbeta), count
                self.leaves[target].grads.update(weight=dgamma.astype(F32), bias=dbeta.astype(F32))

    def _backward_leaf(self, i: int, g: np.ndarray, sums: dict[int, tuple[np.ndarray, np.ndarray]],
                       counts: dict[int, int], want_weights: bool, into: dict[int, np.ndarray]) -> np.ndarray:
        layer = self.leaves[i]
        if isinstance(layer, BatchNorm2d):
            dgamma, dbeta = sums[i]
            return layer.input_grad(g, dgamma, dbeta, counts[i])
        if isinstance(layer, Conv2d):
            if not want_weights:
                return layer.backward_input(g)
            g = layer.backward(g)
            dw = layer.grads["weight"].astype(np.float64)
            into[i] = dw if i not in into else into[i] + dw
            return g
        if layer.params:
            raise TypeError(f"a chunked step handles convolutions and BatchNorm, not {type(layer).__name__}'s weights")
        return layer.backward(g)
