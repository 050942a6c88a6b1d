"""Evaluation metrics of one's own beside accuracy (issue 55): `--metric package.module:function`
on the cloud or a sim names a function `f(y_true, y_pred) -> float` of the test split's labels
and the served model's top-1 predictions (sklearn.metrics' balanced_accuracy_score is one);
every evaluated round's record then holds `metric_<function>`. Named by the owner's command
line only (protocol/plugins.py), so nothing off the wire picks what runs. A metric that fails
or gives no finite number is left out of that round's record, with one warning.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Callable

import numpy as np

from splitedge.protocol import plugins

log = logging.getLogger(__name__)

_METRICS: dict[str, Callable[[np.ndarray, np.ndarray], Any]] = {}


def use_metric(path: str) -> str:
    """Register the metric at import path `path`; its record key (`metric_<function>`).
    ValueError in one line when it does not load, is not callable or its key is taken."""
    fn = plugins.load(path, "--metric")
    if not callable(fn):
        raise ValueError(f"--metric {path}: not a function f(y_true, y_pred)")
    key = "metric_" + path.rpartition(":")[2].rsplit(".", 1)[-1]
    if _METRICS.get(key, fn) is not fn:
        raise ValueError(f"--metric {path}: another metric already reports as {key}")
    _METRICS[key] = fn
    return key


def measured(y_true: np.ndarray, y_pred: np.ndarray) -> dict[str, float]:
    """Each registered metric of the labels and predictions; one that fails is skipped, logged."""
    out: dict[str, float] = {}
    for key, fn in _METRICS.items():
        try:
            value = float(fn(y_true, y_pred))
        except Exception as exc:  # a user's function: its failure costs its own figure, not the round
            log.warning("%s failed on this round's evaluation (%s: %s); left out", key, type(exc).__name__, exc)
            continue
        if math.isfinite(value):
            out[key] = value
        else:
            log.warning("%s gave %s; left out", key, value)
    return out
