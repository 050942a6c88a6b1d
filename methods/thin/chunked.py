"""One training step of W_c a few samples at a time, exactly as on the whole batch: what keeps a
thin device's memory flat in the batch size at the whole-batch step's speed.

A training step on a batch holds every layer's activations for backward: for the cnn's W_c and a
SupCon batch of 64 images in two views that is ~61 MB, most of a 100 MB device. Only BatchNorm
couples the samples of a batch (its statistics in forward, the sums of its gradients in
backward); every other layer is per sample. W_c is a chain of blocks, each a convolution, the
BatchNorm on its output and per-sample layers after it (ReLU, ReLU6, max-pool; the convolution
grouped or not), and the step keeps, for the whole batch, only what is costly to recompute and
small to hold; the rest is recomputed a chunk of `chunk` samples at a time:

- kept: the output of every convolution but the first (the cnn's second: 4.2 MB for 128 views
  at 16x16), from which BatchNorm, ReLU and max-pool, elementwise and cheap, are recomputed per
  chunk. The first convolution's output is the largest map (16.8 MB at 32x32) and the cheapest
  to recompute (3 input channels), so it is recomputed from the images instead;
- forward: the first BatchNorm's statistics from the first convolution, chunk by chunk; then
  each further convolution's output, chunk by chunk from the block below, and its statistics;
  then the reduced output (SupCon's pooled features, [B, C]: small), on which the loss and
  everything above W_c run as before;
- backward, block by block from the top: a chunk's gradient at the block's BatchNorm output
  comes from the reduced output's gradient (the top block) or from the gradient kept at the
  convolution above (whose weight gradient and input gradient the same chunk gives). BatchNorm's
  input gradient needs the whole batch's sum(g) and sum(g * xhat), so the gradients are held
  for the batch (the size of the kept map) and then turned, chunk by chunk, into the gradient
  at the convolution below, in the kept map's place;
- the first block needs no input gradient (its input is the image) and its gradient map is the
  largest: BatchNorm's input gradient is linear in g and xhat, so the first convolution's weight
  gradient is built from sums gathered in the same pass (`_first_weight_grad`).

Each convolution runs forward once, backward once (weight and input gradient), except the first:
three forwards (statistics, the kept map above it, the backward pass), one weight-gradient
product and no input gradient. The result equals the whole-batch step to float32 rounding
(tests/thin/test_thin_trainer.py); the running statistics are updated once per step with the whole
batch's, as torch does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

import numpy as np

from splitedge.methods.thin.layers import F32, BatchNorm2d, Conv2d, Layer, Sequential, channel_sums

Reduce = Callable[[np.ndarray], np.ndarray]
ReduceBackward = Callable[[np.ndarray, tuple[int, ...]], np.ndarray]
Top = tuple[np.ndarray, ReduceBackward, tuple[int, ...]]
"""The reduced output's gradient, how to take it back to W_c's output, and one chunk's output shape."""


@dataclass
class Block:
    """A convolution, the BatchNorm on its output and the per-sample layers after it."""

    conv: Conv2d
    bn: BatchNorm2d
    tail: list[Layer]


def blocks_of(wc: Sequential) -> list[Block]:
    """W_c as blocks; TypeError for a chain a chunked step cannot take (the first layer not a
    convolution, a convolution without BatchNorm after it, weights in another layer)."""
    leaves = [layer for _, layer in wc.named()]
    starts = [i for i, layer in enumerate(leaves) if isinstance(layer, Conv2d)]
    if not starts or starts[0] != 0:
        raise TypeError("a chunked step trains a chain of convolution-BatchNorm blocks starting with a convolution")
    blocks = []
    for start, end in zip(starts, starts[1:] + [len(leaves)]):
        bn, tail = (leaves[start + 1] if start + 1 < end else None), leaves[start + 2:end]
        heavy = [type(layer).__name__ for layer in tail if layer.params]
        if not isinstance(bn, BatchNorm2d) or heavy:
            raise TypeError(f"a chunked step needs BatchNorm right after each convolution and no weights "
                            f"in the layers after it, got {type(bn).__name__} then {heavy}")
        blocks.append(Block(leaves[start], bn, tail))
    return blocks


class ChunkedStep:
    """Forward and backward of a Sequential W_c over a batch in chunks of `chunk` samples."""

    def __init__(self, wc: Sequential, chunk: int) -> None:
        if chunk < 1:
            raise ValueError(f"a chunk holds at least one sample, got {chunk}")
        self.blocks = blocks_of(wc)
        self.leaves: list[Layer] = [layer for _, layer in wc.named()]
        self.chunk = int(chunk)
        self.stats: list[tuple[np.ndarray, np.ndarray]] = []  # block -> the batch's (mean, invstd)
        self.kept: list[np.ndarray | None] = []  # block -> its convolution's output (then the gradient there)

    def _parts(self, n: int) -> list[slice]:
        return [slice(start, min(start + self.chunk, n)) for start in range(0, n, self.chunk)]

    def _block_out(self, k: int, x: np.ndarray, part: slice, keep: bool) -> np.ndarray:
        """Block k's output on the samples `part`, from the images (the first block) or from its
        kept convolution output; with `keep`, its layers keep what their backward needs."""
        block = self.blocks[k]
        kept = self.kept[k]
        if kept is None:
            y = block.conv.forward(x[part], train=False)
        else:
            y = np.array(kept[part]) if keep else kept[part]  # keeping normalises in place
        out = block.bn.forward_fixed(y, *self.stats[k], keep)
        for layer in block.tail:
            out = layer.forward(out, train=keep)
        return out

    def _set_stats(self, k: int, maps: Iterable[np.ndarray]) -> None:
        """Block k's batch statistics from its convolution's output, given in parts; the running
        ones are updated once, as the whole batch's forward does."""
        bn = self.blocks[k].bn
        total = total_sq = np.zeros(bn.params["weight"].shape, np.float64)
        count = 0
        for y in maps:
            total, total_sq = total + channel_sums(y), total_sq + channel_sums(y, y)
            count += y.shape[0] * y.shape[2] * y.shape[3]
        mean = total / count
        var = np.maximum(total_sq / count - mean * mean, 0.0)  # biased: what normalises the batch
        bn._update_running(mean, var * count / max(count - 1, 1))
        self.stats.append((mean.astype(F32), (1.0 / np.sqrt(var + bn.eps)).astype(F32)))

    def forward(self, x: np.ndarray, reduce: Reduce) -> tuple[np.ndarray, tuple[int, ...]]:
        """The reduced output of the whole batch in training mode (running statistics updated),
        and one chunk's output shape [*, C, H, W] for the backward."""
        x = np.asarray(x, dtype=F32)
        parts = self._parts(len(x))
        self.stats, self.kept = [], [None]
        self._set_stats(0, (self.blocks[0].conv.forward(x[p], train=False) for p in parts))
        for k in range(1, len(self.blocks)):
            kept = None
            for p in parts:
                y = self.blocks[k].conv.forward(self._block_out(k - 1, x, p, keep=False), train=False)
                kept = np.empty((len(x),) + y.shape[1:], F32) if kept is None else kept
                kept[p] = y
            self.kept.append(kept)
            self._set_stats(k, [kept])
        reduced, shape = [], ()
        for p in parts:
            out = self._block_out(len(self.blocks) - 1, x, p, keep=False)
            shape = out.shape[1:]
            reduced.append(reduce(out))
        return np.concatenate(reduced), shape

    def backward(self, x: np.ndarray, grad_out: np.ndarray, reduce_backward: ReduceBackward,
                 shape: tuple[int, ...]) -> None:
        """Set every layer's `grads` for the gradient `grad_out` of the reduced output."""
        x = np.asarray(x, dtype=F32)
        for k in range(len(self.blocks) - 1, -1, -1):
            self._block_backward(k, x, (grad_out, reduce_backward, shape))
        for layer in self.leaves:
            layer.forget()

    def _norm_grads(self, k: int, x: np.ndarray, top: Top) -> Iterator[tuple[slice, np.ndarray]]:
        """Per chunk, the gradient at block k's BatchNorm output (its xhat kept in the BatchNorm),
        from the reduced output's gradient (the top block) or from the gradient kept at the
        convolution above, whose weight gradient the chunks add up as they pass."""
        block = self.blocks[k]
        conv = self.blocks[k + 1].conv if k + 1 < len(self.blocks) else None
        dw = np.zeros(conv.params["weight"].shape, np.float64) if conv else None
        for p in self._parts(len(x)):
            a = self._block_out(k, x, p, keep=True)
            if conv is None:
                grad_out, reduce_backward, shape = top
                g = reduce_backward(grad_out[p], (len(a),) + tuple(shape))
            else:
                dy = self.kept[k + 1][p]
                dw += conv.weight_grad(dy, a).reshape(dw.shape)
                g = conv.input_grad(dy, a.shape)
            for layer in reversed(block.tail):
                g = layer.backward(g)
            yield p, g
        if conv is not None:
            conv.grads["weight"] = dw.astype(F32)
            self.kept[k + 1] = None

    def _block_backward(self, k: int, x: np.ndarray, top: Top) -> None:
        """Block k's BatchNorm gradients, and the gradient at its convolution's output (kept in
        place of that output) or, for the first block, its convolution's weight gradient."""
        block, kept = self.blocks[k], self.kept[k]
        bn = block.bn
        dgamma = dbeta = np.zeros(bn.params["weight"].shape, np.float64)
        held = None if kept is None else np.empty_like(kept)  # the gradient at BatchNorm's output
        products = np.zeros((), np.float64)  # the first block: g, xhat and ones times its windows
        count = 0
        for p, g in self._norm_grads(k, x, top):
            dg, db = bn.grad_sums(g)
            dgamma, dbeta = dgamma + dg, dbeta + db
            count += g.shape[0] * g.shape[2] * g.shape[3]
            if held is None:
                products = products + _first_products(block.conv, g, bn._saved_xhat, x[p])
            else:
                held[p] = g
        bn.grads.update(weight=dgamma.astype(F32), bias=dbeta.astype(F32))
        if held is None:
            block.conv.grads["weight"] = self._first_weight_grad(products, dgamma, dbeta, count)
            return
        for p in self._parts(len(x)):
            bn.normalise(np.array(kept[p]), *self.stats[k], keep=True)
            kept[p] = bn.input_grad(held[p], dgamma, dbeta, count)

    def _first_weight_grad(self, products: np.ndarray, dgamma: np.ndarray, dbeta: np.ndarray, count: int) -> np.ndarray:
        """The first convolution's weight gradient without its output's gradient map: BatchNorm's
        input gradient is s * (m g - sum(g) - xhat sum(g xhat)) per channel (s = gamma invstd / m),
        so its product with the windows is s * (m [g windows] - sum(g) [windows] - sum(g xhat)
        [xhat windows]), the bracketed sums gathered chunk by chunk (`_first_products`)."""
        block = self.blocks[0]
        g_cols, xhat_cols, cols = products
        scale = block.bn.params["weight"].astype(np.float64) * self.stats[0][1] / count
        dw = scale[:, None] * (count * g_cols - dbeta[:, None] * cols - dgamma[:, None] * xhat_cols)
        return dw.astype(F32).reshape(block.conv.params["weight"].shape)


def _first_products(conv: Conv2d, g: np.ndarray, xhat: np.ndarray, x: np.ndarray) -> np.ndarray:
    """[3, O, C * k * k]: g, xhat and ones times the windows of a chunk's images x. Ungrouped,
    one matrix product on the stacked maps (the ones' row is every channel's); grouped, each
    channel sees its own group's windows, so three products."""
    if conv.groups == 1:
        o = g.shape[1]
        stacked = conv.weight_grad(_stacked(g, xhat), x)
        return np.stack([stacked[:o], stacked[o:2 * o], np.broadcast_to(stacked[2 * o], stacked[:o].shape)])
    return np.stack([conv.weight_grad(m, x) for m in (g, xhat, np.ones_like(g))])


def _stacked(g: np.ndarray, xhat: np.ndarray) -> np.ndarray:
    """[n, 2C + 1, H, W]: g, xhat and ones, whose products with the windows one matrix product gives."""
    n, c, h, w = g.shape
    out = np.empty((n, 2 * c + 1, h, w), F32)
    out[:, :c], out[:, c:2 * c], out[:, 2 * c] = g, xhat, 1.0
    return out
