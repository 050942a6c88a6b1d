"""Torch steps the baselines share: local tensors, shuffled minibatches, test accuracy.

FedAvg, SplitFed and FedProto all train on a device's own uint8 images and evaluate a full
model on images; keeping these few lines in one place keeps the three strategies comparable
(same normalisation, same batching, same accuracy definition as the H-SFP cloud).
"""

from __future__ import annotations

import itertools
from typing import Any, Callable, Iterable, Iterator, Mapping, Protocol

import numpy as np
import torch
from torch import nn

from splitedge.methods.config import ModelSpec
from splitedge.methods.data.preprocess import to_input
from splitedge.methods.training import Batch
from splitedge.models import SplitModel, create_split, device_of, seeded_init


def build_split(spec: ModelSpec) -> SplitModel:
    """The run's network, initialised from the spec's seed (reproducible runs) without
    touching the process's global torch RNG (sim runs every node in one process)."""
    with seeded_init(spec.seed):
        return create_split(spec.model, num_classes=spec.num_classes, in_channels=spec.channels,
                            image_size=spec.image_size)


def local_tensors(data: tuple[np.ndarray, np.ndarray], spec: ModelSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """A device's uint8 images and labels as normalised float32 [N,C,H,W] and int64 [N] tensors,
    on the CPU (a part computing on a GPU moves each batch there: `tensor_batches`)."""
    x = torch.from_numpy(to_input(data[0], spec.mean, spec.std))
    y = torch.from_numpy(np.asarray(data[1], dtype=np.int64))
    return x, y


def shuffled_batches(n: int, size: int, gen: torch.Generator, min_size: int = 2) -> list[torch.Tensor]:
    """Index tensors of one shuffled epoch; batches smaller than `min_size` are dropped
    because BatchNorm cannot train on a single sample."""
    order = torch.randperm(n, generator=gen)
    return [order[i:i + size] for i in range(0, n, size) if len(order[i:i + size]) >= min_size]


def tensor_batches(x: torch.Tensor, y: torch.Tensor, batch: int, gen: torch.Generator,
                   device: torch.device | str = "cpu") -> Callable[[], Iterator[Batch]]:
    """One shuffled epoch of (x, y) minibatches per call (methods.training.train_epochs' input),
    each moved to `device`. The order comes from `gen`, a CPU generator, so it is the same
    whichever device trains."""
    def epoch() -> Iterator[Batch]:
        for idx in shuffled_batches(len(y), batch, gen):
            yield Batch(x[idx].to(device), y[idx].to(device))

    return epoch


def model_outputs(model: SplitModel, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """The whole network's forward as training outputs: penultimate "features" and "logits"."""
    features, logits = model.features_and_logits(x)
    return {"features": features, "logits": logits}


class Optimizer(Protocol):
    """What the training loops call: PlainSGD on devices, any torch.optim optimiser elsewhere."""

    def zero_grad(self) -> None: ...

    def step(self) -> None: ...


class PlainSGD:
    """SGD with momentum and weight decay, step for step what ``torch.optim.SGD`` does on CPU
    (its single-tensor path: no dampening, no Nesterov), without ``torch.optim``'s cost.

    Constructing or stepping any ``torch.optim`` optimiser imports ``torch._dynamo`` (its
    methods are wrapped in ``torch._disable_dynamo``): ~800 modules and 80-170 MB of RSS,
    a third of a small device's budget, for nothing a device uses. ``zero_grad``/``step``
    match the torch API, so the training loops take either.
    """

    def __init__(self, params: Iterable[nn.Parameter], lr: float, momentum: float = 0.0,
                 weight_decay: float = 0.0) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.lr, self.momentum, self.weight_decay = float(lr), float(momentum), float(weight_decay)
        self.momentum_buffers: list[torch.Tensor | None] = [None] * len(self.params)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        for i, p in enumerate(self.params):
            if p.grad is None:
                continue
            grad = p.grad
            if self.weight_decay != 0:
                grad = grad.add(p, alpha=self.weight_decay)
            if self.momentum != 0:
                buf = self.momentum_buffers[i]
                if buf is None:
                    buf = self.momentum_buffers[i] = grad.detach().clone()
                else:
                    buf.mul_(self.momentum).add_(grad)
                grad = buf
            p.add_(grad, alpha=-self.lr)

    def state_dict(self) -> dict[str, Any]:
        """Settings and momentum buffers (a parked or restarted part carries them on)."""
        return {"lr": self.lr, "momentum": self.momentum, "weight_decay": self.weight_decay,
                "momentum_buffers": [None if b is None else b.detach().clone() for b in self.momentum_buffers]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        buffers = list(state["momentum_buffers"])
        if len(buffers) != len(self.params):
            raise ValueError(f"{len(buffers)} momentum buffers for {len(self.params)} parameters")
        self.lr, self.momentum, self.weight_decay = (float(state[k]) for k in ("lr", "momentum", "weight_decay"))
        self.momentum_buffers = [None if b is None else torch.as_tensor(b).to(p.device, p.dtype).clone().reshape(p.shape)
                                 for b, p in zip(buffers, self.params)]


def retune(opt: Any, **settings: float) -> None:
    """Change an optimiser's settings in place (lr, momentum, weight_decay), keeping its state
    (momentum buffers): how a part takes changed settings announced mid-run."""
    groups = getattr(opt, "param_groups", None)
    for key, value in settings.items():
        if groups is None:
            setattr(opt, key, float(value))
        else:
            for group in groups:
                group[key] = float(value)


def sgd(params: Iterable[nn.Parameter], lr: float, momentum: float, weight_decay: float) -> PlainSGD:
    """The device optimiser of every method: torch.optim.SGD's arithmetic in a device-sized process."""
    return PlainSGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)


def device_optimizer(params: Iterable[nn.Parameter], cfg: Any) -> Any:
    """The optimiser a method's config names: `optimizer = "adamw"` (transformers need it:
    torch.optim.AdamW with device_lr and weight_decay), else PlainSGD with momentum."""
    if getattr(cfg, "optimizer", "sgd") == "adamw":
        return torch.optim.AdamW(params, lr=cfg.device_lr, weight_decay=cfg.weight_decay)
    return sgd(params, cfg.device_lr, cfg.momentum, cfg.weight_decay)


def norm_input_moments(model: nn.Module, inputs: Iterable[torch.Tensor],
                       only: str | None = None) -> tuple[list[tuple[str, int]], list[np.ndarray]]:
    """Each image's per-channel input moments to every BatchNorm layer a forward of `model` runs,
    in eval mode (each image's alone: normalised with the statistics the model holds): the layout
    [(name, channels)] in module order and, per batch of `inputs`, vectors [N, 2 sum C] of
    [mean over positions of x, of x^2] per layer (methods/privacy/norm_stats.py releases them)."""
    norms = {name: m for name, m in model.named_modules()
             if isinstance(m, nn.modules.batchnorm._BatchNorm) and only in (None, name)}
    taken: dict[str, torch.Tensor] = {}

    def tapper(name: str) -> Callable[..., None]:
        def tap(_m: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            x = args[0].double()
            dims = tuple(range(2, x.dim()))
            taken[name] = torch.cat([x.mean(dims), (x * x).mean(dims)] if dims else [x, x * x], dim=1)
        return tap

    hooks = [m.register_forward_pre_hook(tapper(name)) for name, m in norms.items()]
    was_training, out, layout, device = model.training, [], None, device_of(model)
    try:
        model.eval()
        with torch.inference_mode():
            for x in inputs:
                taken.clear()
                model(x.to(device))
                if layout is None:  # the layers this forward runs (a model's unused heads are not)
                    layout = [(name, int(m.num_features)) for name, m in norms.items() if name in taken]
                out.append(torch.cat([taken[name] for name, _ in layout], dim=1).cpu().numpy())
    finally:
        for h in hooks:
            h.remove()
        model.train(was_training)
    return layout or [], out


def private_norms(part: Any, model: nn.Module, inputs: Callable[[], Iterable[torch.Tensor]]) -> dict[str, np.ndarray]:
    """With DP and `dp_bn_clip` > 0: the private release of `model`'s BatchNorm statistics over
    the device's `inputs()` (the model it received: call before training it), for
    release.private_weights to send in place of the received ones. Else nothing (no pass).

    Layer by layer in forward order, on a copy of the model holding the statistics released so
    far: each layer's input is then normalised upstream as the served model will normalise it,
    not by the statistics of an earlier model (which, scaled wrongly, left a model at chance for
    a round). One release in all (norm_stats.sequential_sigma)."""
    if not (part.cfg.dp_sigma > 0 and part.cfg.dp_bn_clip > 0):
        return {}
    import copy

    from splitedge.methods.privacy.release import private_norm_statistics

    work = copy.deepcopy(model)
    layout, _ = norm_input_moments(work, itertools.islice(inputs(), 1))  # the layers a forward runs
    return private_norm_statistics(part, layout, lambda name: norm_input_moments(work, inputs(), only=name)[1],
                                   lambda stats: _set_buffers(work, stats))


def _set_buffers(model: nn.Module, values: Mapping[str, np.ndarray]) -> None:
    state = model.state_dict()  # shares storage with the module's buffers
    with torch.no_grad():
        for k, v in values.items():
            state[k].copy_(torch.from_numpy(np.asarray(v)))


def input_batches(x: torch.Tensor, size: int = 256) -> Callable[[], Iterator[torch.Tensor]]:
    return lambda: (x[i:i + size] for i in range(0, len(x), size))
