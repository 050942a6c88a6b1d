"""The W_c networks the thin trainer can train, built from numpy layers with torch's state names.

Each mirrors a torch split's W_c (models/cnn.py, models/fedcnn.py: fedcnn and fedcnn2) layer for layer; the channel
widths come from the model spec's defaults and every incoming weight map is checked against them.
The CIFAR ResNet-18 split's W_c (a 64-channel stem and two residual blocks at 32x32) is not here:
its activations alone take ~330 MB for one SupCon batch of 64 images in two views, three times
a thin device's budget (docs/thin-trainer.md says what it would take).
"""

from __future__ import annotations

import numpy as np

from splitedge.methods.thin.layers import BatchNorm2d, Conv2d, Linear, MaxPool2d, ReLU, Sequential
from splitedge.methods.thin.plugins import thin_plugin, thin_plugins

WIDTH = 32
"""The default width of the cnn and fedcnn splits (models/cnn.py, models/fedcnn.py)."""


def _conv_block(c_in: int, c_out: int, stride: int = 1) -> Sequential:
    return Sequential([("conv", Conv2d(c_in, c_out, 3, stride, 1)), ("bn", BatchNorm2d(c_out)), ("relu", ReLU())])


def _cnn(channels: int, width: int) -> Sequential:
    return Sequential([("block1", _conv_block(channels, width)), ("block2", _conv_block(width, width, stride=2))])


def _stage(c_in: int, c_out: int) -> Sequential:
    return Sequential([("block", _conv_block(c_in, c_out)), ("pool", MaxPool2d())])


def _fedcnn(channels: int, width: int) -> Sequential:
    return Sequential([("stage1", _stage(channels, width))])


def _fedcnn2(channels: int, width: int) -> Sequential:
    """fedcnn split after its second stage (models/fedcnn.py's fedcnn2)."""
    return Sequential([("stage1", _stage(channels, width)), ("stage2", _stage(width, 2 * width))])


BUILDERS = {"cnn": _cnn, "fedcnn": _fedcnn, "fedcnn2": _fedcnn2}
"""Model name -> W_c builder (in channels, width)."""


def thin_wc(model: str, channels: int, width: int = WIDTH) -> Sequential:
    """The numpy W_c of `model`: a shipped network's, or that of a thin model of one's own
    (methods/thin/plugins.py); ValueError for a model this install cannot build."""
    if model in BUILDERS:
        return BUILDERS[model](int(channels), int(width))
    plugged = thin_plugin(model)
    if plugged is None:
        raise ValueError(f"the thin trainer trains the W_c of {sorted(BUILDERS) + thin_plugins()}, not {model!r} "
                         f"(a device with torch can: --backend torch; a model of one's own needs its ThinModel, "
                         f"docs/plugins.md)")
    return plugged.wc(int(channels))


def out_channels(wc: Sequential) -> int:
    """Channels of W_c's output (its last convolution's): the width SupCon's head takes."""
    convs = [layer for _, layer in wc.named() if isinstance(layer, Conv2d)]
    return int(convs[-1].params["weight"].shape[0])


def projection_head(width: int, proj_dim: int, rng: np.random.Generator) -> Sequential:
    """The device-only Linear-ReLU-Linear head SupCon trains through, initialised as torch's
    nn.Linear (uniform within 1/sqrt(fan_in))."""
    head = Sequential([("0", Linear(width, width)), ("1", ReLU()), ("2", Linear(width, proj_dim))])
    for _, layer in head.named():
        for key, value in layer.params.items():
            bound = 1.0 / np.sqrt(layer.params["weight"].shape[1])
            layer.params[key] = rng.uniform(-bound, bound, value.shape).astype(np.float32)
    return head
