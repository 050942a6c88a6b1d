"""The FedAvg method entry: its config class and where each tier's part lives (imported lazily)."""

from __future__ import annotations

from methods.fedavg.config import FedAvgConfig
from methods.strategy import Method


class FedAvg(Method):
    name = "fedavg"
    Config = FedAvgConfig
    parts = {
        "device:torch": "methods.fedavg.device:FedAvgDevice",
        "edge": "methods.fedavg.edge:FedAvgEdge",
        "cloud": "methods.fedavg.cloud:FedAvgCloud",
    }
