"""CIFAR ResNet-18 split into W_c / W_e / W_g (METHODS.md, H-SFP).

Built from torchvision's resnet18 so the blocks are the well-tested reference ones; the
ImageNet stem (7x7 stride-2 conv + max-pool) is replaced by a 3x3 stride-1 conv and no pool,
the usual CIFAR variant, which keeps 32x32 inputs at 32x32 through layer1.

Per-sample shapes with the default split ("layer1", "layer3"):
  32x32x3: W_c -> (64, 32, 32) = 65,536 floats, W_e -> (256, 8, 8)
  8x8x1:   W_c -> (64, 8, 8)   = 4,096 floats,  W_e -> (256, 2, 2)
"""
from __future__ import annotations

from collections import OrderedDict

from torch import nn

from splitedge.models.registry import register_model
from splitedge.models.split import SplitModel

# Children of the CIFAR ResNet in forward order; a split names the last layer of a part.
LAYERS = ("conv1", "bn1", "relu", "layer1", "layer2", "layer3", "layer4",
          "avgpool", "flatten", "fc")


def _cifar_layers(num_classes: int, in_channels: int) -> "OrderedDict[str, nn.Module]":
    """torchvision resnet18 children with a CIFAR stem, no max-pool and an explicit flatten."""
    from torchvision.models import resnet18  # heavy optional backend: import where used

    net = resnet18(weights=None, num_classes=num_classes)
    net.conv1 = nn.Conv2d(in_channels, 64, kernel_size=3, stride=1, padding=1, bias=False)
    layers = OrderedDict((name, getattr(net, name)) for name in LAYERS if name != "flatten")
    layers["flatten"] = nn.Flatten(1)
    return OrderedDict((name, layers[name]) for name in LAYERS)


def _split_indices(split: tuple[str, str]) -> tuple[int, int]:
    """Positions after which W_c and W_e end; W_g must keep at least the classifier."""
    if len(split) != 2 or any(s not in LAYERS for s in split):
        raise ValueError(f"split must name two of {LAYERS}, got {split!r}")
    end_c, end_e = LAYERS.index(split[0]) + 1, LAYERS.index(split[1]) + 1
    if not 0 < end_c < end_e < len(LAYERS):
        raise ValueError(f"split {split!r} must be in forward order and leave fc in W_g")
    return end_c, end_e


@register_model("resnet18")
def resnet18_split(*, num_classes: int, in_channels: int, image_size: int,
                   split: tuple[str, str] = ("layer1", "layer3")) -> SplitModel:
    """CIFAR ResNet-18; `split` names the last layer of W_c and of W_e."""
    end_c, end_e = _split_indices(tuple(split))
    items = list(_cifar_layers(num_classes, in_channels).items())
    wc = nn.Sequential(OrderedDict(items[:end_c]))
    we = nn.Sequential(OrderedDict(items[end_c:end_e]))
    wg = nn.Sequential(OrderedDict(items[end_e:]))
    return SplitModel(wc, we, wg, (in_channels, image_size, image_size), num_classes)
