"""The SCAFFOLD entry: its config, parts (FedAvg's, extended) and the corrected device objective."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from splitedge.methods.fedavg.config import FedAvgConfig
from splitedge.methods.fedavg.method import FedAvg

C, DC = "c", "dc"
"""Weights parts: the server's control variate c (cloud -> devices, versioned with the model) and
a device's change of its own, dc = c_i+ - c_i (device -> edge -> cloud)."""


@dataclass(frozen=True)
class ScaffoldConfig(FedAvgConfig):
    server_lr: float = 1.0  # lr_g: x <- x + lr_g mean(dy)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.server_lr > 0:
            raise ValueError(f"server_lr must be > 0, got {self.server_lr}")


class Scaffold(FedAvg):
    name = "scaffold"
    Config = ScaffoldConfig
    parts = {
        "device:torch": "splitedge.methods.scaffold.device:ScaffoldDevice",
        "edge": "splitedge.methods.scaffold.edge:ScaffoldEdge",
        "cloud": "splitedge.methods.scaffold.cloud:ScaffoldCloud",
    }

    def objective(self, role: str) -> list[Any]:
        """CE plus <w, c - c_i>: its gradient is the control-variate correction, so each local
        step is y <- y - lr (g(y) - c_i + c) through the shared loop and optimiser."""
        from splitedge.methods.training import LossTerm

        terms = super().objective(role)
        if role == "device":
            terms.append(LossTerm("scaffold", lambda out, b: out["correction"], needs=("correction",)))
        return terms
