"""FedAvg cloud: average the edges' models by samples, publish the new global model, evaluate it."""

from __future__ import annotations

import logging
from typing import Sequence

import numpy as np

from splitedge.methods.averaging import average_states, weight_updates
from splitedge.methods.config import ModelSpec, from_config
from splitedge.methods.fedavg.config import FedAvgConfig
from splitedge.methods.fedavg.edge import MODEL_TOPIC
from splitedge.methods.strategy import CloudPart, Message, NodeContext, Report, RoundPlan
from splitedge.methods.torch_utils import build_split, test_accuracy
from splitedge.models import load_numpy_state, state_to_numpy

log = logging.getLogger(__name__)


class FedAvgCloud(CloudPart):
    method = "fedavg"

    def __init__(self, ctx: NodeContext) -> None:
        super().__init__(ctx)
        self.spec = from_config(ModelSpec, ctx.config)
        self.cfg = from_config(FedAvgConfig, ctx.config)
        self.model = build_split(self.spec).eval()
        self.version = 0
        self.samples = 0

    def _model_message(self) -> Message:
        body = {"part": "model", "version": self.version, "samples": self.samples,
                "weights": state_to_numpy(self.model)}
        return Message("weights", body, retain=True, topic_kind=MODEL_TOPIC)

    def initial_messages(self) -> list[Message]:
        return [self._model_message()]

    def plan(self, round_: int) -> RoundPlan:
        """The whole model is averaged every round; wc_version names the model devices start from."""
        config = dict(self.ctx.config)
        return RoundPlan(round=round_, method=self.method, slow_wc=True, slow_we=True,
                         deadline_s=float(config.get("deadline_s", 120.0)), wc_version=self.version,
                         we_version=0, config=config)

    def aggregate(self, plan: RoundPlan, reports: Sequence[Report]) -> tuple[list[Message], dict[str, float]]:
        parts = weight_updates(reports, "model", plan.wc_version)
        out: list[Message] = []
        if parts:
            load_numpy_state(self.model, average_states(parts))
            self.version += 1
            self.samples = sum(n for _, n in parts)
            out.append(self._model_message())
        else:
            log.warning("cloud: round %d without any edge model; keeping version %d", plan.round, self.version)
        metrics = {"accuracy": test_accuracy(self.model, self.ctx.extra["test"], self.spec),
                   "model_version": self.version, "samples": self.samples}
        return out, metrics

    def state_for_checkpoint(self) -> dict[str, np.ndarray]:
        return state_to_numpy(self.model)
