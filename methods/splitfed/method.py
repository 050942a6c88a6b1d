"""The SplitFed method entry: config class and lazy factories (torch is imported only by the parts)."""

from __future__ import annotations

from typing import Any

import numpy as np

from methods.splitfed.config import SplitFedConfig
from methods.strategy import CloudPart, DevicePart, EdgePart, Method, NodeContext


class SplitFed(Method):
    name = "splitfed"
    Config = SplitFedConfig

    @classmethod
    def device_part(cls, ctx: NodeContext, data: tuple[np.ndarray, np.ndarray], backend: Any) -> DevicePart:
        if backend != "torch":
            raise ValueError(f"splitfed backpropagates into W_c on the device and needs torch, got {backend!r}")
        from methods.splitfed.device import SplitFedDevice

        return SplitFedDevice(ctx, data, backend)

    @classmethod
    def edge_part(cls, ctx: NodeContext) -> EdgePart:
        from methods.splitfed.edge import SplitFedEdge

        return SplitFedEdge(ctx)

    @classmethod
    def cloud_part(cls, ctx: NodeContext) -> CloudPart:
        from methods.splitfed.cloud import SplitFedCloud

        return SplitFedCloud(ctx)
