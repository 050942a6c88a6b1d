"""A device's local W_c training without torch: the torch devices' steps in numpy.

`SupConTrainer` is what an H-SFP torch device does in `train_epoch` (methods/hsfp/device_torch.py):
two augmented views through the local W_c, global average pooling, the private projection head
(or the shared simplex ETF), SupCon (or cross-entropy), FedDecorr when switched on, and SGD with
momentum 0.9 and weight decay 5e-4 over W_c and the head. `SplitTrainer` is SplitFed's device
step: W_c forward, the edge's gradient of the activations, W_c backward and SGD.

Both keep their state as `state_dict`/`load_state_dict`, so a parked or restarted device carries
its local copy, head and momentum on (methods/snapshot.py keeps such objects).
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Mapping

import numpy as np

from splitedge.methods.data.preprocess import to_input
from splitedge.methods.simplex import simplex_etf
from splitedge.methods.thin.augment import two_views
from splitedge.methods.thin.chunked import ChunkedStep
from splitedge.methods.thin.layers import ReLU, Sequential, global_avg_pool, global_avg_pool_backward
from splitedge.methods.thin.losses import etf_cross_entropy, feddecorr, supcon
from splitedge.methods.thin.optim import NumpySGD
from splitedge.methods.thin.per_sample import freeze_norms, per_sample_backward
from splitedge.methods.thin.wc_models import out_channels, projection_head, thin_wc


def load_batch(images: Any, idx: np.ndarray, mean: Any, std: Any) -> np.ndarray:
    """Normalised float32 images of `idx`, in that order, read in ascending order (a streamed
    shard reads forward)."""
    return to_input(np.asarray(images[np.sort(idx)])[np.argsort(np.argsort(idx))], mean, std)


def eval_forward(wc: Sequential, x: np.ndarray, *, pre_relu: bool = False) -> np.ndarray:
    """W_c in eval mode (running BatchNorm statistics) on normalised images; with pre_relu its
    last ReLU is left out (a max-pool after it commutes with it), as models.pre_activation does."""
    leaves = [layer for _, layer in wc.named()]
    if pre_relu:
        last = max(i for i, layer in enumerate(leaves) if isinstance(layer, ReLU))
        leaves = leaves[:last] + leaves[last + 1:]
    out = np.ascontiguousarray(x, dtype=np.float32)
    for layer in leaves:
        out = layer.forward(out, train=False)
    return out


def epoch_order(n: int, batch: int, rng: np.random.Generator, min_size: int = 2) -> Iterator[np.ndarray]:
    """Shuffled index batches of one epoch; a last batch under `min_size` is dropped (BatchNorm
    cannot train on one sample), as the torch devices do."""
    order = rng.permutation(n)
    for start in range(0, n, batch):
        idx = order[start:start + batch]
        if len(idx) >= min_size:
            yield idx


class SupConTrainer:
    """H-SFP's device training of its own W_c copy, in numpy."""

    numpy_state = True  # methods/snapshot.py restores its state as arrays, without torch

    def __init__(self, model: str, channels: int, *, proj_dim: int, lr: float, tau: float, seed: int,
                 target: str = "supcon", classes: int = 0, etf_seed: int = 0, etf_tau: float = 0.1,
                 feddecorr_beta: float = 0.0, chunk: int = 0) -> None:
        self.wc = thin_wc(model, channels)
        self.chunk = int(chunk)  # > 0: W_c trains that many views at a time, exactly (methods/thin/chunked.py)
        self.width = out_channels(self.wc)
        self.head = projection_head(self.width, proj_dim, np.random.default_rng(seed)) if target == "supcon" else None
        # etf: the simplex every device builds from the run's seed (methods/hsfp/etf.py)
        self.etf = simplex_etf(self.width, classes, etf_seed) if target == "etf" else None
        self.etf_tau, self.tau = float(etf_tau), float(tau)
        self.feddecorr_beta = float(feddecorr_beta)
        self.lr = float(lr)
        self.opt = self._new_optimizer()
        self.started = False  # whether W_c was loaded: before that its zeros are kept nowhere

    def _new_optimizer(self) -> NumpySGD:
        params = self.wc.parameters() + ([] if self.head is None else
                                         [(f"head.{n}", layer, k) for n, layer, k in self.head.parameters()])
        return NumpySGD(params, self.lr, momentum=0.9, weight_decay=5e-4)

    def load(self, weights: Mapping[str, np.ndarray]) -> None:
        """A new global W_c: the local copy starts from it with fresh momentum (the head stays)."""
        self.wc.load(dict(weights))
        self.opt = self._new_optimizer()
        self.started = True

    def features(self, x: np.ndarray, *, pre_relu: bool = False) -> np.ndarray:
        """The local W_c in eval mode on normalised images (`eval_forward`)."""
        return eval_forward(self.wc, x, pre_relu=pre_relu)

    def retune(self, lr: float) -> None:
        self.lr = self.opt.lr = float(lr)

    def weights(self) -> dict[str, np.ndarray]:
        """The local W_c as a weight map (torch state names and dtypes) for the slow average."""
        return self.wc.state()

    def step(self, x: np.ndarray, y: np.ndarray, rng: np.random.Generator) -> dict[str, float]:
        """One SGD step on two augmented views of a normalised batch [B, C, H, W]; the loss terms' values."""
        return self.step_views(two_views(x, rng), np.concatenate([y, y]))

    def step_views(self, views: np.ndarray, labels: np.ndarray) -> dict[str, float]:
        """One SGD step on given views [2B, C, H, W] (view-major) and their labels [2B]."""
        self.opt.zero_grad()
        chunked = ChunkedStep(self.wc, self.chunk) if 0 < self.chunk < len(views) else None
        if chunked is None:
            fmap = self.wc.forward(views, train=True)
            pooled, shape = global_avg_pool(fmap), fmap.shape[1:]
            del fmap
        else:
            pooled, shape = chunked.forward(views, global_avg_pool)
        if self.head is None:
            loss, dpooled = etf_cross_entropy(pooled, labels, self.etf, self.etf_tau)
            parts = {"etf": loss}
        else:
            z = self.head.forward(pooled, train=True)
            loss, dz = supcon(z, labels, self.tau)
            dpooled = self.head.backward(dz)
            parts = {"supcon": loss}
        if self.feddecorr_beta > 0:
            decorr, ddecorr = feddecorr(pooled)
            dpooled = dpooled + np.float32(self.feddecorr_beta) * ddecorr
            parts["feddecorr"] = decorr
            loss += self.feddecorr_beta * decorr
        if chunked is None:
            self.wc.backward(global_avg_pool_backward(dpooled, (len(views),) + tuple(shape)))
        else:
            chunked.backward(views, dpooled, global_avg_pool_backward, shape)
        self.opt.step()
        parts["total"] = loss
        return parts

    def train_epoch(self, images: Any, labels: np.ndarray, mean: Any, std: Any, batch: int,
                    rng: np.random.Generator) -> dict[str, float]:
        """One epoch over a device's uint8 images (an array or a streamed store indexed by batch);
        returns the sample-weighted mean of each loss term."""
        sums: dict[str, float] = {}
        seen = 0
        for idx in epoch_order(len(labels), batch, rng):
            x = load_batch(images, idx, mean, std)
            parts = self.step(x, np.asarray(labels)[idx].astype(np.int64), rng)
            for k, v in parts.items():
                sums[k] = sums.get(k, 0.0) + v * len(idx)
            seen += len(idx)
        self.wc.forget()
        if self.head is not None:
            self.head.forget()
        return {k: v / max(seen, 1) for k, v in sums.items()}

    def sample_grads(self, x: np.ndarray, y: np.ndarray, rng: np.random.Generator) -> tuple[dict[str, np.ndarray], float]:
        """Each image's gradient of its own loss (the mean over its two augmented views of the ETF
        cross-entropy), {W_c state name: [B, ...] float64}, and the summed loss, with W_c's
        BatchNorms frozen (methods/thin/per_sample.py): DP-SGD's per-sample gradients."""
        if self.head is not None or self.feddecorr_beta > 0:
            raise ValueError("per-image gradients need a per-image loss: device_target=etf without FedDecorr")
        b = len(x)
        fmap = self.wc.forward(two_views(x, rng), train=True)
        pooled, shape = global_avg_pool(fmap), fmap.shape
        del fmap
        loss, dpooled = etf_cross_entropy(pooled, np.concatenate([y, y]), self.etf, self.etf_tau)
        dpooled *= np.float32(b)  # the loss was the mean over 2B views: each image's is the mean of its 2
        grads, _ = per_sample_backward(self.wc, global_avg_pool_backward(dpooled, shape))
        return {k: g[:b] + g[b:] for k, g in grads.items()}, loss * b

    def train_dpsgd(self, images: Any, labels: np.ndarray, mean: Any, std: Any, cfg: Any,
                    rng: np.random.Generator, chunk: int = 8) -> dict[str, float]:
        """One round of DP-SGD (methods/privacy/dpsgd.py): `steps(cfg)` steps, each on a Poisson
        draw of the images at cfg.dp_sample_rate, their gradients clipped to cfg.dp_grad_clip,
        summed, noised at cfg.dp_sigma and divided by cfg.device_batch, then the SGD step. The
        draws and the noise come from the OS's entropy; `rng` only augments. `chunk` images at a
        time (BatchNorm frozen: no batch statistics, so chunks are exact)."""
        from splitedge.methods.budget import checkpoint
        from splitedge.methods.privacy.dpsgd import clip_per_sample, noisy_step_gradient, poisson_batch, steps
        from splitedge.methods.privacy.release import entropy_rng

        secret = entropy_rng()
        layers = {name: (layer, key) for name, layer, key in self.opt.params}
        total_loss, seen = 0.0, 0
        freeze_norms(self.wc)
        try:
            for _ in range(steps(cfg)):
                checkpoint()
                idx = poisson_batch(len(labels), cfg.dp_sample_rate, secret)
                summed = {name: np.zeros(layer.params[key].shape) for name, (layer, key) in layers.items()}
                for start in range(0, len(idx), chunk):
                    part = idx[start:start + chunk]
                    x = load_batch(images, part, mean, std)
                    grads, loss = self.sample_grads(x, np.asarray(labels)[part].astype(np.int64), rng)
                    for k, g in clip_per_sample(grads, cfg.dp_grad_clip).items():
                        summed[k] += g.sum(axis=0)
                    total_loss, seen = total_loss + loss, seen + len(part)
                self.opt.zero_grad()
                noisy = noisy_step_gradient(summed, clip=cfg.dp_grad_clip, sigma=cfg.dp_sigma,
                                            divisor=cfg.device_batch, rng=secret)
                for name, g in noisy.items():
                    layer, key = layers[name]
                    layer.grads[key] = g
                self.opt.step()
        finally:
            freeze_norms(self.wc, False)
            self.wc.forget()
        return {"etf": total_loss / max(seen, 1), "total": total_loss / max(seen, 1)}

    def state_dict(self) -> dict[str, Any]:
        """The local W_c (once it started from a global one), the head and the momentum."""
        return {"wc": self.wc.state() if self.started else None,
                "head": None if self.head is None else self.head.state(), "opt": self.opt.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("wc") is not None:
            self.wc.load(state["wc"])
            self.started = True
        if self.head is not None and state.get("head") is not None:
            self.head.load(state["head"])
        self.opt = self._new_optimizer()
        self.opt.load_state_dict(state["opt"])
        self.lr = self.opt.lr


def _same(out: np.ndarray) -> np.ndarray:
    """A chunk's activations as they are (SplitFed sends W_c's output itself)."""
    return out


def _same_backward(grad: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    return np.array(grad, dtype=np.float32)  # a copy: layers reuse the buffer they are given


Request = Callable[[np.ndarray, np.ndarray], np.ndarray]
"""(activations [B, ...], labels [B]) -> the edge's gradient of the loss for those activations."""


class SplitTrainer:
    """SplitFed's device step in numpy: the loss is at the edge, the device back-propagates its
    gradient (d/d(act) of sum(act * grad) is grad)."""

    numpy_state = True

    def __init__(self, model: str, channels: int, chunk: int = 0) -> None:
        self.wc = thin_wc(model, channels)
        self.chunk = int(chunk)  # > 0: W_c trains that many samples at a time, exactly (methods/thin/chunked.py)

    def state_dict(self) -> dict[str, Any]:
        return {"wc": self.wc.state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.wc.load(state["wc"])

    def load(self, weights: Mapping[str, np.ndarray]) -> None:
        self.wc.load(dict(weights))

    def weights(self) -> dict[str, np.ndarray]:
        return self.wc.state()

    def features(self, x: np.ndarray) -> np.ndarray:
        """W_c in eval mode on normalised images (`eval_forward`)."""
        return eval_forward(self.wc, x)

    def train_epoch(self, images: Any, labels: np.ndarray, mean: Any, std: Any, batch: int, opt: NumpySGD,
                    rng: np.random.Generator, request: Request) -> float:
        """One epoch: per batch, forward, ask the edge for the gradient, backward, step. Returns
        the mean of sum(act * grad) per sample (the split term the torch device logs)."""
        total, seen = 0.0, 0
        for idx in epoch_order(len(labels), batch, rng):
            x = load_batch(images, idx, mean, std)
            chunked = ChunkedStep(self.wc, self.chunk) if 0 < self.chunk < len(x) else None
            act = self.wc.forward(x, train=True) if chunked is None else chunked.forward(x, _same)[0]
            grad = request(act, np.asarray(labels)[idx].astype(np.int64))
            if grad.shape != act.shape:
                raise ValueError(f"gradient shape {tuple(grad.shape)} does not match activations {tuple(act.shape)}")
            total += float((act.astype(np.float64) * grad).sum())  # before backward, which reuses grad's buffer
            opt.zero_grad()
            if chunked is None:
                self.wc.backward(np.asarray(grad, dtype=np.float32))
            else:
                del act
                chunked.backward(x, np.asarray(grad, dtype=np.float32), _same_backward, grad.shape[1:])
            opt.step()
            seen += len(idx)
        self.wc.forget()
        return total / max(seen, 1)

    def optimizer(self, lr: float, momentum: float, weight_decay: float) -> NumpySGD:
        return NumpySGD(self.wc.parameters(), lr, momentum=momentum, weight_decay=weight_decay)
