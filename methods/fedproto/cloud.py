"""FedProto cloud: exact unweighted mean over devices of the per-class prototypes, published down.

There is no global model to evaluate: `accuracy` is the PERSONALISED accuracy, the mean of the
devices' local models on their own held-out data, weighted by held-out samples (edges send the
weighted mean of their devices in their `done` info). numpy only.
"""

from __future__ import annotations

import logging
from typing import Sequence

import numpy as np

from splitedge.methods.config import ModelSpec, from_config
from splitedge.methods.fedproto.config import FedProtoConfig
from splitedge.methods.fedproto.edge import PROTO_TOPIC
from splitedge.methods.fedproto.protos import merge_protos, protos_body, weighted_accuracy
from splitedge.methods.strategy import CloudPart, Message, NodeContext, Report, RoundPlan

log = logging.getLogger(__name__)


class FedProtoCloud(CloudPart):
    method = "fedproto"

    def __init__(self, ctx: NodeContext) -> None:
        super().__init__(ctx)
        self.spec = from_config(ModelSpec, ctx.config)
        self.cfg = from_config(FedProtoConfig, ctx.config)
        self.version = 0  # of the global prototypes; 0 = none yet
        self.protos: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None

    def plan(self, round_: int) -> RoundPlan:
        """wc_version carries the prototype version devices must hold before training."""
        config = dict(self.ctx.config)
        return RoundPlan(round=round_, method=self.method, slow_wc=False, slow_we=False,
                         deadline_s=float(config.get("deadline_s", 120.0)), wc_version=self.version,
                         we_version=0, config=config)

    def aggregate(self, plan: RoundPlan, reports: Sequence[Report]) -> tuple[list[Message], dict[str, float]]:
        parts = [(np.asarray(env.body["classes"], dtype=np.int64), np.asarray(env.body["counts"], dtype=np.int64),
                  env.body["mean"]) for r in reports if (env := r.get("moments")) is not None]
        out: list[Message] = []
        if parts:
            self.protos = merge_protos(parts)
            self.version += 1
            body = protos_body(*self.protos, self.cfg.proto_dtype, self.version)
            out.append(Message("moments", body, retain=True, topic_kind=PROTO_TOPIC))
        else:
            log.warning("cloud: round %d without prototypes", plan.round)
        infos = [r.get("done").body["info"] for r in reports if r.get("done") is not None]
        acc, n = weighted_accuracy(infos)
        metrics = {"accuracy": acc, "personalised": 1.0, "eval_samples": n, "proto_version": self.version,
                   "proto_classes": 0 if self.protos is None else len(self.protos[0])}
        return out, metrics

    def state_for_checkpoint(self) -> dict[str, np.ndarray]:
        """The global prototypes (there is no global model)."""
        if self.protos is None:
            return {}
        classes, devices, means = self.protos
        return {"classes": classes, "devices": devices, "prototypes": means.astype(np.float32)}
