"""The FedProto method entry: its config class and where each tier's part lives (imported lazily)."""

from __future__ import annotations

from splitedge.methods.fedproto.config import FedProtoConfig
from splitedge.methods.strategy import Method


class FedProto(Method):
    name = "fedproto"
    Config = FedProtoConfig
    personalised = True
    parts = {
        "device:torch": "splitedge.methods.fedproto.device:FedProtoDevice",
        "edge": "splitedge.methods.fedproto.edge:FedProtoEdge",
        "cloud": "splitedge.methods.fedproto.cloud:FedProtoCloud",
    }
