"""The SplitFed method entry: its config class and where each tier's part lives (imported lazily)."""

from __future__ import annotations

from methods.splitfed.config import SplitFedConfig
from methods.strategy import Method


class SplitFed(Method):
    name = "splitfed"
    Config = SplitFedConfig
    parts = {
        "device:torch": "methods.splitfed.device:SplitFedDevice",
        "edge": "methods.splitfed.edge:SplitFedEdge",
        "cloud": "methods.splitfed.cloud:SplitFedCloud",
    }
