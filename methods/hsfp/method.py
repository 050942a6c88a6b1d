"""The H-SFP method entry: its config class and where each tier's part lives (imported lazily)."""

from __future__ import annotations

from splitedge.methods.hsfp.config import HSFPConfig
from splitedge.methods.strategy import Method


class HSFP(Method):
    name = "hsfp"
    Config = HSFPConfig
    parts = {
        "device:torch": "splitedge.methods.hsfp.device_torch:HSFPTorchDevice",
        "device:onnx": "splitedge.methods.hsfp.device_onnx:HSFPOnnxDevice",
        "device": "splitedge.methods.hsfp.device:HSFPDevice",
        "edge": "splitedge.methods.hsfp.edge:HSFPEdge",
        "cloud": "splitedge.methods.hsfp.cloud:HSFPCloud",
    }
