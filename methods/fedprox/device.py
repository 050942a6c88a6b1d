"""FedProx device: FedAvg's, keeping the round's global parameters while it trains so that its
forward can give the proximal distance ||w - w_global||^2 the method's loss term weighs."""

from __future__ import annotations

from typing import Iterator

from splitedge.methods.contract import Message, RoundPlan
from splitedge.methods.fedavg.device import FedAvgDevice
from splitedge.methods.fedprox.method import FedProxConfig
from splitedge.methods.training import Batch, Outputs


class FedProxDevice(FedAvgDevice[FedProxConfig]):
    anchor: list | None = None  # the global parameters of the round being trained (not kept between rounds)

    def run_round(self, plan: RoundPlan) -> Iterator[Message | object]:
        self.anchor = [p.detach().clone() for p in self.model.parameters()]
        try:
            yield from super().run_round(plan)
        finally:
            self.anchor = None

    def forward(self, batch: Batch) -> Outputs:
        out = dict(super().forward(batch))
        out["proximal"] = sum(((p - a) ** 2).sum() for p, a in zip(self.model.parameters(), self.anchor))
        return out
