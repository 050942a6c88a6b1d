"""The network a self-supervised method trains: an encoder (a registered split model without
its classifier), a projector and, for SimSiam, a predictor. State-dict names are prefixed by
the module ("encoder.", "projector.", "predictor."), averaged together as one "model" part."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from splitedge.methods.config import ModelSpec
from splitedge.methods.data.preprocess import batches, to_input
from splitedge.models import create_split, seeded_init


def mlp(dim_in: int, hidden: int, dim_out: int) -> nn.Sequential:
    """Linear-BN-ReLU-Linear, the SSD projector's shape (512-2048-512 on a ResNet-18)."""
    return nn.Sequential(nn.Linear(dim_in, hidden), nn.BatchNorm1d(hidden), nn.ReLU(inplace=True),
                         nn.Linear(hidden, dim_out))


class SSLNet(nn.Module):
    def __init__(self, encoder: nn.Module, dim: int, proj_hidden: int, predictor: bool) -> None:
        super().__init__()
        self.dim = dim
        self.encoder = encoder
        self.projector = mlp(dim, proj_hidden * dim, dim)
        # SimSiam's bottleneck predictor (2048-512-2048 in the paper): a quarter of the width
        self.predictor = mlp(dim, max(dim // 4, 8), dim) if predictor else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.encoder(x)


def build_net(spec: ModelSpec, proj_hidden: int, predictor: bool, cfg: Any = None) -> SSLNet:
    """The encoder is the split model `spec.model` up to its classifier's input (the pooled
    penultimate features: 64-d for "cnn", 512-d for "resnet18"), or with `cfg.encoder == "vit"`
    the small ViT of the masked-modelling methods (its mean token); built from the spec's seed."""
    with seeded_init(spec.seed):
        if cfg is not None and cfg.encoder == "vit":
            from splitedge.models.vit_mae import ViTEncoder

            vit = ViTEncoder(spec.image_size, spec.channels, patch=cfg.patch, dim=cfg.vit_dim, depth=cfg.vit_depth,
                             heads=cfg.vit_heads)
            return SSLNet(vit, vit.dim, proj_hidden, predictor)
        split = create_split(spec.model, num_classes=spec.num_classes, in_channels=spec.channels,
                             image_size=spec.image_size)
        encoder = nn.Sequential(split.wc, split.we, *split.wg[:-1])
        return SSLNet(encoder, split.wg[-1].in_features, proj_hidden, predictor)


def to_unit(x: np.ndarray) -> torch.Tensor:
    """uint8 images [N, H, W, C] -> float [N, C, H, W] in [0, 1] (augmentations work there)."""
    return torch.from_numpy(np.ascontiguousarray(np.asarray(x).transpose(0, 3, 1, 2), dtype=np.float32) / 255.0)


def normalise(x01: torch.Tensor, spec: ModelSpec) -> torch.Tensor:
    mean = torch.tensor(spec.mean, dtype=x01.dtype).view(1, -1, 1, 1)
    std = torch.tensor(spec.std, dtype=x01.dtype).view(1, -1, 1, 1)
    return (x01 - mean) / std


@torch.no_grad()
def encode(net: SSLNet, images: np.ndarray, spec: ModelSpec, batch: int = 512) -> np.ndarray:
    """Encoder features [N, D] of uint8 images, eval mode, a batch at a time."""
    net.eval()
    out = [net.encoder(torch.from_numpy(to_input(images[sl], spec.mean, spec.std))).numpy()
           for sl in batches(len(images), batch)]
    return np.concatenate(out) if out else np.zeros((0, net.dim), np.float32)
