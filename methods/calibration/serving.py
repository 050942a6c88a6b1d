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
from splitedge.methods.calibration.layers import CLASSIFIER, HeadLayer, parse_layers
from splitedge.methods.calibration.lda import lda_classifier
from splitedge.methods.calibration.records import merge
from splitedge.methods.calibration.stats import HeadStats
from splitedge.methods.config import ModelSpec
from splitedge.methods.data.preprocess import batches, to_input
from splitedge.models import SplitModel, device_of, state_to_numpy
from splitedge.models.split import head_at_layer

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
    """A split model's classifier input, in eval mode (the mode it was in is restored), for CPU
    images and on the CPU, wherever the model computes."""
    device = device_of(model)

    def features(x: torch.Tensor) -> torch.Tensor:
        was = model.training
        model.eval()
        try:
            return model.features_and_logits(x.to(device))[0].cpu()
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


def stage_features(model: SplitModel, layer: HeadLayer) -> Callable[[torch.Tensor], torch.Tensor]:
    """A split model's features at `layer` (W_c's or W_e's output pooled as the devices pool
    it, or the classifier's input), in eval mode (the mode it was in is restored): the input of
    the head in the network that would be served with it (`with_head_at`)."""
    return penultimate(model if layer.stage == CLASSIFIER else head_at_layer(model, layer.stage, layer.side))


def with_head_at(model: SplitModel, layer: HeadLayer, head: Head) -> dict[str, np.ndarray]:
    """The served weight map of `head` at `layer`: the classifier replaced (at the classifier's
    input), or the network up to W_c or W_e with the head on its pooled output
    (models.split.head_at_layer)."""
    if layer.stage == CLASSIFIER:
        return with_head(model, head)
    served = head_at_layer(model, layer.stage, layer.side)
    weights = state_to_numpy(served)
    dtype = weights["wg.head.weight"].dtype
    weights["wg.head.weight"] = np.ascontiguousarray(head[0], dtype=dtype)
    weights["wg.head.bias"] = np.ascontiguousarray(head[1], dtype=dtype)
    return weights


class CalibratedCloud:
    """What a cloud part serving a split model needs to calibrate (mix in before CloudPart, and
    declare `calibrated` and `calibrated_layer` Kept in the part): the model the devices'
    statistics describe (`calibration_model`, by default `self.model`), its head fitted, scored
    and served, at the layer the run names or the one of several that scored best on the images
    devices held back (methods/calibration/layers.py). A part whose head is not in its model (a self-supervised
    encoder: the federated probe) overrides `head_features`, `calibration_dim` and `served_with`,
    and calibrates at the classifier's input only."""

    calibrated: dict[str, np.ndarray] | None = None
    """The served weight map with the refitted head, from the last calibration (None before)."""
    calibrated_layer: str = CLASSIFIER
    """The layer the served head sits at (`served_metadata` tells export)."""
    candidates_round: int = 0
    candidates: dict[str, Any] | None = None
    """Between a calibration and the evaluation phase that chooses among layers: each candidate
    layer's head, test accuracy and counts."""

    def calibration_model(self) -> SplitModel:
        return self.model  # type: ignore[attr-defined]

    def head_features(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """What the calibrated head classifies: the model's classifier input."""
        return penultimate(self.calibration_model())

    def calibration_dim(self) -> int | None:
        return classifier_dim(self.calibration_model())

    def calibration_layers(self) -> dict[str, int] | None:
        layers = parse_layers(self.cfg.calib_layer)  # type: ignore[attr-defined]
        if [layer.name for layer in layers] == [CLASSIFIER]:
            dim = self.calibration_dim()
            return None if dim is None else {CLASSIFIER: int(dim)}
        model = self.calibration_model()
        shapes = {"wc": model.wc_shape, "we": model.we_shape}
        return {layer.name: classifier_dim(model) if layer.stage == CLASSIFIER else layer.dim(shapes[layer.stage])
                for layer in layers}

    def served_with(self, head: Head, layer: HeadLayer = HeadLayer(CLASSIFIER)) -> dict[str, np.ndarray] | None:
        """The served weight map carrying `head` at `layer` (None: the head is not part of the model)."""
        return with_head_at(self.calibration_model(), layer, head)

    def _features(self, layer: HeadLayer) -> Callable[[torch.Tensor], torch.Tensor]:
        feats = self.head_features() if layer.stage == CLASSIFIER else stage_features(self.calibration_model(), layer)
        return clipped(feats, head_input_clip(self.cfg))  # type: ignore[attr-defined]

    def calibrate(self, plan: Any, sources: Mapping[str, Mapping[str, HeadStats]]) -> dict[str, Any]:
        """The closed-form head of the merged statistics at each layer, scored on the test split
        (reported, never chosen by). With one layer it is served when it holds every class; a
        head that lacks classes (devices withheld them below the minimum count per class, or
        nobody holds them) can never predict those: the model keeps its own head (the
        coordinator says why, once). With several, the choice waits for the devices' scores
        (`head_messages`, `heads_scored`)."""
        num_classes = self.spec.num_classes  # type: ignore[attr-defined]
        fitted: dict[str, Any] = {}
        for layer in parse_layers(self.cfg.calib_layer):  # type: ignore[attr-defined]
            if layer.name not in sources:
                continue
            head, total, classes = fit_head(sources[layer.name], self.cfg, num_classes)  # type: ignore[attr-defined]
            accuracy = head_accuracy(self._features(layer), self.ctx.test, self.spec, head)  # type: ignore[attr-defined]
            fitted[layer.name] = {"layer": layer, "head": head, "total": total, "classes": classes, "accuracy": accuracy}
        if len(parse_layers(self.cfg.calib_layer)) > 1:  # type: ignore[attr-defined]
            self.candidates, self.candidates_round = fitted, int(plan.round)
            return {"calibrated": max((f["total"] for f in fitted.values()), default=0),
                    "calibrated_classes": max((f["classes"] for f in fitted.values()), default=0),
                    "accuracy_calibrated_layers": {name: f["accuracy"] for name, f in fitted.items()}}
        if not fitted:
            return {}
        return self._serve(next(iter(fitted.values())))

    def _serve(self, chosen: Mapping[str, Any]) -> dict[str, Any]:
        num_classes = self.spec.num_classes  # type: ignore[attr-defined]
        layer = chosen["layer"]
        self.calibrated = self.served_with(chosen["head"], layer) if chosen["classes"] == num_classes else None
        self.calibrated_layer = layer.name
        return {"accuracy_calibrated": chosen["accuracy"], "calibrated": chosen["total"],
                "calibrated_classes": chosen["classes"], "calib_layer": layer.name}

    def head_messages(self) -> list[Any]:
        """The candidate heads, for the devices to score on the images they held back."""
        if not self.candidates:
            return []
        from splitedge.methods.calibration.records import heads_message

        return [heads_message({name: f["head"] for name, f in self.candidates.items()}, self.candidates_round)]

    def heads_scored(self, scores: Mapping[str, Any]) -> dict[str, Any]:
        """Serves the candidate with the most of the held-back images right (ties: the first
        layer named); none scored: the first layer named that was fitted."""
        fitted, self.candidates = self.candidates or {}, None
        if not fitted:
            return {}
        rates = {name: c / n for name, (c, n) in ((k, scores[k]) for k in fitted if k in scores) if n > 0}
        best = max(rates, key=lambda k: (rates[k], -list(fitted).index(k))) if rates else next(iter(fitted))
        return {**self._serve(fitted[best]), "calib_layer_scores": rates,
                "calib_heldout": int(max((scores[k][1] for k in rates), default=0)),
                "accuracy_calibrated_layers": {name: f["accuracy"] for name, f in fitted.items()}}

    def served_metadata(self) -> dict[str, str]:
        """What a checkpoint of the served model says beside its weights: the clip its head's
        input needs (`head_input_clip`, which `splitedge export` builds in), when its head was
        fitted on private statistics, and the layer it sits at when not the classifier's input."""
        if self.calibrated is None:
            return {}
        clip = head_input_clip(self.cfg)  # type: ignore[attr-defined]
        meta = {"head_input_clip": repr(clip)} if clip > 0 else {}
        return {**meta, "head_layer": self.calibrated_layer} if self.calibrated_layer != CLASSIFIER else meta

    def served_state(self, own: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """What a checkpoint holds: the last calibrated model when there is one, else `own`."""
        return self.calibrated if self.calibrated is not None else own
