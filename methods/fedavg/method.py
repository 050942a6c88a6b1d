"""The FedAvg method entry: its config, its parts (imported lazily) and its loss."""

from __future__ import annotations

from typing import Any

from splitedge.methods.fedavg.config import FedAvgConfig
from splitedge.methods.contract import Method

MODEL = "model"
"""The one model FedAvg versions and averages (the whole network)."""


class FedAvg(Method):
    name = "fedavg"
    Config = FedAvgConfig
    runs_on_cuda = True  # FedProx, SCAFFOLD and FedOpt too: their parts build on FedAvg's
    parts = {
        "device:torch": "splitedge.methods.fedavg.device:FedAvgDevice",
        "device:onnx": "splitedge.methods.fedavg.device_thin:FedAvgThinDevice",
        "edge": "splitedge.methods.fedavg.edge:FedAvgEdge",
        "cloud": "splitedge.methods.fedavg.cloud:FedAvgCloud",
    }

    def objective(self, role: str) -> list[Any]:
        from splitedge.methods.training import cross_entropy_term

        return [cross_entropy_term()]
