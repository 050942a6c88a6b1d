"""SplitFed cloud: merge W_c and the server-side W_e/W_g of the edges every round, evaluate the triple."""

from __future__ import annotations

import logging
from typing import Any, Sequence

import numpy as np

from splitedge.methods.averaging import weight_updates
from splitedge.methods.calibration.serving import CalibratedCloud
from splitedge.methods.calibration.upper import CALIB, sent_copy, upper_update
from splitedge.methods.checks import check_weights, weight_specs
from splitedge.methods.splitfed.method import MODEL
from splitedge.methods.contract import CHILDREN, DEVICES, CloudContext, CloudPart, Kept, Message, Report, RoundPlan, RoundSpec
from splitedge.methods.splitfed.config import SplitFedConfig
from splitedge.methods.torch_utils import build_split
from splitedge.methods.metrics.evaluate import evaluate
from splitedge.models import PART_NAMES, ClassifierInput, SplitModel, load_numpy_state, state_to_numpy
from splitedge.protocol.errors import ProtocolError

log = logging.getLogger(__name__)


class SplitFedCloud(CalibratedCloud, CloudPart[SplitFedConfig]):
    model: Kept[SplitModel]
    version: Kept[int]
    calib: Kept[ClassifierInput]
    calib_version: Kept[int]
    calibrated: Kept[dict[str, np.ndarray] | None]
    calibrated_layer: Kept[str]

    def __init__(self, ctx: CloudContext) -> None:
        super().__init__(ctx)
        self.model = build_split(self.spec).eval()
        self.specs = {part: weight_specs(state_to_numpy(self.model.part(part))) for part in PART_NAMES}
        self.version = 0  # one counter: W_c, W_e and W_g are averaged together every round
        self.calib, self.calib_version = sent_copy(self.model), -1  # W_e and the trunk devices calibrate with

    def _message(self, part: str, samples: int = 0) -> Message:
        """W_c to every device (through its edge), W_e and W_g to the edges' server side."""
        body = {"part": part, "version": self.version, "samples": samples,
                "weights": state_to_numpy(self.model.part(part))}
        return Message("weights", body, to=DEVICES if part == "wc" else CHILDREN, slot=part)

    def initial_messages(self) -> list[Message]:
        return [self._message(part) for part in PART_NAMES]

    def plan(self, round_: int) -> RoundSpec:
        return RoundSpec(versions={MODEL: self.version})

    def before_calibration(self, round_: int) -> list[Message]:
        """Devices hold W_c only: the merged W_e and W_g's trunk go to them when they changed."""
        self.calib_version, out = upper_update(self.calib, self.calib_version, self.model)
        return out

    def calibration_versions(self, round_: int) -> dict[str, int]:
        return {MODEL: self.version, CALIB: self.calib_version}

    def check(self, env: Any, source: str) -> None:
        if env.kind == "weights":
            if env.body["part"] not in self.specs:
                raise ProtocolError("state.part", f"no SplitFed part {env.body['part']!r}")
            part = env.body["part"]
            trained_from = state_to_numpy(self.model.part(part)) if int(env.body["version"]) == self.version else None
            check_weights(env.body, self.specs[part], trained_from=trained_from)

    def aggregate(self, plan: RoundPlan, reports: Sequence[Report]) -> tuple[list[Message], dict[str, float]]:
        updates = {part: weight_updates(reports, part, self.version) for part in PART_NAMES}
        samples = {part: sum(n for _, n in parts) for part, parts in updates.items()}
        out: list[Message] = []
        if any(updates.values()):
            for part, parts in updates.items():
                if parts:
                    module = self.model.part(part)
                    load_numpy_state(module, self.method.merge_weights(parts, reference=state_to_numpy(module)))
                else:
                    log.warning("cloud: round %d without %s updates; keeping it", plan.round, part)
            self.version += 1
            out = [self._message(part, samples[part]) for part in PART_NAMES]
        metrics = {**evaluate(self.model, self.ctx.test, self.spec, represent=self.report_due(plan.round)),
                   "model_version": self.version, "server_samples": samples["we"]}
        return out, metrics

    def state_for_checkpoint(self) -> dict[str, np.ndarray]:
        return self.served_state(state_to_numpy(self.model))
