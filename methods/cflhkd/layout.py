"""The `layout` clustering signal: where in the image a device's data makes the first layer fire.

Groups that differ by how their images are taken (turned, flipped, framed) rather than by their
labels are invisible to the classifier's update, which label skew dominates: on CIFAR-10 groups
turned by 0, 90 and 180 degrees, clustering by it found nothing (adjusted Rand index -0.07 / 0.17,
bench/results/cflhkd-two-way-cifar10). The first layer's activations, averaged over the device's
images on a coarse grid, keep the scenes' average layout (sky above, ground below, and the
orientation of edges), which a turn moves. The model is the one the device received, the same
for every device, so the signals differ only by the data.

What it reveals: C x grid x grid numbers (C: the first layer's channels), each a mean over all
the device's images of a ReLU'd filter response over one cell; a blurred summary, not an image.
It has no DP form (config refuses it with dp_sigma).
"""

from __future__ import annotations

import numpy as np
import torch

GRID = 4
MAX_IMAGES = 512
"""Enough for the mean over a device's images to settle; bounds the cost on large shards."""


def first_conv(model: torch.nn.Module) -> torch.nn.Module:
    """The model's first convolution in module order; ValueError for a model without one."""
    for module in model.modules():
        if isinstance(module, torch.nn.Conv2d):
            return module
    raise ValueError("signal=layout needs a model with a convolution (a cnn, fedcnn or resnet W_c)")


@torch.no_grad()
def layout_signal(model: torch.nn.Module, x: torch.Tensor, grid: int = GRID,
                  max_images: int = MAX_IMAGES, batch: int = 128) -> np.ndarray:
    """Mean over the images (the first ``max_images``) of ReLU(first convolution), average-pooled
    to ``grid`` x ``grid`` cells: float32 [C * grid * grid]."""
    conv = first_conv(model)
    total: torch.Tensor | None = None
    n = min(len(x), max_images)
    for start in range(0, n, batch):
        out = torch.relu(conv(x[start:start + batch]))
        pooled = torch.nn.functional.adaptive_avg_pool2d(out, grid).sum(dim=0)
        total = pooled if total is None else total + pooled
    if total is None:
        raise ValueError("signal=layout: the device holds no images")
    return (total / n).flatten().numpy().astype(np.float32)
