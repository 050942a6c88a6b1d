"""FedAvg edge: relay the global model down; sample-weighted average of its devices' models up.

numpy only (no torch): an edge that only averages needs no network definition.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

from splitedge.methods.averaging import averaged_body, weight_updates
from splitedge.methods.strategy import EdgePart, Message, Report, RoundPlan

log = logging.getLogger(__name__)

MODEL_TOPIC = "weights-model"


class FedAvgEdge(EdgePart):
    def on_message(self, env: Any) -> list[Message]:
        if env.kind == "weights" and env.body["part"] == "model":
            return [Message("weights", dict(env.body), retain=True, topic_kind=MODEL_TOPIC)]
        return []

    def aggregate(self, plan: RoundPlan, reports: Sequence[Report]) -> list[Message]:
        parts = weight_updates(reports, "model", plan.wc_version)
        if not parts:
            log.warning("edge %s: round %d without model updates", self.ctx.node_id, plan.round)
            return []
        return [Message("weights", averaged_body(parts, "model", plan.wc_version))]
