"""A plain conv net of one's own (tests/methods/test_plugins.py) whose W_c thin devices can train
too: plain_net_thin.py gives its numpy layers, in a module that imports no torch."""

from __future__ import annotations

from torch import nn

from splitedge.models import SplitModel, split_module


def conv_bn_relu(c_in: int, c_out: int, stride: int = 1) -> list[nn.Module]:
    return [nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU()]


class PlainNet(nn.Module):
    def __init__(self, in_channels: int, num_classes: int) -> None:
        super().__init__()
        self.stem = nn.Sequential(*conv_bn_relu(in_channels, 16))
        self.block1 = nn.Sequential(*conv_bn_relu(16, 16), nn.MaxPool2d(2))
        self.block2 = nn.Sequential(*conv_bn_relu(16, 32, stride=2))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(32, num_classes)


def factory(*, num_classes: int, in_channels: int, image_size: int) -> SplitModel:
    net = PlainNet(in_channels, num_classes)
    return split_module(net, wc=["stem", "block1"], we=["block2"], wg=["pool", nn.Flatten(1), "fc"],
                        in_shape=(in_channels, image_size, image_size), num_classes=num_classes)
