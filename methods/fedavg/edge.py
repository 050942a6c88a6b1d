"""FedAvg edge: the method's merge (a sample-weighted average by default) of its devices' models.

numpy only (no torch): an edge that only averages needs no network definition. It learns the
model's parameter names and shapes from the global model the runtime relays to its devices,
and refuses device updates that do not fit them.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence, TypeVar

from splitedge.methods.averaging import GlobalModels, averaged_body, weight_updates
from splitedge.methods.checks import check_version, check_weights, weight_specs
from splitedge.methods.fedavg.method import MODEL
from splitedge.methods.contract import EdgeContext, EdgePart, Kept, Message, Report, RoundPlan
from splitedge.methods.fedavg.config import FedAvgConfig

log = logging.getLogger(__name__)


ConfigT = TypeVar("ConfigT", bound=FedAvgConfig)


class FedAvgEdge(EdgePart[ConfigT]):
    specs: Kept[dict | None]  # learnt from the first global model relayed, not known at build
    version: Kept[int]

    def __init__(self, ctx: EdgeContext) -> None:
        super().__init__(ctx)
        self.specs = None  # from the first global model seen
        self.version = 0
        self.models = GlobalModels()  # the global model relayed: what the devices' updates train from

    def check(self, env: Any, source: str) -> None:
        if env.kind != "weights":
            return
        if self.specs is not None:
            check_weights(env.body, self.specs, part=MODEL, source=source, trained_from=self.models.of(env.body))
        if source == "child":  # an update trains from a global version the edge has relayed
            check_version(MODEL, int(env.body["version"]), at_most=self.version)

    def update_reference(self, body: Any) -> Any:
        """The global model a compressed update was trained from (None: not held; it is refused)."""
        return self.models.of(body)

    def on_message(self, env: Any) -> list[Message]:
        if env.kind == "weights" and env.body["part"] == MODEL:
            self.specs = self.specs or weight_specs(env.body["weights"])
            self.version = max(self.version, int(env.body["version"]))
            self.models.note(MODEL, int(env.body["version"]), env.body["weights"])
        return []

    def aggregate(self, plan: RoundPlan, reports: Sequence[Report]) -> list[Message]:
        parts = weight_updates(reports, MODEL, plan.version(MODEL))
        if not parts:
            log.warning("edge %s: round %d without model updates", self.ctx.node_id, plan.round)
            return []
        version = plan.version(MODEL)
        return [Message("weights", averaged_body(parts, MODEL, version, self.method.merge_weights,
                                                 self.models.trained_from(MODEL, version)))]
