"""The cloud's side of calibration (torch): the merged statistics' closed-form head, scored on the
test split, and the served weight map carrying it.

A cloud part that calibrates implements `calibration_dim` and `calibrate` (methods/contract.py)
with these: `fit_head` merges the edges' records by the run's rule and solves for the head,
`head_accuracy` scores it on any feature map (a split model's classifier input, or a
self-supervised encoder's output, where it is the federated linear probe), `with_head` puts it
into a split model's weights for serving and export.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import numpy as np
import torch

from splitedge.methods.calibration import head_input_clip
from splitedge.methods.calibration.lda import lda_classifier
from splitedge.methods.calibration.records import merge
from splitedge.methods.calibration.stats import HeadStats
from splitedge.methods.config import ModelSpec
from splitedge.methods.data.preprocess import batches, to_input
from splitedge.models import SplitModel, state_to_numpy

Head = tuple[np.ndarray, np.ndarray]
"""(weight [classes, D], bias [classes]) of a linear classifier."""


def clipped(features: Callable[[torch.Tensor], torch.Tensor], clip: float) -> Callable[[torch.Tensor], torch.Tensor]:
    """`features` with each row clipped to L2 norm `clip` (0: `features` as they are)."""
    if not clip > 0:
        return features
    from splitedge.models.split import NormClip

    norm = NormClip(clip)
    return lambda x: norm(features(x).reshape(len(x), -1))


def fit_head(sources: Mapping[str, HeadStats], cfg: Any, num_classes: int) -> tuple[Head, int, int]:
    """The head fitted on the edges' records merged by the run's rule; the samples they count and
    the classes they hold (a class no record holds gets a head row that never wins)."""
    stats = merge(sources, cfg)
    return lda_classifier(stats, num_classes, shrink=cfg.calib_shrink), stats.total, len(stats.classes)


@torch.no_grad()
def head_accuracy(features: Callable[[torch.Tensor], torch.Tensor], test: tuple[np.ndarray, np.ndarray],
                  spec: ModelSpec, head: Head, batch: int = 512) -> float:
    """Top-1 accuracy of `head` on `features` of the uint8 test images (normalised a batch at a time)."""
    x, y = test
    weight, bias = (torch.from_numpy(np.asarray(a, dtype=np.float64)) for a in head)
    correct = 0
    for sl in batches(len(y), batch):
        f = features(torch.from_numpy(to_input(x[sl], spec.mean, spec.std))).reshape(len(y[sl]), -1)
        correct += int(((f.double() @ weight.T + bias).argmax(1).numpy() == y[sl]).sum())
    return correct / max(1, len(y))


def classifier_dim(model: SplitModel) -> int:
    """The classifier input's dimension of a split model (its last layer is the classifier)."""
    return int(model.wg[-1].in_features)


def penultimate(model: SplitModel) -> Callable[[torch.Tensor], torch.Tensor]:
    """A split model's classifier input, in eval mode (the mode it was in is restored)."""
    def features(x: torch.Tensor) -> torch.Tensor:
        was = model.training
        model.eval()
        try:
            return model.features_and_logits(x)[0]
        finally:
            model.train(was)

    return features


def with_head(model: SplitModel, head: Head) -> dict[str, np.ndarray]:
    """The model's weight map with its classifier replaced by `head` (in the classifier's dtype)."""
    weights = state_to_numpy(model)
    prefix = f"wg.{list(model.wg.named_children())[-1][0]}."
    dtype = weights[prefix + "weight"].dtype
    weights[prefix + "weight"] = np.ascontiguousarray(head[0], dtype=dtype)
    weights[prefix + "bias"] = np.ascontiguousarray(head[1], dtype=dtype)
    return weights


class CalibratedCloud:
    """What a cloud part serving a split model needs to calibrate (mix in before CloudPart, and
    declare "calibrated" in the part's `state`): the model the devices' statistics describe
    (`calibration_model`, by default `self.model`), its head fitted, scored and served.
    A part whose head is not in its model (a self-supervised encoder: the federated probe)
    overrides `head_features`, `calibration_dim` and `served_with`."""

    calibrated: dict[str, np.ndarray] | None = None
    """The served weight map with the refitted head, from the last calibration (None before)."""

    def calibration_model(self) -> SplitModel:
        return self.model  # type: ignore[attr-defined]

    def head_features(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """What the calibrated head classifies: the model's classifier input."""
        return penultimate(self.calibration_model())

    def calibration_dim(self) -> int | None:
        return classifier_dim(self.calibration_model())

    def served_with(self, head: Head) -> dict[str, np.ndarray] | None:
        """The served weight map carrying `head` (None: the head is not part of the model)."""
        return with_head(self.calibration_model(), head)

    def calibrate(self, plan: Any, sources: Mapping[str, HeadStats]) -> dict[str, Any]:
        """The closed-form head of the merged statistics, scored on the test split, and served
        when it holds every class. A head that lacks classes (devices withheld them below the
        minimum count per class, or nobody holds them) can never predict those: the model keeps
        its own head (the coordinator says why, once)."""
        num_classes = self.spec.num_classes  # type: ignore[attr-defined]
        head, total, classes = fit_head(sources, self.cfg, num_classes)  # type: ignore[attr-defined]
        self.calibrated = self.served_with(head) if classes == num_classes else None
        features = clipped(self.head_features(), head_input_clip(self.cfg))  # type: ignore[attr-defined]
        accuracy = head_accuracy(features, self.ctx.test, self.spec, head)  # type: ignore[attr-defined]
        return {"accuracy_calibrated": accuracy, "calibrated": total, "calibrated_classes": classes}

    def served_metadata(self) -> dict[str, str]:
        """What a checkpoint of the served model says beside its weights: the clip its head's
        input needs (`head_input_clip`, which `splitedge export` builds in), when its head was
        fitted on private statistics."""
        clip = head_input_clip(self.cfg)  # type: ignore[attr-defined]
        return {"head_input_clip": repr(clip)} if self.calibrated is not None and clip > 0 else {}

    def served_state(self, own: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """What a checkpoint holds: the last calibrated model when there is one, else `own`."""
        return self.calibrated if self.calibrated is not None else own
