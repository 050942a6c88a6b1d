"""Grouped convolution (torch's nn.Conv2d with `groups`, depthwise included) for the thin Conv2d.

Works kernel tap by kernel tap on one chunk of samples, never through unfolded windows: a
depthwise convolution's windows are k * k times its input (a MobileNet block's 64-channel 3x3
depthwise map at 32x32 is 38 MB of windows for a chunk of 16), while a tap needs one strided
view of the padded chunk. Channels are group-major, as torch's: output channel o reads input
channels [g * cg, (g + 1) * cg) of its group g = o // og. Sums run in float32 per tap, the weight
gradient's over samples in float64, as the ungrouped Conv2d's.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np

F32 = np.float32


def out_size(h: int, w: int, kernel: int, stride: int, padding: int) -> tuple[int, int]:
    """torch's output side for a square kernel (no dilation)."""
    return (h + 2 * padding - kernel) // stride + 1, (w + 2 * padding - kernel) // stride + 1


def padded(x: np.ndarray, p: int) -> np.ndarray:
    """x zero-padded by p on both spatial sides (x itself for p = 0)."""
    if not p:
        return x
    n, c, h, w = x.shape
    xp = np.zeros((n, c, h + 2 * p, w + 2 * p), F32)
    xp[:, :, p:p + h, p:p + w] = x
    return xp


def taps(kernel: int, stride: int, ho: int, wo: int) -> Iterator[tuple[int, int, tuple[slice, slice]]]:
    """(i, j, the padded map's positions that tap (i, j) reads for every output position)."""
    for i in range(kernel):
        for j in range(kernel):
            yield i, j, (slice(i, i + stride * ho, stride), slice(j, j + stride * wo, stride))


def _tap(xp: np.ndarray, pos: tuple[slice, slice], groups: int) -> np.ndarray:
    """The padded chunk's values a tap reads, [n, G, C / G, Ho, Wo]: a strided view, no copy."""
    v = xp[:, :, pos[0], pos[1]]
    return v.reshape(v.shape[0], groups, v.shape[1] // groups, v.shape[2], v.shape[3])


def _product(w: np.ndarray, x: np.ndarray, out: np.ndarray) -> np.ndarray:
    """Per group, w [G, a, b] times x [n, G, b, Ho, Wo] into out [n, G, a, Ho, Wo]: a broadcast
    when b is 1 (depthwise: a matrix product per sample and channel would be a loop of 1 x 1
    products), else one batched matrix product on a copy of x's positions."""
    if w.shape[2] == 1:
        return np.multiply(w[None, :, :, :, None], x, out=out)
    n, g, b, ho, wo = x.shape
    flat = out.reshape(n, g, w.shape[1], ho * wo)  # out is contiguous: a view
    np.matmul(w, np.ascontiguousarray(x).reshape(n, g, b, ho * wo), out=flat)
    return out


def forward(x: np.ndarray, weight: np.ndarray, stride: int, padding: int, groups: int, out: np.ndarray) -> None:
    """The convolution of one chunk x [n, C, H, W] with weight [O, C / groups, k, k], written
    into out [n, O, Ho, Wo] (contiguous): one strided view and one output-sized temporary a tap."""
    n, o, ho, wo = out.shape
    cg, k = weight.shape[1], weight.shape[2]
    xp = padded(x, padding)
    acc = out.reshape(n, groups, o // groups, ho, wo)
    tmp = np.empty_like(acc)
    for i, j, pos in taps(k, stride, ho, wo):
        w = weight[:, :, i, j].reshape(groups, o // groups, cg)
        if i == j == 0:
            _product(w, _tap(xp, pos, groups), acc)
        else:
            acc += _product(w, _tap(xp, pos, groups), tmp)


def sample_weight_grads(grad: np.ndarray, x: np.ndarray, kernel: int, stride: int, padding: int,
                        groups: int) -> np.ndarray:
    """[n, O, C / groups, k, k] float64: each sample's weight gradient for the output gradient
    `grad` [n, O, Ho, Wo] of the chunk x (summed over samples: the batch's)."""
    n, c = x.shape[:2]
    o, ho, wo = grad.shape[1], grad.shape[2], grad.shape[3]
    cg, og = c // groups, o // groups
    xp = padded(x, padding)
    g = grad.reshape(n, groups, og, ho, wo)
    out = np.empty((n, groups, og, cg, kernel, kernel), np.float64)
    for i, j, pos in taps(kernel, stride, ho, wo):
        xt = _tap(xp, pos, groups)
        if og == cg == 1:
            out[:, :, 0, 0, i, j] = np.einsum("nghw,nghw->ng", g[:, :, 0], xt[:, :, 0])
        else:
            xt = np.ascontiguousarray(xt).reshape(n, groups, cg, ho * wo)
            out[:, :, :, :, i, j] = np.matmul(g.reshape(n, groups, og, ho * wo), xt.transpose(0, 1, 3, 2))
    return out.reshape(n, o, cg, kernel, kernel)


def input_grad(grad: np.ndarray, weight: np.ndarray, shape: tuple[int, ...], stride: int, padding: int,
               groups: int) -> np.ndarray:
    """The gradient of a chunk's input of `shape` [n, C, H, W] for its output gradient `grad`:
    a view of its padded buffer."""
    n, c, h, w = shape
    o, cg, k = weight.shape[0], weight.shape[1], weight.shape[2]
    ho, wo = grad.shape[2], grad.shape[3]
    og, p = o // groups, padding
    g = np.ascontiguousarray(grad).reshape(n, groups, og, ho, wo)
    dxp = np.zeros((n, c, h + 2 * p, w + 2 * p), F32)
    tmp = np.empty((n, groups, cg, ho, wo), F32)
    for i, j, pos in taps(k, stride, ho, wo):
        wt = weight[:, :, i, j].reshape(groups, og, cg).transpose(0, 2, 1)  # [G, cg, og]
        dxp[:, :, pos[0], pos[1]] += _product(wt, g, tmp).reshape(n, c, ho, wo)
    return dxp[:, :, p:p + h, p:p + w]
