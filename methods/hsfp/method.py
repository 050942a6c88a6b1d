"""The H-SFP method entry: its config class and where each tier's part lives (imported lazily)."""

from __future__ import annotations

from methods.hsfp.config import HSFPConfig
from methods.strategy import Method


class HSFP(Method):
    name = "hsfp"
    Config = HSFPConfig
    parts = {
        "device:torch": "methods.hsfp.device_torch:HSFPTorchDevice",
        "device:onnx": "methods.hsfp.device_onnx:HSFPOnnxDevice",
        "device": "methods.hsfp.device:HSFPDevice",
        "edge": "methods.hsfp.edge:HSFPEdge",
        "cloud": "methods.hsfp.cloud:HSFPCloud",
    }
