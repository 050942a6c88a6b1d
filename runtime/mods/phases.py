"""A round's calibration and evaluation phases as mods: the same for every method
(methods/calibration), so they wrap the part's own phase instead of each runtime holding one
branch per phase.

On a device: a calibration phase sends head statistics, an evaluation phase scores a head (or,
choosing among layers, the candidate heads of that round, which this mod keeps as they come)
and says so in its `done`; a training phase is the part's own. On an edge: a calibration
phase merges its devices' head statistics, an evaluation phase merges their scores into its
`done`; a training phase is the part's `aggregate`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from splitedge.methods.calibration import HEAD
from splitedge.methods.calibration.layers import layer_names, selects
from splitedge.methods.calibration.records import (
    calibration_round, edge_merge, evaluation, is_heads, merged_scores, take_heads,
)
from splitedge.methods.contract import DONE, Message, RoundPlan
from splitedge.protocol.codec import Envelope
from splitedge.protocol.done import DoneInfo, Scores
from splitedge.runtime.mods import Mod


class DevicePhases(Mod):
    writes = ("scores",)

    def __init__(self, device: Any) -> None:
        self.device = device
        self.reset()

    def reset(self) -> None:
        self.heads: dict[str, tuple[np.ndarray, np.ndarray]] | None = None  # the newest round's candidates
        self.heads_version = -1
        self.scores = Scores()  # the last evaluation phase's, for its done

    def receive(self, env: Envelope, call_next: Callable[[Envelope], None]) -> None:
        """Candidate heads are kept for the evaluation phase that chooses the head's layer (the
        newest round's); anything else is the part's."""
        if not is_heads(env):
            call_next(env)
        elif int(env.body["version"]) > self.heads_version:
            self.heads = take_heads(env.body, layer_names(self.device.part.cfg))
            self.heads_version = int(env.body["version"])

    def ready(self, plan: RoundPlan) -> bool:
        """An evaluation phase that chooses among layers waits for that round's candidate heads."""
        part = self.device.part
        if plan.evaluating and selects(part.cfg) and part.layered_calibration:
            return self.heads_version >= plan.version(HEAD)
        return True

    def work(self, plan: RoundPlan, call_next: Callable[[RoundPlan], Iterator[Any]]) -> Iterator[Any]:
        if plan.calibrating:
            return calibration_round(self.device.part, plan)
        if plan.evaluating:
            return self._evaluate()
        return call_next(plan)

    def _evaluate(self) -> Iterator[Any]:
        self.scores = Scores(**evaluation(self.device.part, self.heads))
        yield DONE

    def done(self, plan: RoundPlan, info: DoneInfo, children: Mapping[str, DoneInfo]) -> DoneInfo:
        return info.but(scores=self.scores) if plan.evaluating else info


class EdgePhases(Mod):
    writes = ("devices.calibrated", "devices.scores")

    def __init__(self, edge: Any) -> None:
        self.edge = edge
        self.calibrated: int | None = None  # devices whose records the calibration phase merged

    def merge(self, plan: RoundPlan, reports: Sequence[Any],
              call_next: Callable[[RoundPlan, Sequence[Any]], list[Message]]) -> list[Message]:
        self.calibrated = None
        if plan.calibrating:
            messages, self.calibrated = edge_merge(plan, reports, self.edge.part.method.config)
            return messages
        return [] if plan.evaluating else call_next(plan, reports)

    def done(self, plan: RoundPlan, info: DoneInfo, children: Mapping[str, DoneInfo]) -> DoneInfo:
        """A calibration phase: how many devices' records it merged; an evaluation phase: its
        devices' merged scores."""
        if info.devices is None:
            return info
        if plan.calibrating and self.calibrated is not None:  # its merge did not fail
            return info.but_devices(calibrated=self.calibrated)
        if plan.evaluating:
            return info.but_devices(scores=merged_scores([c.scores for c in children.values()]))
        return info
