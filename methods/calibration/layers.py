"""Where a calibrated head may sit: the layers of a split model its statistics can be taken at.

The classifier's input is not always the best place for a closed-form head: on `fedcnn` a
random network's LDA head scores about 12 points more on W_e's flattened output, or on W_c's
output pooled to 8x8, than on fc1's 256 ReLUs (issue 54). `calib_layer` names one or more of:
  classifier   the served model's classifier input (the default, and the only layer where the
               head replaces the model's own classifier),
  we, we_S     W_e's output, flattened, or average-pooled to S x S first,
  wc, wc_S     W_c's output, likewise.
With one layer the head is fitted there on every device's images. With several, every device
holds back `calib_holdout` of its images (by class, the same rows every calibration): the
heads are fitted on the rest, each device scores every candidate on the rows it held back,
and the cloud serves the layer that scored best. The test split never chooses.

numpy only: devices compute the features (torch or thin), edges check the records' layers.
"""

from __future__ import annotations

import re
import zlib
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

CLASSIFIER = "classifier"
STAGES = ("wc", "we", CLASSIFIER)
_LAYER = re.compile(r"(wc|we)(?:_([1-9][0-9]{0,2}))?|classifier")


@dataclass(frozen=True)
class HeadLayer:
    """A place for the head: a split stage and, for W_c and W_e, the side its map is pooled to
    (None: flattened as it is)."""

    stage: str
    side: int | None = None

    @property
    def name(self) -> str:
        return self.stage if self.side is None else f"{self.stage}_{self.side}"

    def dim(self, shape: Sequence[int]) -> int:
        """Features per image at this layer, for the stage's per-sample output `shape`."""
        if self.side is None or len(shape) != 3:
            return int(np.prod(shape))
        return int(shape[0]) * self.side * self.side

    def fits(self, shape: Sequence[int]) -> str | None:
        """Why this layer cannot be taken on a stage output of `shape` (None: it can)."""
        if self.side is None:
            return None
        if len(shape) != 3:
            return f"{self.name}: the {self.stage} output is {tuple(shape)}, not a [C, H, W] map to pool"
        if shape[1] % self.side or shape[2] % self.side:
            return (f"{self.name}: the {self.stage} map is {shape[1]}x{shape[2]}, which {self.side}x{self.side} "
                    f"pooling does not divide")
        return None


def parse_layers(text: str) -> tuple[HeadLayer, ...]:
    """The layers `calib_layer` names, in order (ValueError naming the one that does not read)."""
    names = [t.strip() for t in str(text).split(",") if t.strip()]
    if not names:
        raise ValueError("calib_layer names no layer; use classifier, we, we_S, wc or wc_S (comma-separated)")
    layers = []
    for name in names:
        m = _LAYER.fullmatch(name)
        if m is None:
            raise ValueError(f"calib_layer {name!r} is not a layer: use classifier, we, we_S, wc or wc_S "
                             f"(S: the side a map is average-pooled to, e.g. wc_8)")
        layers.append(HeadLayer(CLASSIFIER) if name == CLASSIFIER else
                      HeadLayer(m.group(1), int(m.group(2)) if m.group(2) else None))
    if len({layer.name for layer in layers}) != len(layers):
        raise ValueError(f"calib_layer names a layer twice: {text!r}")
    return tuple(layers)


def layer_names(cfg: object) -> tuple[str, ...]:
    """The names of the layers a run's config calibrates at."""
    return tuple(layer.name for layer in parse_layers(getattr(cfg, "calib_layer", CLASSIFIER)))


def selects(cfg: object) -> bool:
    """Whether the run chooses among several layers (devices hold back rows to score them)."""
    return len(layer_names(cfg)) > 1


def pooled(x: np.ndarray, side: int | None) -> np.ndarray:
    """[N, C, H, W] -> [N, C * side * side], each side x side cell the mean of its block (as
    torch's AdaptiveAvgPool2d when `side` divides H and W), or [N, ...] flattened (side None)."""
    x = np.asarray(x)
    if side is None or x.ndim != 4:
        return x.reshape(len(x), -1)
    n, c, h, w = x.shape
    return x.reshape(n, c, side, h // side, side, w // side).mean(axis=(3, 5), dtype=np.float64) \
        .astype(x.dtype, copy=False).reshape(n, -1)


def layer_features(outputs: Mapping[str, np.ndarray], layer: HeadLayer) -> np.ndarray:
    """The features [N, D] at `layer` from a forward pass's stage outputs ("wc", "we", "classifier")."""
    if layer.stage not in outputs:
        raise ValueError(f"this device computes no {layer.stage} output for calib_layer {layer.name}")
    return pooled(outputs[layer.stage], layer.side)


def held_out(labels: np.ndarray, fraction: float, key: str) -> np.ndarray:
    """bool [N]: the rows a device holds back to score candidate heads: `fraction` of each class
    (rounded; a class of one image keeps it for fitting), drawn from `key` alone (the device's
    id), so every calibration holds back the same rows and a restart does not change them."""
    labels = np.asarray(labels)
    rng = np.random.default_rng(zlib.crc32(key.encode()))
    mask = np.zeros(len(labels), dtype=bool)
    for c in np.unique(labels):
        rows = np.flatnonzero(labels == c)
        take = int(round(fraction * len(rows))) if len(rows) > 1 else 0
        mask[rng.permutation(rows)[:take]] = True
    return mask
