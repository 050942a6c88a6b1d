"""FedProx entry: FedAvg with a proximal term in the device's objective (one hook overridden)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from splitedge.methods.fedavg.config import FedAvgConfig
from splitedge.methods.fedavg.method import FedAvg


@dataclass(frozen=True)
class FedProxConfig(FedAvgConfig):
    mu: float = 0.01  # the paper's grid: 0.001, 0.01, 0.1, 1

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.mu < 0:
            raise ValueError(f"mu must be >= 0, got {self.mu}")


class FedProx(FedAvg):
    name = "fedprox"
    Config = FedProxConfig
    # the proximal term is trained by torch devices only: FedAvg's thin device would drop it
    parts = {**{k: v for k, v in FedAvg.parts.items() if k != "device:onnx"},
             "device:torch": "splitedge.methods.fedprox.device:FedProxDevice"}

    def objective(self, role: str) -> list[Any]:
        """The device's CE plus (mu/2)||w - w_global||^2 (the `proximal` output of its forward)."""
        from splitedge.methods.training import LossTerm

        terms = super().objective(role)
        if role == "device":
            terms.append(LossTerm("prox", lambda out, b: out["proximal"], self.config.mu / 2, needs=("proximal",)))
        return terms
