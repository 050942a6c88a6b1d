"""The FedAvg method entry: config class and lazy factories (torch is imported only by the parts)."""

from __future__ import annotations

from typing import Any

import numpy as np

from methods.fedavg.config import FedAvgConfig
from methods.strategy import CloudPart, DevicePart, EdgePart, Method, NodeContext


class FedAvg(Method):
    name = "fedavg"
    Config = FedAvgConfig

    @classmethod
    def device_part(cls, ctx: NodeContext, data: tuple[np.ndarray, np.ndarray], backend: Any) -> DevicePart:
        if backend != "torch":
            raise ValueError(f"fedavg trains the full model on the device and needs the torch backend, got {backend!r}")
        from methods.fedavg.device import FedAvgDevice

        return FedAvgDevice(ctx, data, backend)

    @classmethod
    def edge_part(cls, ctx: NodeContext) -> EdgePart:
        from methods.fedavg.edge import FedAvgEdge

        return FedAvgEdge(ctx)

    @classmethod
    def cloud_part(cls, ctx: NodeContext) -> CloudPart:
        from methods.fedavg.cloud import FedAvgCloud

        return FedAvgCloud(ctx)
