"""A wider three-stage CNN split for Pi-class devices: the network worth federating (issue 12).

The "cnn" (66k parameters, four convolutions, global-average-pooled head) is the fast default;
FedAvg on it reaches 26.7 % on CIFAR-10 with 10 devices, Dirichlet(0.3), 5 rounds, while a
peer's 879k-parameter CNN reaches 42.3 %. This one is the classic federated CIFAR CNN shape
(McMahan et al. 2017; Flower's examples): three Conv-BN-ReLU-MaxPool stages (widths w, 2w, 4w)
and a two-layer classifier on the flattened last map. It is shallow on purpose: a six-conv
VGG (two convolutions per stage) stayed at chance after the first FedAvg round of this task
(client drift on a deep plain net at lr 0.05, momentum 0.9), and costs ~4x the compute.
  32x32x3 (w=32): W_c -> (32, 16, 16) = 8,192 floats (as the cnn's); W_e -> (128, 4, 4);
                  W_g: flatten 2,048 -> 256 -> classes.  620,586 parameters; W_c 928 of them.
  8x8x1:          W_c -> (w, 4, 4); W_e -> (4w, 1, 1).
W_c (stage 1) is the thin part, so a device's forward, its moments and its ONNX graph stay
small; the edge runs stages 2-3 and the cloud the classifier, which is flattened, not pooled,
so the head sees every position of W_e's map. "fedcnn2" is the same network split after stage 2.
"""

from __future__ import annotations

from collections import OrderedDict

from torch import nn

from splitedge.models.cnn import conv_block
from splitedge.models.registry import register_model
from splitedge.models.split import SplitModel


def stage(c_in: int, c_out: int) -> nn.Sequential:
    """3x3 Conv-BN-ReLU, then a 2x2 max-pool (halves the resolution)."""
    return nn.Sequential(OrderedDict([("block", conv_block(c_in, c_out)), ("pool", nn.MaxPool2d(2))]))


@register_model("fedcnn")
def fedcnn_split(*, num_classes: int, in_channels: int, image_size: int, width: int = 32,
                 hidden: int = 256, device_stages: int = 1) -> SplitModel:
    """Stage 1 on the device, stages 2-3 on the edge, a flatten-MLP classifier in the cloud
    (`device_stages=2`: stages 1-2 on the device, stage 3 on the edge)."""
    if width < 1 or hidden < 1:
        raise ValueError(f"width and hidden must be >= 1, got {width} and {hidden}")
    if image_size < 8 or image_size % 8:
        raise ValueError(f"fedcnn halves the resolution three times: image_size must be a multiple of 8, "
                         f"got {image_size}")
    if device_stages not in (1, 2):
        raise ValueError(f"fedcnn puts 1 or 2 of its 3 stages on the device, got {device_stages}")
    w = int(width)
    stages = [("stage1", stage(in_channels, w)), ("stage2", stage(w, 2 * w)), ("stage3", stage(2 * w, 4 * w))]
    wc = nn.Sequential(OrderedDict(stages[:device_stages]))
    we = nn.Sequential(OrderedDict(stages[device_stages:]))
    side = image_size // 8
    wg = nn.Sequential(OrderedDict([
        ("flatten", nn.Flatten(1)),
        ("fc1", nn.Linear(4 * w * side * side, hidden)),
        ("relu", nn.ReLU(inplace=True)),
        ("fc", nn.Linear(hidden, num_classes)),
    ]))
    return SplitModel(wc, we, wg, (in_channels, image_size, image_size), num_classes)


@register_model("fedcnn2")
def fedcnn2_split(*, num_classes: int, in_channels: int, image_size: int, width: int = 32,
                  hidden: int = 256) -> SplitModel:
    """fedcnn with two stages on the device (issue 54: one 3x3 convolution, 928 parameters, is too
    small a W_c to learn what H-SFP's device objective asks; the paper's W_c is a ResNet stem and
    first block): W_c 19,488 parameters, its output 64 x 8 x 8 = 4,096 floats at 32x32 (half of
    fedcnn's 8,192, so the moments a device sends halve too); W_e is stage 3."""
    return fedcnn_split(num_classes=num_classes, in_channels=in_channels, image_size=image_size, width=width,
                        hidden=hidden, device_stages=2)
