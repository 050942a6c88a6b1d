"""SplitFed cloud: average W_c and the server-side W_e/W_g of the edges every round, evaluate the triple."""

from __future__ import annotations

import logging
from typing import Sequence

import numpy as np

from splitedge.methods.averaging import average_states, weight_updates
from splitedge.methods.config import ModelSpec, from_config
from splitedge.methods.splitfed.config import SplitFedConfig
from splitedge.methods.strategy import CloudPart, Message, NodeContext, Report, RoundPlan
from splitedge.methods.torch_utils import build_split, test_accuracy
from splitedge.models import PART_NAMES, load_numpy_state, state_to_numpy

log = logging.getLogger(__name__)


class SplitFedCloud(CloudPart):
    method = "splitfed"

    def __init__(self, ctx: NodeContext) -> None:
        super().__init__(ctx)
        self.spec = from_config(ModelSpec, ctx.config)
        self.cfg = from_config(SplitFedConfig, ctx.config)
        self.model = build_split(self.spec).eval()
        self.version = 0  # one counter: W_c, W_e and W_g are averaged together every round

    def _message(self, part: str, samples: int = 0) -> Message:
        body = {"part": part, "version": self.version, "samples": samples,
                "weights": state_to_numpy(self.model.part(part))}
        return Message("weights", body, retain=True, topic_kind=f"weights-{part}")

    def initial_messages(self) -> list[Message]:
        return [self._message(part) for part in PART_NAMES]

    def plan(self, round_: int) -> RoundPlan:
        config = dict(self.ctx.config)
        return RoundPlan(round=round_, method=self.method, slow_wc=True, slow_we=True,
                         deadline_s=float(config.get("deadline_s", 120.0)), wc_version=self.version,
                         we_version=self.version, config=config)

    def aggregate(self, plan: RoundPlan, reports: Sequence[Report]) -> tuple[list[Message], dict[str, float]]:
        updates = {part: weight_updates(reports, part, self.version) for part in PART_NAMES}
        samples = {part: sum(n for _, n in parts) for part, parts in updates.items()}
        out: list[Message] = []
        if any(updates.values()):
            for part, parts in updates.items():
                if parts:
                    load_numpy_state(self.model.part(part), average_states(parts))
                else:
                    log.warning("cloud: round %d without %s updates; keeping it", plan.round, part)
            self.version += 1
            out = [self._message(part, samples[part]) for part in PART_NAMES]
        metrics = {"accuracy": test_accuracy(self.model, self.ctx.extra["test"], self.spec),
                   "model_version": self.version, "server_samples": samples["we"]}
        return out, metrics

    def state_for_checkpoint(self) -> dict[str, np.ndarray]:
        return state_to_numpy(self.model)
