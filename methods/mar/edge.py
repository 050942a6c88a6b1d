"""FedMAR / DecMAR edges. numpy only.

FedMAR: FedAvg's edge, plus it forwards its devices' mean latents up as one `latents` record
(the cloud's z_bar is their unweighted mean, so the edge must not pre-average them).
DecMAR: devices average among themselves over peer topics; the edge only merges the models
they send up on the rounds the cloud evaluates (directive `upload`).
"""

from __future__ import annotations

from typing import Any, Sequence

from splitedge.methods.averaging import averaged_body, weight_updates
from splitedge.methods.checks import check_vector, check_weights
from splitedge.methods.fedavg.edge import FedAvgEdge
from splitedge.methods.mar.method import LATENT, LATENTS, MODEL, UPLOAD
from splitedge.methods.contract import Kept, Message, Report, RoundPlan
from splitedge.methods.mar.config import DecMARConfig, MARConfig
from splitedge.protocol.done import dones


class MAREdge(FedAvgEdge[MARConfig]):
    latent_dim: Kept[int | None] = None  # from the first latent record seen

    def check(self, env: Any, source: str) -> None:
        super().check(env, source)
        if env.kind == "arrays" and env.body["name"] == LATENT:
            self.latent_dim = check_vector(env.body["arrays"].get("z"), self.latent_dim, f"a {LATENT} record's z")

    def aggregate(self, plan: RoundPlan, reports: Sequence[Report]) -> list[Message]:
        out = super().aggregate(plan, reports)
        latents = {r.sender: e.body["arrays"]["z"] for r in reports for e in r.all("arrays")
                   if e.body["name"] == LATENT}
        if latents:
            out.append(Message("arrays", {"name": LATENTS, "version": plan.round, "arrays": latents}))
        return out


class DecMAREdge(FedAvgEdge[DecMARConfig]):
    """Learns the model's shapes from the initial model it relays (FedAvgEdge.on_message).
    `heard` is the round's, read by round_info as it ends: FedAvgEdge's state is all it keeps."""

    def check(self, env: Any, source: str) -> None:
        if env.kind == "weights" and self.specs is not None:
            check_weights(env.body, self.specs, part=MODEL, source=source)  # devices version by round: no reference

    def aggregate(self, plan: RoundPlan, reports: Sequence[Report]) -> list[Message]:
        self.heard = {d: int(i.method["neighbours_heard"]) for d, i in dones(reports).items()
                      if "neighbours_heard" in i.method}
        parts = weight_updates(reports, MODEL, plan.round) if plan.directives.get(UPLOAD) else []
        return [Message("weights", averaged_body(parts, MODEL, plan.round, self.method.merge_weights))] if parts else []

    def round_info(self) -> dict[str, Any]:
        """How many neighbours each of its devices heard this round (the cloud reports them)."""
        return {"neighbours_heard": dict(getattr(self, "heard", {}))}
