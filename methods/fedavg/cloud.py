"""FedAvg cloud: merge the edges' models (sample-weighted by default), publish the new global
model to every device, evaluate it; with `calibrate="lda"`, also fit the closed-form head on the
devices' head statistics of that model and serve the model with it (methods/calibration)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Sequence, TypeVar

import numpy as np

from splitedge.methods.averaging import weight_updates
from splitedge.methods.calibration.serving import CalibratedCloud
from splitedge.methods.checks import check_weights, weight_specs
from splitedge.methods.fedavg.method import MODEL
from splitedge.methods.contract import DEVICES, CloudContext, CloudPart, Kept, Message, Report, RoundPlan, RoundSpec
from splitedge.methods.fedavg.config import FedAvgConfig
from splitedge.methods.torch_utils import build_split
from splitedge.methods.metrics.evaluate import evaluate
from splitedge.models import load_numpy_state, state_to_numpy

if TYPE_CHECKING:
    from torch import nn

log = logging.getLogger(__name__)


ConfigT = TypeVar("ConfigT", bound=FedAvgConfig)


class FedAvgCloud(CalibratedCloud, CloudPart[ConfigT]):
    """The whole model merged every round and sent to every device. Methods on the same pattern
    (the self-supervised ones) override `build_model` and `evaluate` only."""

    model: Kept[nn.Module]
    version: Kept[int]
    samples: Kept[int]
    calibrated: Kept[dict[str, np.ndarray] | None]
    calibrated_layer: Kept[str]

    def __init__(self, ctx: CloudContext) -> None:
        super().__init__(ctx)
        self.model = self.build_model().to(self.device).eval()
        self.specs = weight_specs(state_to_numpy(self.model))
        self.version = 0
        self.samples = 0

    def build_model(self) -> Any:
        return build_split(self.spec)

    def evaluate(self, plan: RoundPlan) -> dict[str, Any]:
        """Metrics of the merged model after round `plan.round`."""
        return evaluate(self.model, self.ctx.test, self.spec, represent=self.report_due(plan.round))

    def current(self) -> dict[str, np.ndarray]:
        """The global model as numpy (a copy): what this round's updates were trained from."""
        return state_to_numpy(self.model)

    def _model_message(self) -> Message:
        body = {"part": MODEL, "version": self.version, "samples": self.samples, "weights": self.current()}
        return Message("weights", body, to=DEVICES, slot=MODEL)

    def initial_messages(self) -> list[Message]:
        return [self._model_message()]

    def plan(self, round_: int) -> RoundSpec:
        """The whole model is averaged every round; devices train from the announced version."""
        return RoundSpec(versions={MODEL: self.version})

    def check(self, env: Any, source: str) -> None:
        if env.kind == "weights":
            trained_from = self.current() if int(env.body["version"]) == self.version else None
            check_weights(env.body, self.specs, part=MODEL, trained_from=trained_from)

    def aggregate(self, plan: RoundPlan, reports: Sequence[Report]) -> tuple[list[Message], dict[str, float]]:
        parts = weight_updates(reports, MODEL, plan.version(MODEL))
        out: list[Message] = []
        if parts:
            merged = self.method.merge_weights(parts, reference=self.current())
            load_numpy_state(self.model, self.server_update(merged))
            self.version += 1
            self.samples = sum(n for _, n in parts)
            out.append(self._model_message())
        else:
            log.warning("cloud: round %d without any edge model; keeping version %d", plan.round, self.version)
        return out, {**self.evaluate(plan), "model_version": self.version, "samples": self.samples}

    def adopt_sent(self, slot: str, weights: Any) -> None:
        """The model devices decoded (compressed downlink): evaluated, calibrated and served from
        here on, so the head fits the features devices compute; a server optimiser steps from it."""
        if slot == MODEL and weights is not None:
            load_numpy_state(self.model, weights)

    def server_update(self, merged: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The new global model from the merge of the devices' (FedAvg: the merge itself; a
        server optimiser steps on the pseudo-gradient, the merge minus the current model)."""
        return merged

    def state_for_checkpoint(self) -> dict[str, np.ndarray]:
        """The model as merged, or with calibration its last calibrated form (the model of the
        last calibrating round with the closed-form head)."""
        return self.served_state(state_to_numpy(self.model))
