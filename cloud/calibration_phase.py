"""A round's calibration at the cloud, and the evaluation phase that follows it where devices hold
their own models (methods/calibration): which devices compute head statistics, whether the last
head still stands, what the part fits, and the one warning a head lacking classes gets.

The round driver (cloud/driver.py) calls `run` after a round's merge; the phases themselves go
through the driver's `run_phase` and `commit_and_publish`, so they are opened, collected,
committed and resumed as any round is.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from typing import Any, Protocol, Sequence

from splitedge.methods.calibration import CALIBRATE, EVALUATE, HEAD
from splitedge.methods.calibration.layers import selects
from splitedge.methods.calibration.records import Gate, merged_scores, records_of
from splitedge.methods.contract import FederationView, Message, RoundPlan
from splitedge.protocol.done import dones
from splitedge.runtime.records import phase_failures, phase_privacy

log = logging.getLogger(__name__)


class PhaseDriver(Protocol):
    """What the phases need of the round driver (cloud/driver.py)."""

    part: Any
    method: Any
    view: FederationView
    gate: Any

    @property
    def awaited(self) -> set[str]: ...

    def run_phase(self, plan: RoundPlan) -> list[Any]: ...

    def commit_and_publish(self, messages: list[Message], round_: int | None = None) -> None: ...


class CloudCalibration:
    """The cloud's calibrations over a run: the last one's inputs and metrics (`last`, kept in the
    resume state, so a resumed cloud reuses a head as the undisturbed one would) and whether a
    head lacking classes was already said."""

    def __init__(self, driver: PhaseDriver) -> None:
        self.driver = driver
        self.last: tuple[str, dict[str, Any]] | None = None  # (its inputs, its metrics): reused when unchanged
        self.partial_head_warned = False

    def run(self, trained_plan: RoundPlan, trained: list[Any]) -> tuple[dict[str, Any], list[Any]]:
        """The round's calibration: its devices (those drawn, when sampling) send head statistics
        of the model they now hold, edges merge them, the part fits the head; where devices hold
        their own models, an evaluation phase follows. Returns the metrics and the last phase's
        reports (`trained`, the round's, when no phase could be opened)."""
        d = self.driver
        r, layers = trained_plan.round, d.part.calibration_layers()
        if layers is None:
            log.warning("cloud: %s cannot calibrate its head; round %d is not calibrated", d.method.name, r)
            return {}, trained
        d.commit_and_publish(d.part.before_calibration(r), round_=r)
        plan = dataclasses.replace(trained_plan, versions=dict(d.part.calibration_versions(r)),
                                   directives={CALIBRATE: {"layers": dict(layers)}}, phase=CALIBRATE)
        devices = self.devices(plan)
        inputs = json.dumps([plan.versions, devices], sort_keys=True)  # plain: kept in the resume state
        if self.last is not None and self.last[0] == inputs:
            log.info("cloud: round %d's calibration inputs are those of the last one (models %s, the same devices): "
                     "its head stands, no phase", r, dict(plan.versions))
            return {**self.last[1], "calibration_reused": True}, trained
        d.gate = Gate.of(plan, d.method)
        reports, d.gate = d.run_phase(plan), None
        return self.fit(plan, reports, devices, inputs)

    def fit(self, plan: RoundPlan, reports: list[Any], devices: dict[str, list[str]],
            inputs: str) -> tuple[dict[str, Any], list[Any]]:
        """The head the part fits on the phase's records (scored by the devices where they hold their
        own models), kept as `last` when every one of `devices` answered and there is no DP noise."""
        d, r = self.driver, plan.round
        sources, privacy = records_of(reports), phase_privacy(reports, prefix="calibration_")
        silent = sorted({e for e, held in d.view.members.items() if held} -
                        {rep.sender for rep in reports})  # down, or past the deadline: said first
        if not sources:
            if privacy.get("calibration_withheld"):  # every image under the floor: said once, with the fix
                self.warn_partial_head({"calibrated_classes": 0, **privacy}, silent)
            else:
                log.warning("cloud: round %d's calibration got no head statistics; the head is not refitted", r)
            return {"calibrated_edges": 0, **privacy}, reports
        metrics = {**d.part.calibrate(plan, sources), "calibrated_edges": len({e for by in sources.values() for e in by}),
                   "calibration_versions": dict(plan.versions)}
        self.warn_partial_head({**metrics, **privacy}, silent)
        answered = sum(i.devices.reported for i in dones(reports).values() if i.devices is not None)
        complete = answered == sum(map(len, devices.values())) and not silent and not phase_failures(reports)
        heads = d.part.head_messages()
        if heads:
            scores, reports = self.evaluate(plan, heads)
            metrics.update(scores)
        # every device answered: the same inputs next round give the same head, and the same floors
        # (without DP: a DP release carries fresh noise and is accounted each time)
        metrics.update(privacy)
        self.last = (inputs, dict(metrics)) if complete and not d.method.config.dp_sigma > 0 else None
        return metrics, reports

    def devices(self, plan: RoundPlan) -> dict[str, list[str]]:
        """The devices that compute a calibration's head statistics (each edge's, those drawn
        when sampling): with the models the phase names, all the statistics follow from. The same
        inputs give the same head (58, item 5: hsfp-cal recomputed and resent identical
        statistics every round until W_c was averaged)."""
        drawn = set(plan.participants)
        return {e: sorted(d for d in self.driver.view.members.get(e, ()) if not drawn or d in drawn)
                for e in self.driver.awaited}

    def warn_partial_head(self, metrics: dict[str, Any], silent: Sequence[str] = ()) -> None:
        """Once a run: a calibrated head that lacks classes is scored but not served (serving.py),
        or (0 classes) there is none, and why (`silent`: edges with devices that sent nothing)."""
        method = self.driver.method
        classes, want = metrics.get("calibrated_classes"), method.spec.num_classes
        if classes is None or classes >= want or self.partial_head_warned:
            return
        self.partial_head_warned = True
        withheld = metrics.get("calibration_withheld") or {}
        why = (f"the devices withheld {withheld.get('samples', 0)} of their images as classes they hold fewer than "
               f"min_class_count={method.config.min_class_count} of" if withheld else "no device that reported "
               "holds them")
        if silent:  # an edge that is down sends nothing: that comes before any device's floor
            why = f"edge{'s' if len(silent) > 1 else ''} {', '.join(silent)} sent no head statistics; {why}"
        what = (f"calibration gets no head statistics ({why}): the head is not refitted" if not classes else
                f"the calibrated head has {classes} of {want} classes ({why}): it is scored, the served model "
                f"keeps its own head")
        log.warning("cloud: %s. %s", what, "Give each device more images or lower min_class_count (docs/privacy.md)"
                    if withheld else "Check the silent edges: their devices' classes come back with them" if silent
                    else "Every class needs a device that holds it")

    def evaluate(self, calibrated: RoundPlan, heads: list[Message]) -> tuple[dict[str, Any], list[Any]]:
        """Devices that hold their own models score the head they were sent on their held-out
        data; each edge merges its devices' scores, the cloud its edges' (by samples scored)."""
        d = self.driver
        r = calibrated.round
        d.commit_and_publish(heads, round_=r)
        plan = dataclasses.replace(calibrated, versions={**calibrated.versions, HEAD: r}, directives={}, phase=EVALUATE)
        reports = d.run_phase(plan)
        by_edge = {e: i.devices.scores for e, i in dones(reports).items() if i.devices is not None}
        merged = merged_scores(list(by_edge.values()))
        if selects(d.method.config):  # the candidate layers, scored on the images devices held back
            return d.part.heads_scored(merged.layer_scores), reports
        scores = {"personalised_accuracy_calibrated": merged.accuracy,
                  "cluster_accuracy_calibrated": {e: s.accuracy for e, s in by_edge.items() if s.accuracy is not None}}
        if d.method.personalised:  # its accuracy is the devices' own: so is the calibrated one
            scores["accuracy_calibrated"] = merged.accuracy
        return scores, reports
