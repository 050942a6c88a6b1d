"""Layers with a hand-written backward pass in numpy: what a device needs to train W_c without torch.

Each layer computes what its torch counterpart computes, float32 in and out, and keeps what its
backward needs from the last training forward. Parameters and buffers carry torch's state-dict
names, so a `Sequential` of them loads and produces the weight maps the rest of the federation
sends (`conv.weight`, `bn.running_var`, `bn.num_batches_tracked`, ...). Parity with torch
autograd is tested in tests/thin/test_thin_trainer.py.

Why numpy and not an engine: onnxruntime-training has no aarch64 wheel, MNN's training API gave
NaN losses on a toy net and peaks near 110 MB, while these few layers are short, exact to float32
rounding against torch, and need nothing beyond the thin install (docs/thin-trainer.md).
"""

from __future__ import annotations

from typing import Iterator

import numpy as np

from splitedge.methods.thin import grouped

F32 = np.float32


class Layer:
    """A layer: `forward(x, train)`, `backward(grad) -> grad of x`, named params, grads and buffers."""

    def __init__(self) -> None:
        self.params: dict[str, np.ndarray] = {}
        self.grads: dict[str, np.ndarray] = {}
        self.buffers: dict[str, np.ndarray] = {}

    def forward(self, x: np.ndarray, train: bool) -> np.ndarray:
        raise NotImplementedError

    def backward(self, grad: np.ndarray) -> np.ndarray:
        """The gradient of the input; `grad` may be overwritten (layers reuse its buffer)."""
        raise NotImplementedError

    def named(self, prefix: str = "") -> Iterator[tuple[str, "Layer"]]:
        yield prefix, self

    def forget(self) -> None:
        """Drop what the last training forward kept for backward (between epochs, before parking)."""
        for name in [k for k in vars(self) if k.startswith("_saved")]:
            setattr(self, name, None)


def channel_sums(a: np.ndarray, b: np.ndarray | None = None, chunk: int = 16) -> np.ndarray:
    """Per-channel sums (float64) of a [N, C, H, W], or of a * b, a few samples at a time: no
    temporary of the whole batch's size. float64 as torch's CPU BatchNorm accumulates: a float32
    dot product's rounding moves a near-constant channel's xhat by up to 1/sqrt(eps) times it
    (and flips ReLUs)."""
    out = np.zeros(a.shape[1], np.float64)
    for i in range(0, len(a), chunk):
        part = a[i:i + chunk] if b is None else a[i:i + chunk] * b[i:i + chunk]
        out += part.sum(axis=(0, 2, 3), dtype=np.float64)
    return out


class Conv2d(Layer):
    """Square-kernel convolution, zero padding, no bias (a BatchNorm follows every one here);
    `groups` as torch's (depthwise: groups == c_in == c_out), weight [c_out, c_in / groups, k, k].

    im2col and one batched matrix product per `chunk` samples, each chunk padded on its own: the
    unfolded windows of a SupCon batch of the cnn's first layer (128 views) are 14 MB at once,
    under 2 MB per chunk of 16. Windows are laid out per sample, [n, C * k * k, Ho * Wo], so the
    product lands in NCHW order and nothing is transposed. It keeps its (unpadded) input for
    backward, which unfolds it again. A grouped one runs tap by tap instead (methods/thin/grouped.py):
    a depthwise layer's windows would be k * k times its input."""

    chunk = 16

    def __init__(self, c_in: int, c_out: int, kernel: int = 3, stride: int = 1, padding: int = 1,
                 groups: int = 1) -> None:
        super().__init__()
        if groups < 1 or c_in % groups or c_out % groups:
            raise ValueError(f"groups ({groups}) must divide in channels ({c_in}) and out channels ({c_out})")
        self.stride, self.padding, self.kernel, self.groups = int(stride), int(padding), int(kernel), int(groups)
        self.params["weight"] = np.zeros((c_out, c_in // groups, kernel, kernel), F32)
        self._saved_x: np.ndarray | None = None

    def _grouped_args(self) -> tuple[int, int, int]:
        return self.stride, self.padding, self.groups

    def _out_size(self, h: int, w: int) -> tuple[int, int]:
        k, s, p = self.kernel, self.stride, self.padding
        return (h + 2 * p - k) // s + 1, (w + 2 * p - k) // s + 1

    def _cols(self, x: np.ndarray) -> np.ndarray:
        """[n, C * k * k, Ho * Wo] windows of a chunk, rows in the weight's (C, k, k) order."""
        n, c, h, w = x.shape
        k, s, p = self.kernel, self.stride, self.padding
        ho, wo = self._out_size(h, w)
        xp = x
        if p:  # not np.pad: its bookkeeping costs more than the copy on a chunk
            xp = np.zeros((n, c, h + 2 * p, w + 2 * p), F32)
            xp[:, :, p:p + h, p:p + w] = x
        cols = np.empty((n, c, k, k, ho, wo), F32)
        for i in range(k):
            for j in range(k):
                cols[:, :, i, j] = xp[:, :, i:i + s * ho:s, j:j + s * wo:s]
        return cols.reshape(n, c * k * k, ho * wo)

    def _matrix(self) -> np.ndarray:
        return self.params["weight"].reshape(len(self.params["weight"]), -1)

    def forward(self, x: np.ndarray, train: bool) -> np.ndarray:
        w = self._matrix()
        ho, wo = self._out_size(x.shape[2], x.shape[3])
        out = np.empty((len(x), len(w), ho, wo), F32)
        for i in range(0, len(x), self.chunk):
            part = x[i:i + self.chunk]
            if self.groups > 1:
                grouped.forward(part, self.params["weight"], *self._grouped_args(), out=out[i:i + len(part)])
            else:
                np.matmul(w, self._cols(part), out=out[i:i + len(part)].reshape(len(part), len(w), ho * wo))
        if train:
            self._saved_x = x
        return out

    def weight_grad(self, grad: np.ndarray, x: np.ndarray) -> np.ndarray:
        """Sum over samples and positions of `grad` [N, G, Ho, Wo] times the windows of `x`:
        [G, C * k * k], float64. G is the weight's output channels for its gradient; a chunked
        step stacks more maps on the same windows (methods/thin/chunked.py); grouped, G is the
        output channels alone, [O, C / groups * k * k]."""
        out = np.zeros((grad.shape[1], self._matrix().shape[1]), np.float64)
        for start in range(0, len(x), self.chunk):
            if self.groups > 1:
                g, part = grad[start:start + self.chunk], x[start:start + self.chunk]
                args = self.kernel, *self._grouped_args()
                out += grouped.sample_weight_grads(g, part, *args).sum(axis=0).reshape(out.shape)
                continue
            cols = self._cols(x[start:start + self.chunk])
            g = grad[start:start + len(cols)].reshape(len(cols), grad.shape[1], -1)
            out += np.matmul(g, cols.transpose(0, 2, 1)).sum(axis=0, dtype=np.float64)
        return out

    def sample_weight_grads(self, grad: np.ndarray, x: np.ndarray) -> np.ndarray:
        """[N, *weight.shape] float64: each sample's weight gradient, `chunk` samples at a time."""
        weight = self.params["weight"]
        out = np.empty((len(x),) + weight.shape, np.float64)
        for start in range(0, len(x), self.chunk):
            n = len(x[start:start + self.chunk])
            g, part = grad[start:start + n], x[start:start + n]
            if self.groups > 1:
                out[start:start + n] = grouped.sample_weight_grads(g, part, self.kernel, *self._grouped_args())
                continue
            g = g.reshape(n, len(weight), -1)  # [n, O, P] against the windows [n, CKK, P]
            products = np.einsum("nop,nkp->nok", g, self._cols(part), dtype=np.float64)
            out[start:start + n] = products.reshape((n,) + weight.shape)
        return out

    def backward(self, grad: np.ndarray) -> np.ndarray:
        """The weight's gradient first, then the input is let go before its gradient is built."""
        x = self._saved_x
        assert x is not None, "backward before a training forward"
        weight = self.params["weight"]
        self.grads["weight"] = self.weight_grad(grad, x).astype(F32).reshape(weight.shape)
        shape = x.shape
        self._saved_x = x = None
        return self.input_grad(grad, shape)

    def backward_input(self, grad: np.ndarray) -> np.ndarray:
        """The input's gradient alone (per-sample gradients build the weight's their own way)."""
        x = self._saved_x
        assert x is not None, "backward before a training forward"
        self._saved_x = None
        return self.input_grad(grad, x.shape)

    def input_grad(self, grad: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
        """The gradient of an input of `shape` for the output gradient `grad` (col2im of W^T grad)."""
        n_all, c, h, wd = shape
        p, s, k = self.padding, self.stride, self.kernel
        ho, wo = grad.shape[2], grad.shape[3]
        w = self._matrix()
        dx = np.empty(shape, F32)
        for start in range(0, n_all, self.chunk):
            g = grad[start:start + self.chunk]
            n = len(g)
            if self.groups > 1:
                dx[start:start + n] = grouped.input_grad(g, self.params["weight"], (n, c, h, wd), *self._grouped_args())
                continue
            dcols = np.matmul(w.T, g.reshape(n, len(w), ho * wo)).reshape(n, c, k, k, ho, wo)
            dxp = np.zeros((n, c, h + 2 * p, wd + 2 * p), F32)
            for i in range(k):
                for j in range(k):
                    dxp[:, :, i:i + s * ho:s, j:j + s * wo:s] += dcols[:, :, i, j]
            dx[start:start + n] = dxp[:, :, p:p + h, p:p + wd]
        return dx


class BatchNorm2d(Layer):
    """torch.nn.BatchNorm2d: batch statistics and running averages in training, running ones in eval.

    In training it normalises its input in place (every BatchNorm here follows a Conv2d, whose
    fresh output nothing else holds) and keeps that for backward; statistics accumulate in
    float64 a few samples at a time."""

    frozen = False
    """True: training normalises by the running statistics and leaves them as they are, so each
    sample's output depends on that sample alone (DP-SGD, methods/thin/per_sample.py)."""

    def __init__(self, channels: int, eps: float = 1e-5, momentum: float = 0.1) -> None:
        super().__init__()
        self.eps, self.momentum = eps, momentum
        self.params.update(weight=np.ones(channels, F32), bias=np.zeros(channels, F32))
        self.buffers.update(running_mean=np.zeros(channels, F32), running_var=np.ones(channels, F32),
                            num_batches_tracked=np.zeros((), np.int64))
        self._saved_xhat: np.ndarray | None = None
        self._saved_invstd: np.ndarray | None = None

    def forward(self, x: np.ndarray, train: bool) -> np.ndarray:
        gamma, beta = self.params["weight"][:, None, None], self.params["bias"][:, None, None]
        if not train:
            b = self.buffers
            scale = (1.0 / np.sqrt(b["running_var"] + F32(self.eps))).astype(F32)
            out = x - b["running_mean"][:, None, None]
            out *= scale[:, None, None] * gamma
            out += beta
            return out
        if self.frozen:
            invstd = 1.0 / np.sqrt(self.buffers["running_var"].astype(np.float64) + self.eps)
            return self.forward_fixed(x, self.buffers["running_mean"].astype(np.float64), invstd, keep=True)
        m = x.shape[0] * x.shape[2] * x.shape[3]
        mean = channel_sums(x) / m
        x -= mean.astype(F32)[:, None, None]
        var = channel_sums(x, x) / m  # biased: what normalises the batch
        self._update_running(mean, var * m / max(m - 1, 1))  # the running variance is unbiased, as torch's
        return self.forward_fixed(x, np.zeros_like(mean), (1.0 / np.sqrt(var + self.eps)).astype(F32), keep=True)

    def forward_fixed(self, x: np.ndarray, mean: np.ndarray, invstd: np.ndarray, keep: bool) -> np.ndarray:
        """Training-mode normalisation with given batch statistics (a whole batch's, when a chunk
        of it passes: methods/thin/chunked.py). With `keep`, x is normalised in place and kept for
        backward; without, x is left as it is (a chunked step passes its kept maps)."""
        gamma = self.params["weight"]
        if not keep:
            scale = gamma * invstd.astype(F32)
            out = x * scale[:, None, None]
            out += (self.params["bias"] - mean.astype(F32) * scale)[:, None, None]
            return out
        xhat = self.normalise(x, mean, invstd, keep)
        out = xhat * gamma[:, None, None]
        out += self.params["bias"][:, None, None]
        return out

    def normalise(self, x: np.ndarray, mean: np.ndarray, invstd: np.ndarray, keep: bool) -> np.ndarray:
        """xhat = (x - mean) * invstd in place; kept for backward if `keep` (a chunked step
        re-normalises a kept map to build its input gradient)."""
        if np.any(mean):
            x -= mean.astype(F32)[:, None, None]
        x *= invstd.astype(F32)[:, None, None]
        if keep:
            self._saved_xhat, self._saved_invstd = x, invstd.astype(F32)
        return x

    def _update_running(self, mean: np.ndarray, var: np.ndarray) -> None:
        b, mom = self.buffers, self.momentum
        b["running_mean"] = ((1 - mom) * b["running_mean"] + mom * mean).astype(F32)
        b["running_var"] = ((1 - mom) * b["running_var"] + mom * var).astype(F32)
        b["num_batches_tracked"] = np.asarray(b["num_batches_tracked"] + 1, np.int64)

    def backward(self, grad: np.ndarray) -> np.ndarray:
        """dx = gamma * invstd / m * (m * grad - sum(grad) - xhat * sum(grad * xhat)), built in
        the kept xhat's buffer; `grad` (the layer above's fresh gradient) is scaled in place."""
        m = grad.shape[0] * grad.shape[2] * grad.shape[3]
        dgamma, dbeta = self.grad_sums(grad)
        self.grads.update(weight=dgamma.astype(F32), bias=dbeta.astype(F32))
        if self.frozen:
            return self.frozen_input_grad(grad)
        return self.input_grad(grad, dgamma, dbeta, m)

    def frozen_input_grad(self, grad: np.ndarray) -> np.ndarray:
        """dx = grad * gamma * invstd when the statistics were fixed (`frozen`), in place."""
        grad *= (self.params["weight"] * self._saved_invstd)[:, None, None]
        self._saved_xhat = None
        return grad

    def grad_sums(self, grad: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(sum(grad * xhat), sum(grad)) per channel, float64: the gradients of gamma and beta, of
        this batch (or of a chunk, to be added up)."""
        assert self._saved_xhat is not None, "backward before a training forward"
        return channel_sums(grad, self._saved_xhat), channel_sums(grad)

    def input_grad(self, grad: np.ndarray, dgamma: np.ndarray, dbeta: np.ndarray, m: int) -> np.ndarray:
        """dx from the whole batch's sums (m values per channel), built in the kept xhat's buffer;
        `grad` (the layer above's fresh gradient) is scaled in place."""
        xhat, invstd = self._saved_xhat, self._saved_invstd
        assert xhat is not None and invstd is not None, "backward before a training forward"
        gamma = self.params["weight"]
        dx = xhat
        dx *= -dgamma.astype(F32)[:, None, None]
        grad *= F32(m)
        dx += grad
        dx -= dbeta.astype(F32)[:, None, None]
        dx *= (gamma * invstd / F32(m))[:, None, None]
        self._saved_xhat = None
        return dx


class ReLU(Layer):
    """In place: every ReLU here follows a BatchNorm, whose output nothing else keeps."""

    def forward(self, x: np.ndarray, train: bool) -> np.ndarray:
        out = np.maximum(x, 0, out=x)
        if train:
            self._saved_mask = out > 0
        return out

    def backward(self, grad: np.ndarray) -> np.ndarray:
        grad *= self._saved_mask  # the gradient of the layer above: a fresh array
        self._saved_mask = None
        return grad


class ReLU6(Layer):
    """torch.nn.ReLU6 (hardtanh(0, 6)), in place as ReLU: the gradient passes where the input
    was strictly between 0 and 6, as torch's hardtanh_backward (none at 0 or 6 exactly). Not a
    ReLU subclass: pre_relu (trainer.eval_forward) drops a ReLU, which this is not."""

    def forward(self, x: np.ndarray, train: bool) -> np.ndarray:
        if train:
            self._saved_mask = (x > 0) & (x < 6)
        return np.clip(x, F32(0), F32(6), out=x)

    def backward(self, grad: np.ndarray) -> np.ndarray:
        grad *= self._saved_mask
        self._saved_mask = None
        return grad


class MaxPool2d(Layer):
    """2x2 max-pooling with stride 2 (torch's: the gradient goes to the first maximum of a window).

    Works on the four strided quarter views, so no copy of the input is made; the window's
    argmax comes from two pairwise comparisons and one between the pairs (strict, so the first
    maximum wins), not from a search over the four."""

    @staticmethod
    def _quarters(x: np.ndarray) -> list[np.ndarray]:
        h, w = x.shape[2] // 2 * 2, x.shape[3] // 2 * 2
        return [x[:, :, a:h:2, b:w:2] for a in (0, 1) for b in (0, 1)]  # window order: row-major, as torch

    def forward(self, x: np.ndarray, train: bool) -> np.ndarray:
        q = self._quarters(x)
        top, bottom = np.maximum(q[0], q[1]), np.maximum(q[2], q[3])
        if train:
            arg = np.where(bottom > top, (q[3] > q[2]).view(np.uint8) + np.uint8(2), (q[1] > q[0]).view(np.uint8))
            self._saved_arg, self._saved_shape = arg, x.shape
        return np.maximum(top, bottom, out=top)

    def backward(self, grad: np.ndarray) -> np.ndarray:
        n, c, h, w = self._saved_shape
        h2, w2 = grad.shape[2], grad.shape[3]
        dx = np.zeros((n, c, h2, 2, w2, 2), F32)  # [.., row, window row, column, window column]
        for i in range(4):
            np.multiply(grad, self._saved_arg == i, out=dx[:, :, :, i // 2, :, i % 2])
        self._saved_arg = None
        dx = dx.reshape(n, c, 2 * h2, 2 * w2)
        if (2 * h2, 2 * w2) != (h, w):  # an odd side: its last row or column is in no window
            dx = np.pad(dx, ((0, 0), (0, 0), (0, h - 2 * h2), (0, w - 2 * w2)))
        return dx


class Linear(Layer):
    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.params.update(weight=np.zeros((d_out, d_in), F32), bias=np.zeros(d_out, F32))

    def forward(self, x: np.ndarray, train: bool) -> np.ndarray:
        if train:
            self._saved_x = x
        return (x @ self.params["weight"].T + self.params["bias"]).astype(F32)

    def backward(self, grad: np.ndarray) -> np.ndarray:
        x = self._saved_x
        self.grads.update(weight=(grad.T @ x).astype(F32), bias=grad.sum(axis=0).astype(F32))
        self._saved_x = None
        return (grad @ self.params["weight"]).astype(F32)


class Sequential(Layer):
    """Named children in order; their parameters and buffers are named "<child>.<name>", as torch's."""

    def __init__(self, children: list[tuple[str, Layer]]) -> None:
        super().__init__()
        self.children = list(children)

    def forward(self, x: np.ndarray, train: bool) -> np.ndarray:
        for _, layer in self.children:
            x = layer.forward(x, train)
        return x

    def backward(self, grad: np.ndarray) -> np.ndarray:
        for _, layer in reversed(self.children):
            grad = layer.backward(grad)
        return grad

    def named(self, prefix: str = "") -> Iterator[tuple[str, Layer]]:
        for name, layer in self.children:
            yield from layer.named(f"{prefix}{name}.")

    def forget(self) -> None:
        for _, layer in self.named():
            Layer.forget(layer)

    def parameters(self) -> list[tuple[str, Layer, str]]:
        """(state name, layer, key) of every trainable array, in torch's order."""
        return [(f"{prefix}{key}", layer, key) for prefix, layer in self.named() for key in layer.params]

    def state(self) -> dict[str, np.ndarray]:
        """The state dict: parameters then buffers of each layer, as torch orders them."""
        out: dict[str, np.ndarray] = {}
        for prefix, layer in self.named():
            out.update({f"{prefix}{k}": v.copy() for k, v in layer.params.items()})
            out.update({f"{prefix}{k}": np.array(v) for k, v in layer.buffers.items()})
        return out

    def load(self, weights: dict[str, np.ndarray]) -> None:
        """Load a state dict: every name, shape and dtype kind must fit (ValueError names the first
        that does not; nothing is loaded then)."""
        own = self.state()
        missing = [k for k in own if k not in weights]
        unknown = [k for k in weights if k not in own]
        if missing or unknown:
            raise ValueError(f"weights do not fit this W_c: missing {missing[:5]}, unknown {unknown[:5]}")
        for name, value in own.items():
            arr = np.asarray(weights[name])
            if arr.shape != value.shape or (arr.dtype.kind == "f") != (value.dtype.kind == "f"):
                raise ValueError(f"{name!r}: {arr.dtype}{list(arr.shape)} does not fit {value.dtype}{list(value.shape)}")
        for prefix, layer in self.named():
            for store in (layer.params, layer.buffers):
                for key, old in store.items():
                    store[key] = np.array(weights[f"{prefix}{key}"], dtype=old.dtype, copy=True).reshape(old.shape)


def global_avg_pool(x: np.ndarray) -> np.ndarray:
    """[N, C, H, W] -> [N, C] (models.pool)."""
    return x.mean(axis=(2, 3), dtype=np.float64).astype(F32) if x.ndim == 4 else x


def global_avg_pool_backward(grad: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    if len(shape) != 4:
        return grad
    return np.broadcast_to((grad / F32(shape[2] * shape[3]))[:, :, None, None], shape).astype(F32)
