"""The FedProto method entry: its config, its parts (imported lazily) and its loss terms."""

from __future__ import annotations

from typing import Any

from splitedge.methods.fedproto.config import FedProtoConfig
from splitedge.methods.contract import Method


class FedProto(Method):
    name = "fedproto"
    Config = FedProtoConfig
    personalised = True
    exportable = False  # its checkpoint is the prototype table: there is no global model
    parts = {
        "device:torch": "splitedge.methods.fedproto.device:FedProtoDevice",
        "edge": "splitedge.methods.fedproto.edge:FedProtoEdge",
        "cloud": "splitedge.methods.fedproto.cloud:FedProtoCloud",
    }

    def settle(self) -> dict[str, Any]:
        """The representation's dimension, from the model (the cloud has torch; edges need not)."""
        import torch

        from splitedge.methods.fedproto.loss import representation
        from splitedge.methods.torch_utils import build_split

        super().settle()
        x = torch.zeros(2, self.spec.channels, self.spec.image_size, self.spec.image_size)
        return {"dim": int(representation(build_split(self.spec).eval(), x)[0].shape[1])}

    def objective(self, role: str) -> list[Any]:
        """CE + proto_lambda * distance of f(x) to its class's global prototype (METHODS.md)."""
        from splitedge.methods.fedproto.loss import proto_distance
        from splitedge.methods.training import LossTerm, cross_entropy_term

        cfg = self.config

        def distance(out: Any, b: Any) -> Any:
            return proto_distance(out["features"], b.y, b.extra["protos"], b.extra["has_proto"], cfg.proto_distance)

        return [cross_entropy_term(), LossTerm("proto", distance, cfg.proto_lambda, ("features",))]
