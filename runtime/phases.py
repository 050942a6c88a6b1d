"""What a device and an edge do in each phase of a round: train, calibrate, evaluate.

A round's training phase is the method's own (`DevicePart.run_round`, `EdgePart.aggregate`);
its calibration and evaluation phases (methods/calibration) are the same for every method, so
the runtimes ask here instead of holding one branch per phase each.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from splitedge.methods.calibration import HEAD
from splitedge.methods.calibration.layers import layer_names, selects
from splitedge.methods.calibration.records import (
    calibration_round, edge_merge, evaluation_round, is_heads, merged_scores, take_heads,
)
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


def device_message(part: Any, env: Any) -> None:
    """A checked message from above: candidate heads are kept for the evaluation phase that
    chooses the head's layer (the newest round's); anything else is the part's."""
    if is_heads(env):
        if int(env.body["version"]) > getattr(part, "heads_version", -1):
            part.candidate_heads = take_heads(env.body, layer_names(part.cfg))
            part.heads_version = int(env.body["version"])
        return
    part.on_message(env)


def device_ready(part: Any, plan: RoundPlan) -> bool:
    """Whether the part can do the plan's phase: its own readiness, and in an evaluation phase
    that chooses among layers, the candidate heads of that round."""
    if plan.evaluating and selects(part.cfg) and part.layered_calibration:
        return part.ready(plan) and getattr(part, "heads_version", -1) >= plan.version(HEAD)
    return part.ready(plan)


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
