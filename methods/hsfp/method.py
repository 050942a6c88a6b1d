"""The H-SFP method entry: config class and lazy factories for each tier's part."""

from __future__ import annotations

from typing import Any

import numpy as np

from methods.hsfp.config import HSFPConfig
from methods.strategy import CloudPart, DevicePart, EdgePart, Method, NodeContext


class HSFP(Method):
    name = "hsfp"
    Config = HSFPConfig

    @classmethod
    def device_part(cls, ctx: NodeContext, data: tuple[np.ndarray, np.ndarray], backend: Any) -> DevicePart:
        if backend == "torch":
            from methods.hsfp.device_torch import HSFPTorchDevice

            return HSFPTorchDevice(ctx, data, backend)
        if backend == "onnx":
            from methods.hsfp.device_onnx import HSFPOnnxDevice

            return HSFPOnnxDevice(ctx, data, backend)
        from methods.hsfp.device import HSFPDevice

        return HSFPDevice(ctx, data, backend)

    @classmethod
    def edge_part(cls, ctx: NodeContext) -> EdgePart:
        from methods.hsfp.edge import HSFPEdge

        return HSFPEdge(ctx)

    @classmethod
    def cloud_part(cls, ctx: NodeContext) -> CloudPart:
        from methods.hsfp.cloud import HSFPCloud

        return HSFPCloud(ctx)
