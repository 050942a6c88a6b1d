"""tiny_mobilenet's W_c, W_e and W_g trunk in a thin device's numpy layers, with the torch split's
state names (stem.0.weight, block1.3.weight, ...): what a device without torch builds for
`tiny_mobilenet:factory`, depthwise convolutions and ReLU6 included (docs/plugins.md)."""

from __future__ import annotations

from splitedge.methods.thin.graphs import Flatten, GlobalAvgPool
from splitedge.methods.thin.layers import BatchNorm2d, Conv2d, Layer, ReLU6, Sequential
from splitedge.methods.thin.plugins import ThinModel


def block(c_in: int, c_out: int, stride: int, expand: int = 4) -> Sequential:
    """tiny_mobilenet.block: 1x1 expand, 3x3 depthwise, 1x1 project (no skip), as nn.Sequential numbers them."""
    mid = c_in * expand
    layers: list[Layer] = [Conv2d(c_in, mid, 1, 1, 0), BatchNorm2d(mid), ReLU6(),
                           Conv2d(mid, mid, 3, stride, 1, groups=mid), BatchNorm2d(mid), ReLU6(),
                           Conv2d(mid, c_out, 1, 1, 0), BatchNorm2d(c_out)]
    return Sequential([(str(i), layer) for i, layer in enumerate(layers)])


def wc(in_channels: int) -> Sequential:
    stem = Sequential([("0", Conv2d(in_channels, 16, 3, 1, 1)), ("1", BatchNorm2d(16)), ("2", ReLU6())])
    return Sequential([("stem", stem), ("block1", block(16, 16, 1))])


def calib(in_channels: int, image_size: int, classes: int) -> Sequential:
    we = Sequential([("block2", block(16, 32, 2)), ("block3", block(32, 64, 2))])
    return Sequential([("we", we), ("wg", Sequential([("pool", GlobalAvgPool()), ("flatten", Flatten())]))])


THIN = ThinModel("tiny_mobilenet:factory", wc, calib)
