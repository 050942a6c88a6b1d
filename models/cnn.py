"""Small Conv-BN-ReLU CNN split for Pi-class devices (8x8 digits and 32x32 CIFAR).

W_c halves the resolution once so the per-sample W_c output (whose per-class mean and
variance go on the wire) stays compact:
  32x32xC: W_c -> (w, 16, 16) = 256 w floats  (w=32: 8,192);  W_e -> (2w, 8, 8)
  8x8x1:   W_c -> (w, 4, 4)   = 16 w floats   (w=32: 512);    W_e -> (2w, 2, 2)
W_g is global average pooling plus one linear layer, so the cloud head is tiny.
"""
from __future__ import annotations

from collections import OrderedDict

from torch import nn

from splitedge.models.registry import register_model
from splitedge.models.split import SplitModel


def conv_block(c_in: int, c_out: int, stride: int = 1) -> nn.Sequential:
    """3x3 conv (no bias: BN follows) + BatchNorm + ReLU."""
    return nn.Sequential(OrderedDict([
        ("conv", nn.Conv2d(c_in, c_out, kernel_size=3, stride=stride, padding=1, bias=False)),
        ("bn", nn.BatchNorm2d(c_out)),
        ("relu", nn.ReLU(inplace=True)),
    ]))


@register_model("cnn")
def cnn_split(*, num_classes: int, in_channels: int, image_size: int,
              width: int = 32) -> SplitModel:
    """Four conv blocks (two on the device, two on the edge) and a linear cloud head."""
    if width < 1:
        raise ValueError(f"width must be >= 1, got {width}")
    w = int(width)
    wc = nn.Sequential(OrderedDict([
        ("block1", conv_block(in_channels, w)),
        ("block2", conv_block(w, w, stride=2)),
    ]))
    we = nn.Sequential(OrderedDict([
        ("block3", conv_block(w, 2 * w)),
        ("block4", conv_block(2 * w, 2 * w, stride=2)),
    ]))
    wg = nn.Sequential(OrderedDict([
        ("avgpool", nn.AdaptiveAvgPool2d(1)),
        ("flatten", nn.Flatten(1)),
        ("fc", nn.Linear(2 * w, num_classes)),
    ]))
    return SplitModel(wc, we, wg, (in_channels, image_size, image_size), num_classes)
