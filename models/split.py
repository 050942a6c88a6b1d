"""The split model: three parts (W_c, W_e, W_g) that together form an ordinary network.

Each tier trains only its own part, but evaluation and export need the assembled model, so
`SplitModel` is a plain `nn.Module` whose forward is `wg(we(wc(x)))`. The per-sample output
shapes of W_c and W_e are recorded because moments and wire messages are sized by them.
"""
from __future__ import annotations

import contextlib
import threading
from collections import OrderedDict
from typing import Any, Iterator, Sequence

import torch
from torch import nn

from splitedge.models.state import device_of

PART_NAMES = ("wc", "we", "wg")
_INIT_LOCK = threading.Lock()


@contextlib.contextmanager
def seeded_init(seed: int) -> Iterator[None]:
    """Build modules from `seed` alone: torch's initialisers draw from the process-wide RNG, so
    nodes that build models at the same time in one process (a sim's threads) would interleave
    their draws. This holds a lock, seeds a forked RNG and restores the caller's afterwards."""
    with _INIT_LOCK, torch.random.fork_rng(devices=[]):
        # the CPU generator alone: torch.manual_seed also queues a lazy CUDA seeding, which
        # formats the caller's stack each time (costly for thousands of virtual devices)
        torch.random.default_generator.manual_seed(seed)
        yield


def pool(feat: torch.Tensor) -> torch.Tensor:
    """Global-average-pool a feature map to [B, C] (SupCon works on pooled features).

    4-d maps [B, C, H, W] are averaged over H and W; anything else is returned unchanged,
    so the same call works on W_c/W_e maps and on already-flat features.
    """
    return feat.mean(dim=(2, 3)) if feat.dim() == 4 else feat


def head_features(wg: nn.Module, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(penultimate features [B, D], logits) of a head W_g whose last layer is the classifier:
    the representation regularisers such as FedDecorr act on."""
    if not isinstance(wg, nn.Sequential) or len(wg) < 2:
        raise ValueError("W_g must be an nn.Sequential ending in its classifier")
    features = pool(wg[:-1](h))
    return features, wg[-1](features)


class NormClip(nn.Module):
    """Each row scaled to L2 norm <= `clip` (x min(1, clip / ||x||)): what a head fitted on
    differentially private statistics of clipped features must see (methods/privacy/dp.py)."""

    def __init__(self, clip: float) -> None:
        super().__init__()
        if not clip > 0:
            raise ValueError(f"clip must be > 0, got {clip}")
        self.clip = float(clip)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        norms = torch.linalg.vector_norm(x, dim=1, keepdim=True)
        return x * torch.clamp(self.clip / norms.clamp_min(1e-30), max=1.0)

    def extra_repr(self) -> str:
        return f"clip={self.clip:g}"


def clip_head_input(model: nn.Module, clip: float) -> nn.Module:
    """`model` (a SplitModel) whose classifier first clips its input to `clip`: the served form of
    a head fitted on clipped statistics (its weights keep their values; names gain a level)."""
    model.wg[-1] = nn.Sequential(NormClip(clip), model.wg[-1])
    return model


def head_at_layer(model: "SplitModel", stage: str, side: int | None) -> "SplitModel":
    """The served network of a head placed at W_c's ("wc") or W_e's ("we") output: the same
    W_c (and W_e) modules, then an average pool to `side` x `side` (None: none), a flatten and
    a fresh linear head ("wg.head.*") where W_g was (methods/calibration/layers.py).
    The stages above the head are dropped; parameters below are shared with `model`, and the
    network is in `model`'s mode."""
    if stage not in ("wc", "we"):
        raise ValueError(f"a head off the classifier sits at wc or we, not {stage!r}")
    we = model.we if stage == "we" else nn.Identity()
    shape = model.we_shape if stage == "we" else model.wc_shape
    pool_ = nn.AdaptiveAvgPool2d(side) if side is not None else nn.Identity()
    dim = int(shape[0]) * side * side if side is not None else int(torch.Size(shape).numel())
    with seeded_init(0):  # its weights are the calibrated head's; building it draws nothing from torch's RNG
        head = nn.Linear(dim, model.num_classes).to(device_of(model))  # where the model computes
    wg = nn.Sequential(OrderedDict([("pool", pool_), ("flatten", nn.Flatten(1)), ("head", head)]))
    return SplitModel(model.wc, we, wg, model.in_shape, model.num_classes).train(model.training)


RELU_COMMUTES = (nn.MaxPool2d, nn.AdaptiveMaxPool2d, nn.Flatten, nn.Identity)
"""Layers a final ReLU may precede and still be moved after: relu(max(x)) = max(relu(x))."""


def pre_activation(module: nn.Module) -> nn.Module:
    """`module` computed without its final ReLU: new nn.Sequential containers around the same
    layers (every parameter and buffer shared, the same state names), that ReLU an Identity.
    H-SFP's `pre_relu` takes moments there, where features are closer to Gaussian, and applies
    the ReLU to what it samples. The containers take the part's train/eval flag, so code that
    saves and restores a module's mode (torch.onnx.export) leaves the part's layers as they
    were. ValueError when `module` does not end in a ReLU, possibly
    followed by max-pooling or flattening, inside nested nn.Sequential (ResNet blocks apply
    theirs inside forward)."""
    found, out = _drop_final_relu(module)
    if not found:
        raise ValueError(f"{type(module).__name__} does not end in an nn.ReLU inside nn.Sequential "
                         f"(optionally followed by max-pooling or flattening)")
    return out


def _drop_final_relu(module: nn.Module) -> tuple[bool, nn.Module]:
    if isinstance(module, nn.ReLU):
        return True, nn.Identity()
    if not isinstance(module, nn.Sequential):
        return False, module
    children = dict(module.named_children())
    for name in reversed(list(children)):
        found, new = _drop_final_relu(children[name])
        if found:
            children[name] = new
            seq = nn.Sequential(OrderedDict(children))
            seq.training = module.training  # not .train(): that would set the shared layers' modes too
            return True, seq
        if not isinstance(children[name], RELU_COMMUTES):
            return False, module
    return False, module


class ClassifierInput(nn.Module):
    """W_e and W_g's trunk: W_c features -> the classifier's input [B, D], as `head_features`
    computes it. What head calibration runs on devices (torch, or exported to ONNX for thin
    ones). It shares the given modules; state names are "we.*" and "wg.*" as in the split model,
    without the classifier (W_g's last layer), which calibration refits."""

    def __init__(self, we: nn.Module, wg: nn.Module) -> None:
        super().__init__()
        if not isinstance(wg, nn.Sequential) or len(wg) < 2:
            raise ValueError("W_g must be an nn.Sequential ending in its classifier")
        self.we, self.wg = we, wg[:-1]

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return pool(self.wg(self.we(h)))

    def stages(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_e's output, the classifier's input) of W_c features `h`, in one pass."""
        e = self.we(h)
        return e, pool(self.wg(e))


@torch.no_grad()
def infer_shape(module: nn.Module, in_shape: tuple[int, ...]) -> tuple[int, ...]:
    """Per-sample output shape of `module` for per-sample input shape `in_shape`.

    Runs one zero sample in eval mode (BatchNorm cannot train on a single 1x1 sample) and
    restores the previous train/eval mode, so building a model has no lasting effect.
    """
    was_training = module.training
    module.eval()
    try:
        out = module(torch.zeros((1, *in_shape)))
    finally:
        module.train(was_training)
    return tuple(int(s) for s in out.shape[1:])


class SplitModel(nn.Module):
    """W_c (device) -> W_e (edge) -> W_g (cloud), assembled as one module.

    State-dict names are prefixed by the part ("wc.", "we.", "wg."), and each part can be
    taken alone with `part(name)` to send or average it independently.
    """

    def __init__(self, wc: nn.Module, we: nn.Module, wg: nn.Module,
                 in_shape: tuple[int, int, int], num_classes: int) -> None:
        super().__init__()
        self.wc = wc
        self.we = we
        self.wg = wg
        self.in_shape = tuple(in_shape)
        self.num_classes = int(num_classes)
        self.wc_shape = infer_shape(wc, self.in_shape)
        self.we_shape = infer_shape(we, self.wc_shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.wg(self.we(self.wc(x)))

    def features_and_logits(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(penultimate features, logits) of the whole network in one pass."""
        return head_features(self.wg, self.we(self.wc(x)))

    def part(self, name: str) -> nn.Module:
        """The part called "wc", "we" or "wg" (the names used in `weights` messages)."""
        if name not in PART_NAMES:
            raise ValueError(f"unknown part {name!r}; expected one of {PART_NAMES}")
        return getattr(self, name)

    def extra_repr(self) -> str:
        return f"in_shape={self.in_shape}, wc_shape={self.wc_shape}, we_shape={self.we_shape}"



def split_module(module: nn.Module, *, wc: Sequence[Any], we: Sequence[Any], wg: Sequence[Any],
                 in_shape: tuple[int, int, int], num_classes: int) -> SplitModel:
    """Any network cut into W_c, W_e and W_g by its submodules' dotted names (as
    `module.named_modules()` gives them), in forward order; an nn.Module instead of a name is
    put in as is (e.g. nn.Flatten(1), where the network flattens in its forward). W_g must end
    in its classifier, an nn.Linear piece of its own (head calibration refits it). What a
    factory of one's own model returns (models/registry.py). ValueError naming the piece that
    does not fit: an unknown name, a module used twice, or parts whose shapes do not chain to
    `num_classes` logits."""
    named = dict(module.named_modules())
    used: set[int] = set()

    def part(pieces: Sequence[Any], which: str) -> nn.Sequential:
        if not pieces:
            raise ValueError(f"{which} needs at least one module")
        children: OrderedDict[str, nn.Module] = OrderedDict()
        for i, piece in enumerate(pieces):
            if isinstance(piece, str):
                if piece not in named or not piece:
                    raise ValueError(f"{which}: {type(module).__name__} has no submodule {piece!r}")
                sub, key = named[piece], piece.replace(".", "_")
            elif isinstance(piece, nn.Module):
                sub, key = piece, f"{type(piece).__name__.lower()}{i}"
            else:
                raise ValueError(f"{which}: {piece!r} is neither a submodule's name nor an nn.Module")
            if id(sub) in used:
                raise ValueError(f"{which}: {piece!r} is already in another piece of the split")
            used.add(id(sub))
            children[key] = sub
        return nn.Sequential(children)

    parts = part(wc, "wc"), part(we, "we"), part(wg, "wg")
    if len(parts[2]) < 2 or not isinstance(parts[2][-1], nn.Linear):
        raise ValueError("wg ends in its classifier, an nn.Linear piece of its own after the pieces before it "
                         "(e.g. [nn.Flatten(1), 'fc'], or [..., 'classifier.0', 'classifier.1'] for a container): "
                         "calibration refits that layer")
    try:
        split = SplitModel(*parts, tuple(in_shape), num_classes)
        logits = infer_shape(split.wg, split.we_shape)
    except RuntimeError as exc:
        raise ValueError(f"the split's parts do not chain on inputs of shape {tuple(in_shape)}: {exc}") from None
    if logits != (int(num_classes),):
        raise ValueError(f"wg ends in {logits} per image, not the {num_classes} class logits")
    return split
