"""Head calibration for any labelled method: the classifier refitted in closed form on statistics
every device can send (the CCVR / Fed3R / FedCOF family).

After a calibrating round has been trained and merged, the cloud opens that round's calibration
phase (`RoundPlan.phase == "calibrate"`): each device runs the served model it now holds up to
the classifier's input and sends counts, class means and the pooled within-class covariance of
its local images (`stats.py`); edges and the cloud merge them exactly or by the run's robust
rule (`robust.py`); the cloud fits the LDA classifier (`lda.py`) and reports the calibrated
model's accuracy beside the model's own. Which rounds calibrate is the method's config:
`calibrate = "lda"`, every `calibrate_every` rounds and always after the last (0: only then).

Where devices hold their own models (FedProto) or their cluster's (CFLHKD), the statistics are
of their training share; the cloud sends each the head fitted for it and opens an evaluation
phase (`phase == "evaluate"`) in which each scores that head on its held-out share with its own
model, and the edges and the cloud merge those scores.

Torch-free: thin devices and numpy-only edges import this package.
"""

from __future__ import annotations

from typing import Any

HEAD_STATS = "head_stats"
"""The `arrays` record of head statistics at the classifier's input (device -> edge, edge ->
cloud); at another layer (methods/calibration/layers.py) it is named "head_stats_<layer>"."""
CALIBRATE = "calibrate"
"""The round plan's phase in which devices send head statistics (and its directive: what the
records must fit, `{"layers": {layer: D}}`, set by the cloud, which knows the model)."""
EVALUATE = "evaluate"
"""The phase after a calibration where devices score heads on images they held back: the head
fitted for their own model (FedProto, CFLHKD), or every candidate layer's (`calib_layer` naming
several)."""
HEADS = "heads"
"""The `arrays` record of the candidate heads (`<layer>_weight`, `<layer>_bias`) sent to devices
before the evaluation phase that chooses the head's layer, versioned by the round."""
HEAD = "head"
"""The `arrays` record of a fitted head (`weight` [classes, D], `bias` [classes]) sent to devices
before an evaluation phase, versioned by the round."""
CALIB = "calib"
"""The `weights` part the cloud sends devices before a calibration phase: W_e and W_g's trunk
(methods/calibration/upper.py), so a device reaches the classifier's input."""
CALIBRATIONS = ("none", "lda")


def calibrates(cfg: Any, round_: int, rounds: int) -> bool:
    """Whether round `round_` of `rounds` is followed by a calibration phase: every
    `calibrate_every` rounds and after the last one (calibrate_every 0: only after the last)."""
    if getattr(cfg, "calibrate", "none") == "none":
        return False
    every = cfg.calibrate_every
    return round_ == rounds or (every > 0 and round_ % every == 0)


def head_input_clip(cfg: Any) -> float:
    """The L2 norm a calibrated head's input is clipped to: with DP on, the head is fitted on
    statistics of classifier inputs clipped to `dp_head_clip` (methods/privacy/dp.py), so it is
    scored and served on inputs clipped the same way; 0: no clip. (Scored on raw inputs, the
    head of exact clipped statistics lost 10 points on digits after one round, and far more
    once training had grown the inputs' norms past the clip.)"""
    return float(cfg.dp_head_clip) if cfg.dp_sigma > 0 and cfg.dp_head_clip > 0 else 0.0


def stats_name(layer: str) -> str:
    """The record name of head statistics at `layer`."""
    return HEAD_STATS if layer == "classifier" else f"{HEAD_STATS}_{layer}"


def stats_layer(name: str) -> str | None:
    """The layer a record name holds head statistics of (None: not head statistics)."""
    if name == HEAD_STATS:
        return "classifier"
    return name[len(HEAD_STATS) + 1:] if name.startswith(HEAD_STATS + "_") else None


def is_head_stats(env: Any) -> bool:
    return env.kind == "arrays" and stats_layer(str(env.body.get("name", ""))) is not None
