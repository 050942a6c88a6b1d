"""FedOpt settings: FedAvg's device settings and the server optimiser's (METHODS.md defaults;
the server learning rate is tuned per task in the paper, these are the values used here)."""

from __future__ import annotations

from dataclasses import dataclass

from splitedge.methods.fedavg.config import FedAvgConfig
from splitedge.methods.fedopt.server import SERVER_OPTIMISERS


@dataclass(frozen=True)
class FedOptConfig(FedAvgConfig):
    server_opt: str = "adam"
    server_lr: float = 0.01
    beta1: float = 0.9  # FedAvgM: the server momentum
    beta2: float = 0.99
    tau: float = 1e-3

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.server_opt not in SERVER_OPTIMISERS or not self.server_lr > 0 or not self.tau > 0:
            raise ValueError(f"server_opt must be one of {SERVER_OPTIMISERS}, server_lr and tau > 0, got "
                             f"{self.server_opt!r}, {self.server_lr}, {self.tau}")
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1):
            raise ValueError(f"beta1 and beta2 must be in [0, 1), got {self.beta1} and {self.beta2}")


@dataclass(frozen=True)
class FedAvgMConfig(FedOptConfig):
    """Server momentum (Hsu et al. 2019): lr 1, momentum 0.9."""

    server_opt: str = "avgm"
    server_lr: float = 1.0


@dataclass(frozen=True)
class FedYogiConfig(FedOptConfig):
    server_opt: str = "yogi"
