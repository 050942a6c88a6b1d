"""The FedProto method entry: config class and lazy factories (torch is imported only by the device)."""

from __future__ import annotations

from typing import Any

import numpy as np

from methods.fedproto.config import FedProtoConfig
from methods.strategy import CloudPart, DevicePart, EdgePart, Method, NodeContext


class FedProto(Method):
    name = "fedproto"
    Config = FedProtoConfig

    @classmethod
    def device_part(cls, ctx: NodeContext, data: tuple[np.ndarray, np.ndarray], backend: Any) -> DevicePart:
        if backend != "torch":
            raise ValueError(f"fedproto trains the local model on the device and needs torch, got {backend!r}")
        from methods.fedproto.device import FedProtoDevice

        return FedProtoDevice(ctx, data, backend)

    @classmethod
    def edge_part(cls, ctx: NodeContext) -> EdgePart:
        from methods.fedproto.edge import FedProtoEdge

        return FedProtoEdge(ctx)

    @classmethod
    def cloud_part(cls, ctx: NodeContext) -> CloudPart:
        from methods.fedproto.cloud import FedProtoCloud

        return FedProtoCloud(ctx)
