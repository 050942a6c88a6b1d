"""FedProto edge: unweighted mean of its devices' prototypes per class, forwarded with the number
of devices holding each class (so the cloud's mean over all devices is exact; see protos.py),
and the sample-weighted personalised accuracy of its devices in its `done` info.

numpy only: the edge holds no model.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

import numpy as np

from splitedge.methods.robust import robust_rule
from splitedge.methods.fedproto.protos import PROTOS, check_protos, merge_protos, protos_body, weighted_accuracy
from splitedge.methods.contract import EdgeContext, EdgePart, Kept, Message, Report, RoundPlan
from splitedge.methods.fedproto.config import FedProtoConfig
from splitedge.protocol.done import dones

log = logging.getLogger(__name__)


class FedProtoEdge(EdgePart[FedProtoConfig]):
    dim: Kept[int | None]  # the representation's, as the cloud announced it; info (the round's accuracy) is not kept

    def __init__(self, ctx: EdgeContext) -> None:
        super().__init__(ctx)
        self.info: dict[str, Any] = {}
        self.dim = self.cfg.dim or None

    def check(self, env: Any, source: str) -> None:
        """Prototypes of this model's classes, all of one dimension (the first one seen sets it)."""
        if env.kind == "moments":
            self.dim = check_protos(env.body, self.spec.num_classes, self.dim)

    def aggregate(self, plan: RoundPlan, reports: Sequence[Report]) -> list[Message]:
        parts = []
        for report in reports:
            env = report.get("moments")
            if env is not None:
                classes = np.asarray(env.body["classes"], dtype=np.int64)
                devices = np.asarray(env.body["counts"], dtype=np.int64) if report.summed \
                    else np.ones(len(classes), dtype=np.int64)  # a secure sum's counts are its devices
                parts.append((classes, devices, env.body["mean"]))
        infos = [i.method for i in dones(reports).values()]
        acc, n = weighted_accuracy(infos)
        rank, _ = weighted_accuracy(infos, "effective_rank")
        self.info = {"accuracy": acc, "effective_rank": rank, "eval_samples": n} if n else {}
        if not parts:
            log.warning("edge %s: round %d without prototypes", self.ctx.node_id, plan.round)
            return []
        classes, devices, means = merge_protos(parts, **robust_rule(self.cfg))
        return [Message("moments", protos_body(classes, devices, means, "f8", plan.version(PROTOS)))]

    def round_info(self) -> dict[str, Any]:
        return dict(self.info)
