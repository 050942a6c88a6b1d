"""FedProto cloud: exact unweighted mean over devices of the per-class prototypes, published down.

There is no global model to evaluate: `accuracy` is the PERSONALISED accuracy, the mean of the
devices' local models on their own held-out data, weighted by held-out samples (edges send the
weighted mean of their devices in their `done` info). Devices with private reports keep their
scores: a run whose devices all report privately has no accuracy (docs/privacy.md). numpy only.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

import numpy as np

from splitedge.methods.calibration.layers import CLASSIFIER
from splitedge.methods.calibration.lda import lda_classifier
from splitedge.methods.calibration.records import head_message, merge
from splitedge.methods.robust import robust_rule
from splitedge.methods.fedproto.protos import PROTOS, check_protos, merge_protos, protos_body, weighted_accuracy
from splitedge.methods.contract import DEVICES, CloudContext, CloudPart, Kept, Message, Report, RoundPlan, RoundSpec
from splitedge.methods.fedproto.config import FedProtoConfig
from splitedge.protocol.done import dones

log = logging.getLogger(__name__)


class FedProtoCloud(CloudPart[FedProtoConfig]):
    version: Kept[int]  # of the global prototypes; 0 = none yet
    protos: Kept[tuple[np.ndarray, np.ndarray, np.ndarray] | None]
    dim: Kept[int | None]  # FedProto.settle: from the model

    def __init__(self, ctx: CloudContext) -> None:
        super().__init__(ctx)
        self.version = 0  # of the global prototypes; 0 = none yet
        self.protos = None
        self.dim = self.cfg.dim or None

    def plan(self, round_: int) -> RoundSpec:
        """Devices train with the announced version of the global prototypes."""
        return RoundSpec(versions={PROTOS: self.version})

    def check(self, env: Any, source: str) -> None:
        if env.kind == "moments":
            self.dim = check_protos(env.body, self.spec.num_classes, self.dim)

    def aggregate(self, plan: RoundPlan, reports: Sequence[Report]) -> tuple[list[Message], dict[str, float]]:
        parts = [(np.asarray(env.body["classes"], dtype=np.int64), np.asarray(env.body["counts"], dtype=np.int64),
                  env.body["mean"]) for r in reports if (env := r.get("moments")) is not None]
        out: list[Message] = []
        if parts:
            self.protos = merge_protos(parts, **robust_rule(self.cfg))
            self.version += 1
            body = protos_body(*self.protos, self.cfg.proto_dtype, self.version)
            out.append(Message("moments", body, to=DEVICES, slot=PROTOS))
        else:
            log.warning("cloud: round %d without prototypes", plan.round)
        edges = list(dones(reports).values())
        infos = [i.method for i in edges]
        acc, n = weighted_accuracy(infos)
        rank, _ = weighted_accuracy(infos, "effective_rank")
        private = any(i.devices is not None and i.devices.private_cost for i in edges)
        if not n and private and not getattr(self, "said_private", False):
            self.said_private = True  # once a run
            log.warning("cloud: no accuracy: FedProto's is its devices' scores of their held-out data, which devices "
                        "with private reports keep to themselves (docs/privacy.md, what stays in the clear)")
        metrics = {"accuracy": acc, "effective_rank": rank, "personalised": 1.0, "eval_samples": n,
                   "proto_version": self.version,
                   "proto_classes": 0 if self.protos is None else len(self.protos[0])}
        return out, metrics

    # -- calibration: one head for the federation, scored by each device on its held-out share
    def calibration_dim(self) -> int | None:
        return self.dim

    def calibrate(self, plan: RoundPlan, sources: Any) -> dict[str, Any]:
        stats = merge(sources[CLASSIFIER], self.cfg)
        head = lda_classifier(stats, self.spec.num_classes, shrink=self.cfg.calib_shrink)
        self.heads = [head_message(head, plan.round, DEVICES)]
        return {"calibrated": stats.total}

    def head_messages(self) -> list[Message]:
        heads, self.heads = getattr(self, "heads", []), []
        return heads

    def state_for_checkpoint(self) -> dict[str, np.ndarray]:
        """The global prototypes (there is no global model)."""
        if self.protos is None:
            return {}
        classes, devices, means = self.protos
        return {"classes": classes, "devices": devices, "prototypes": means.astype(np.float32)}
