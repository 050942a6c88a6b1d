"""A device part's own entries of its `done` info in each phase of a round.

The calibration and evaluation phases themselves are mods (runtime/mods/phases.py); a training
phase's info is the part's `round_info`; in any phase, what its statistics held back below the
minimum count per class and how many differentially private releases it made.
"""

from __future__ import annotations

from typing import Any

from splitedge.methods.contract import RoundPlan


def device_info(part: Any, plan: RoundPlan) -> dict[str, Any]:
    """The part's `round_info` in a training phase (none in the others: it trains nothing), with
    `withheld` (classes and images held back below the minimum count per class) and `dp_releases`."""
    privacy = {"withheld": dict(part.withheld)} if part.withheld else {}
    if part.dp_releases:
        privacy["dp_releases"] = int(part.dp_releases)
    return privacy if plan.calibrating or plan.evaluating else {**part.round_info(), **privacy}
