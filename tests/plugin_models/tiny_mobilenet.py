"""A model of one's own, defined only here (tests/methods/test_plugins.py): a MobileNet-like net of
inverted residual blocks written with plain torch layers, cut by module names."""

from __future__ import annotations

import os
from pathlib import Path

from torch import nn

from splitedge.models import SplitModel, split_module


def block(c_in: int, c_out: int, stride: int, expand: int = 4) -> nn.Sequential:
    """An inverted residual block without its skip: 1x1 expand, 3x3 depthwise, 1x1 project."""
    mid = c_in * expand
    return nn.Sequential(nn.Conv2d(c_in, mid, 1, bias=False), nn.BatchNorm2d(mid), nn.ReLU6(),
                         nn.Conv2d(mid, mid, 3, stride, 1, groups=mid, bias=False), nn.BatchNorm2d(mid), nn.ReLU6(),
                         nn.Conv2d(mid, c_out, 1, bias=False), nn.BatchNorm2d(c_out))


if os.environ.get("SPLITEDGE_TEST_IMPORTED"):  # a test asks which processes imported this module
    Path(os.environ["SPLITEDGE_TEST_IMPORTED"]).write_text(str(os.getpid()))


class TinyMobileNet(nn.Module):
    def __init__(self, in_channels: int, num_classes: int) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(in_channels, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU6())
        self.block1 = block(16, 16, 1)
        self.block2 = block(16, 32, 2)
        self.block3 = block(32, 64, 2)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(64, num_classes)


def factory(*, num_classes: int, in_channels: int, image_size: int) -> SplitModel:
    net = TinyMobileNet(in_channels, num_classes)
    return split_module(net, wc=["stem", "block1"], we=["block2", "block3"], wg=["pool", nn.Flatten(1), "fc"],
                        in_shape=(in_channels, image_size, image_size), num_classes=num_classes)


def not_a_split(*, num_classes: int, in_channels: int, image_size: int) -> nn.Module:
    """A factory that forgot to split: refused by name."""
    return TinyMobileNet(in_channels, num_classes)
