"""FedProto edge: unweighted mean of its devices' prototypes per class, forwarded with the number
of devices holding each class (so the cloud's mean over all devices is exact; see protos.py),
and the sample-weighted personalised accuracy of its devices in its `done` info.

numpy only: the edge holds no model.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

import numpy as np

from splitedge.methods.fedproto.protos import merge_protos, protos_body, weighted_accuracy
from splitedge.methods.strategy import EdgePart, Message, NodeContext, Report, RoundPlan

log = logging.getLogger(__name__)

PROTO_TOPIC = "moments-protos"


class FedProtoEdge(EdgePart):
    def __init__(self, ctx: NodeContext) -> None:
        super().__init__(ctx)
        self.info: dict[str, Any] = {}

    def on_message(self, env: Any) -> list[Message]:
        """Global prototypes go down to the devices (retained, so late joiners get them)."""
        if env.kind == "moments":
            return [Message("moments", dict(env.body), retain=True, topic_kind=PROTO_TOPIC)]
        return []

    def aggregate(self, plan: RoundPlan, reports: Sequence[Report]) -> list[Message]:
        parts = []
        for report in reports:
            env = report.get("moments")
            if env is not None:
                classes = np.asarray(env.body["classes"], dtype=np.int64)
                parts.append((classes, np.ones(len(classes), dtype=np.int64), env.body["mean"]))
        infos = [r.get("done").body["info"] for r in reports if r.get("done") is not None]
        acc, n = weighted_accuracy(infos)
        self.info = {"accuracy": acc, "eval_samples": n} if n else {}
        if not parts:
            log.warning("edge %s: round %d without prototypes", self.ctx.node_id, plan.round)
            return []
        classes, devices, means = merge_protos(parts)
        return [Message("moments", protos_body(classes, devices, means, "f8", plan.wc_version))]

    def round_info(self) -> dict[str, Any]:
        return dict(self.info)
