"""plain_net's W_c, W_e and W_g trunk in a thin device's numpy layers, with the torch split's
state names: what a device without torch builds for `plain_net:factory` (docs/plugins.md)."""

from __future__ import annotations

from splitedge.methods.thin.layers import BatchNorm2d, Conv2d, MaxPool2d, ReLU, Sequential
from splitedge.methods.thin.graphs import Flatten, GlobalAvgPool
from splitedge.methods.thin.plugins import ThinModel


def conv_bn_relu(c_in: int, c_out: int, stride: int = 1) -> list:
    return [("0", Conv2d(c_in, c_out, 3, stride, 1)), ("1", BatchNorm2d(c_out)), ("2", ReLU())]


def wc(in_channels: int) -> Sequential:
    return Sequential([("stem", Sequential(conv_bn_relu(in_channels, 16))),
                       ("block1", Sequential(conv_bn_relu(16, 16) + [("3", MaxPool2d())]))])


def calib(in_channels: int, image_size: int, classes: int) -> Sequential:
    we = Sequential([("block2", Sequential(conv_bn_relu(16, 32, stride=2)))])
    return Sequential([("we", we), ("wg", Sequential([("pool", GlobalAvgPool()), ("flatten", Flatten())]))])


THIN = ThinModel("plain_net:factory", wc, calib)
