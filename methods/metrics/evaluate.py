"""A served model measured on a labelled split: top-1 accuracy, the owner's own metrics
(methods/metrics/extra.py), and how many directions its penultimate features use (effective
rank and spectrum, methods/metrics/representation.py)."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch
from torch import nn

from splitedge.methods import budget
from splitedge.methods.config import ModelSpec
from splitedge.methods.data.preprocess import batches, to_input
from splitedge.methods.errors import RoundFailed
from splitedge.methods.metrics.extra import measured
from splitedge.methods.metrics.representation import rank_of_spectrum, spectrum
from splitedge.models import SplitModel, device_of

log = logging.getLogger(__name__)


@torch.no_grad()
def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch: int = 512) -> float:
    """Top-1 accuracy of `model` on prepared tensors (eval mode; the mode is restored)."""
    was_training = model.training
    model.eval()
    correct, device = 0, device_of(model)
    for sl in batches(len(y), batch):
        correct += int((model(x[sl].to(device)).argmax(1).cpu() == y[sl]).sum())
    model.train(was_training)
    return correct / max(1, len(y))


def evaluate(model: SplitModel, test: tuple[np.ndarray, np.ndarray], spec: ModelSpec, batch: int = 512, *,
             represent: bool = True) -> dict[str, float]:
    """A global model on a uint8 test split: top-1 accuracy, the share of dead head inputs, and
    with `represent` the effective rank and the normalised singular-value spectrum of its
    penultimate features (how many directions its representation uses;
    methods/metrics/representation.py). Those need every sample's features kept and an SVD, so
    clouds ask for them every `report_every` rounds (`CloudPart.report_due`), not every round.
    Normalised a batch at a time, so a float copy of the whole split is never held. Under the
    cloud's round guard (methods/budget.py `evaluations`), an evaluation over its memory ceiling
    or time budget is skipped in one logged line: nothing measured this round, the merge goes on."""
    guard = budget.evaluation_guard()
    if guard is None:
        return _evaluate(model, test, spec, batch, represent)
    try:
        with guard:
            return _evaluate(model, test, spec, batch, represent)
    except RoundFailed as exc:
        log.error("evaluation skipped: %s", exc)
        return {}


@torch.no_grad()
def _evaluate(model: SplitModel, test: tuple[np.ndarray, np.ndarray], spec: ModelSpec, batch: int,
              represent: bool) -> dict[str, float]:
    x, y = test
    was_training, device = model.training, device_of(model)  # the test split stays on the CPU; each batch moves
    model.eval()
    preds, feats = [], []
    peak: np.ndarray | None = None  # each head input's largest value so far (dead_units)
    try:
        for sl in batches(len(y), batch):
            budget.checkpoint()  # the round's time budget and memory ceiling (runtime/guard.py)
            features, logits = model.features_and_logits(
                torch.from_numpy(to_input(x[sl], spec.mean, spec.std)).to(device))
            preds.append(logits.argmax(1).cpu().numpy())
            flat = features.cpu().numpy().reshape(len(features), -1)
            peak = flat.max(axis=0) if peak is None else np.maximum(peak, flat.max(axis=0))
            if represent:
                feats.append(flat)
    finally:
        model.train(was_training)
    predicted = np.concatenate(preds) if preds else np.zeros(0, np.int64)
    out = {"accuracy": int((predicted == y).sum()) / max(1, len(y)), **measured(y, predicted)}
    if len(y) >= 2:
        if represent:
            out.update(representation_measures(np.concatenate(feats)))
        out["dead_units"] = dead_units(peak)
    return out


def dead_units(peak: np.ndarray | None) -> float:
    """The share of the head's input units that are 0 (or below) on every sample: ReLUs a
    training step killed for these inputs (issue 54: the cloud's training on synthetic
    features can kill most of the trunk's units in one round). From each flattened unit's
    largest value over the samples, kept a batch at a time."""
    return float(np.mean(peak <= 0)) if peak is not None and peak.size else 0.0


def representation_measures(features: np.ndarray) -> dict[str, Any]:
    """Effective rank and spectrum of the features, or nothing (logged) when they cannot be had:
    non-finite features, or an SVD that does not converge, must not stop the cloud's round."""
    if not np.isfinite(features).all():
        log.warning("evaluate: the model's features are not finite; no effective rank this round")
        return {}
    try:
        p = spectrum(features)  # one SVD for both
        return {"effective_rank": rank_of_spectrum(p), "spectrum": [float(v) for v in p]}
    except np.linalg.LinAlgError as exc:
        log.warning("evaluate: no effective rank this round (%s)", exc)
        return {}
