"""SCAFFOLD edge: FedAvg's model merge, and the plain mean of its devices' control-variate
changes (each counted as one device, so the cloud's merge of the edges' means is the mean over
every device that reported). numpy only."""

from __future__ import annotations

from typing import Any, Sequence

from splitedge.methods.averaging import averaged_body, weight_updates
from splitedge.methods.checks import check_version, check_weights, weight_specs
from splitedge.methods.contract import Kept, Message, Report, RoundPlan
from splitedge.methods.fedavg.edge import FedAvgEdge
from splitedge.methods.fedavg.method import MODEL
from splitedge.methods.scaffold.method import C, DC, ScaffoldConfig


class ScaffoldEdge(FedAvgEdge[ScaffoldConfig]):
    c_specs: Kept[dict | None] = None  # learnt from the first server control variate relayed

    def check(self, env: Any, source: str) -> None:
        if env.kind == "weights" and env.body["part"] in (C, DC):
            if self.c_specs is not None:
                check_weights(env.body, self.c_specs, source=source)  # DC: already a change, bounded absolutely
            if source == "child":
                check_version(MODEL, int(env.body["version"]), at_most=self.version)
            return
        super().check(env, source)

    def on_message(self, env: Any) -> list[Message]:
        if env.kind == "weights" and env.body["part"] == C:
            self.c_specs = self.c_specs or weight_specs(env.body["weights"])
            return []
        return super().on_message(env)

    def aggregate(self, plan: RoundPlan, reports: Sequence[Report]) -> list[Message]:
        out = super().aggregate(plan, reports)
        changes = weight_updates(reports, DC, plan.version(MODEL))
        if changes:
            out.append(Message("weights", averaged_body(changes, DC, plan.version(MODEL))))  # control changes: exact mean
        return out
