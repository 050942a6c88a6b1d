"""A device part's own entries of its `done` info in each phase of a round.

The calibration and evaluation phases themselves are mods (runtime/mods/phases.py); a training
phase's info carries the part's `round_info` (its `method` section); in any phase, what its
statistics held back below the minimum count per class and how many differentially private
releases it made.
"""

from __future__ import annotations

from typing import Any

from splitedge.methods.contract import RoundPlan
from splitedge.protocol.done import DoneInfo


def device_info(part: Any, plan: RoundPlan) -> DoneInfo:
    """The part's `round_info` in a training phase (none in the others: it trains nothing), with
    `withheld` (classes and images held back below the minimum count per class), `dp_releases`
    and its losses."""
    trained = not (plan.calibrating or plan.evaluating)
    return DoneInfo(withheld=dict(part.withheld or {}), dp_releases=int(part.dp_releases or 0),
                    loss=dict(part.losses or {}), method=dict(part.round_info()) if trained else {})
