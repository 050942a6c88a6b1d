"""A small MobileNetV2 (torchvision's, a quarter of its width, no pretrained weights) cut into
splitedge's three parts by module names.

A model plug-in is a factory taking `num_classes`, `in_channels` and `image_size` and returning
a SplitModel; `split_module` cuts any nn.Module by the dotted names of its submodules: here the
stem and the first inverted-residual block on the device (W_c), the other blocks on the edge
(W_e), and the pooled classifier in the cloud (W_g: pooling, dropout and the linear layer,
named on its own because head calibration refits it).
"""

from __future__ import annotations

from torch import nn

from splitedge.models import SplitModel, split_module


def mobilenet_tiny(*, num_classes: int, in_channels: int, image_size: int) -> SplitModel:
    from torchvision.models import mobilenet_v2

    net = mobilenet_v2(num_classes=num_classes, width_mult=0.25)
    stem = net.features[0][0]
    net.features[0][0] = nn.Conv2d(in_channels, stem.out_channels, 3, 2 if image_size > 16 else 1, 1, bias=False)
    blocks = [f"features.{i}" for i in range(len(net.features))]
    return split_module(net, wc=blocks[:2], we=blocks[2:], wg=[nn.AdaptiveAvgPool2d(1), nn.Flatten(1), "classifier.0", "classifier.1"],
                        in_shape=(in_channels, image_size, image_size), num_classes=num_classes)
