"""The SplitFed method entry: its config class and where each tier's part lives (imported lazily)."""

from __future__ import annotations

from splitedge.methods.splitfed.config import SplitFedConfig
from splitedge.methods.strategy import Method


class SplitFed(Method):
    name = "splitfed"
    Config = SplitFedConfig
    parts = {
        "device:torch": "splitedge.methods.splitfed.device:SplitFedDevice",
        "edge": "splitedge.methods.splitfed.edge:SplitFedEdge",
        "cloud": "splitedge.methods.splitfed.cloud:SplitFedCloud",
    }
