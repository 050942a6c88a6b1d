"""FedOpt entries: FedAvg's device and edge, a cloud that steps a server optimiser."""

from __future__ import annotations

from splitedge.methods.fedavg.method import FedAvg
from splitedge.methods.fedopt.config import FedAvgMConfig, FedOptConfig, FedYogiConfig


class FedAdam(FedAvg):
    name = "fedadam"
    Config = FedOptConfig
    parts = {**FedAvg.parts, "cloud": "splitedge.methods.fedopt.cloud:FedOptCloud"}


class FedAvgM(FedAdam):
    name = "fedavgm"
    Config = FedAvgMConfig


class FedYogi(FedAdam):
    name = "fedyogi"
    Config = FedYogiConfig
