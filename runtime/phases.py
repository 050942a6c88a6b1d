"""What a device and an edge do in each phase of a round: train, calibrate, evaluate.

A round's training phase is the method's own (`DevicePart.run_round`, `EdgePart.aggregate`);
its calibration and evaluation phases (methods/calibration) are the same for every method, so
the runtimes ask here instead of holding one branch per phase each.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from splitedge.methods.calibration.records import calibration_round, edge_merge, evaluation_round, merged_scores
from splitedge.methods.contract import Message, RoundPlan


def device_work(part: Any, plan: RoundPlan) -> Iterator[Any]:
    """A device part's work in the plan's phase: train, send head statistics, or score a head."""
    part.withheld = {}  # what this phase's statistics hold back below the minimum count per class
    part.dp_releases = 0  # and how many differentially private releases it makes
    if plan.calibrating:
        return calibration_round(part, plan)
    if plan.evaluating:
        return evaluation_round(part, plan)
    return part.run_round(plan)


def device_info(part: Any, plan: RoundPlan) -> dict[str, Any]:
    """The part's own entries of its `done` info: in an evaluation phase its score of the head it
    was sent; none in a calibration phase (it trains nothing); else its `round_info`. In any
    phase, what its statistics held back below the minimum count per class (`withheld`) and how
    many differentially private releases it made (`dp_releases`)."""
    privacy = {"withheld": dict(part.withheld)} if getattr(part, "withheld", None) else {}
    if getattr(part, "dp_releases", 0):
        privacy["dp_releases"] = int(part.dp_releases)
    if plan.evaluating:
        return {**getattr(part, "evaluation", {}), **privacy}
    return privacy if plan.calibrating else {**part.round_info(), **privacy}


def edge_close(part: Any, plan: RoundPlan, reports: Sequence[Any]) -> tuple[list[Message], dict[str, Any]]:
    """An edge's work when a phase closes: its part's aggregation, the devices' head statistics
    merged, or nothing to send; and what its `done` info adds (devices calibrated)."""
    if plan.calibrating:
        messages, calibrated = edge_merge(plan, reports, part.method.config)
        return messages, {"calibrated": calibrated}
    if plan.evaluating:
        return [], {}
    return part.aggregate(plan, reports), {}


def edge_scores(plan: RoundPlan, infos: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """In an evaluation phase, the edge's `done` info carries its devices' merged scores."""
    return merged_scores(infos) if plan.evaluating else {}
