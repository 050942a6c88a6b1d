"""The FedAvg method entry: its config class and where each tier's part lives (imported lazily)."""

from __future__ import annotations

from splitedge.methods.fedavg.config import FedAvgConfig
from splitedge.methods.strategy import Method


class FedAvg(Method):
    name = "fedavg"
    Config = FedAvgConfig
    parts = {
        "device:torch": "splitedge.methods.fedavg.device:FedAvgDevice",
        "edge": "splitedge.methods.fedavg.edge:FedAvgEdge",
        "cloud": "splitedge.methods.fedavg.cloud:FedAvgCloud",
    }
