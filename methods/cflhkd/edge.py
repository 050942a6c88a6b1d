"""CFLHKD edge: one cluster. It merges its devices' models (the cluster model, sent back down once
clustering has started, and up for the global model), merges their class-wise mean logits into
the cluster's teacher table, and forwards their clustering signals. numpy only."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from splitedge.methods.averaging import GlobalModels, averaged_body, weight_updates
from splitedge.methods.cflhkd.distill import merge_tables
from splitedge.methods.robust import robust_rule
from splitedge.methods.cflhkd.method import CLUSTERED, GLOBAL, MODEL, SIGNAL, SIGNALS
from splitedge.methods.checks import check_stats, check_vector, check_weights, weight_specs
from splitedge.methods.fedproto.protos import weighted_accuracy
from splitedge.methods.cflhkd.config import CFLHKDConfig
from splitedge.methods.contract import CHILDREN, EdgeContext, EdgePart, Kept, Message, Report, RoundPlan
from splitedge.protocol.done import dones


def global_scores(infos: Sequence[dict[str, Any]], key: str = "global_accuracy",
                  samples: str = "eval_samples") -> list[dict[str, Any]]:
    """The global model's held-out scores in round infos, as `weighted_accuracy` reads them."""
    return [{"accuracy": i[key], "eval_samples": i[samples]} for i in infos if key in i and samples in i]


class CFLHKDEdge(EdgePart[CFLHKDConfig]):
    # info: the round's accuracy, read by round_info as the round ends (not kept)
    specs: Kept[dict | None]  # the model's names and shapes, from the first global model
    signal_dim: Kept[int | None]

    def __init__(self, ctx: EdgeContext) -> None:
        super().__init__(ctx)
        self.specs, self.signal_dim = None, None
        self.info: dict[str, Any] = {}
        self.models = GlobalModels()  # the global or cluster model the devices train from, by version

    def check(self, env: Any, source: str) -> None:
        body, c = env.body, self.spec.num_classes
        if env.kind == "weights" and self.specs is not None:
            part = GLOBAL if self.cfg.two_way and body.get("part") == GLOBAL else MODEL
            check_weights(body, self.specs, part=part, source=source, trained_from=self.models.of(body))
        elif env.kind == "logits":
            check_stats(body, "logits", dim=c, num_classes=c)
        elif env.kind == "arrays" and body["name"] == SIGNAL:
            self.signal_dim = check_vector(body["arrays"].get("v"), self.signal_dim, "a clustering signal")

    def on_message(self, env: Any) -> list[Message]:
        if env.kind == "weights" and env.body["part"] in (MODEL, GLOBAL):
            self.specs = self.specs or weight_specs(env.body["weights"])
            self.models.note(env.body["part"], int(env.body["version"]), env.body["weights"])
        return []

    def aggregate(self, plan: RoundPlan, reports: Sequence[Report]) -> list[Message]:
        out: list[Message] = []
        parts = weight_updates(reports, MODEL, plan.version(MODEL))
        if parts:
            body = averaged_body(parts, MODEL, plan.round, self.method.merge_weights,  # versioned by round
                                 self.models.trained_from(MODEL, plan.version(MODEL)))
            clustered = plan.directives.get("phase") == CLUSTERED
            if clustered:
                self.models.note(MODEL, plan.round, body["weights"])  # next round's devices train from it
                out.append(Message("weights", body, to=CHILDREN, slot=MODEL))  # the cluster model, for its devices
            if not (clustered and self.cfg.distill_global):  # else the global model is the distilled one, below
                out.append(Message("weights", body))
        if GLOBAL in plan.versions:  # the devices' distilled copies of the global model, merged for the cloud
            version = plan.version(GLOBAL)
            distilled = weight_updates(reports, GLOBAL, version)
            if distilled:
                out.append(Message("weights", averaged_body(distilled, GLOBAL, version, self.method.merge_weights,
                                                            self.models.trained_from(GLOBAL, version))))
        tables = [(e.body["classes"], e.body["counts"], e.body["logits"]) for r in reports for e in r.all("logits")]
        if tables:
            counts, logits = merge_tables(tables, self.spec.num_classes, **robust_rule(self.cfg))
            held = np.flatnonzero(counts)
            out.append(Message("logits", {"classes": held.astype(np.int64), "counts": counts[held],
                                          "logits": logits[held].astype(np.float32)}))
        signals = {r.sender: e.body["arrays"]["v"] for r in reports for e in r.all("arrays") if e.body["name"] == SIGNAL}
        if signals:
            out.append(Message("arrays", {"name": SIGNALS, "version": plan.round, "arrays": signals}))
        infos = [i.method for i in dones(reports).values()]
        acc, n = weighted_accuracy(infos)
        self.info = {"accuracy": acc, "eval_samples": n} if n else {}
        global_acc, global_n = weighted_accuracy(global_scores(infos))
        if global_n:
            self.info.update(global_accuracy=global_acc, global_eval_samples=global_n)
        return out

    def round_info(self) -> dict[str, Any]:
        return dict(self.info)
