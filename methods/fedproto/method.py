"""The FedProto method entry: its config class and where each tier's part lives (imported lazily)."""

from __future__ import annotations

from methods.fedproto.config import FedProtoConfig
from methods.strategy import Method


class FedProto(Method):
    name = "fedproto"
    Config = FedProtoConfig
    personalised = True
    parts = {
        "device:torch": "methods.fedproto.device:FedProtoDevice",
        "edge": "methods.fedproto.edge:FedProtoEdge",
        "cloud": "methods.fedproto.cloud:FedProtoCloud",
    }
