"""The SplitFed method entry: config, parts (imported lazily), its kinds and its losses."""

from __future__ import annotations

from typing import Any

from splitedge.methods.splitfed import kinds as _kinds  # noqa: F401 - registers activations/gradients
from splitedge.methods.splitfed.config import SplitFedConfig
from splitedge.methods.contract import Method

MODEL = "model"
"""One version for W_c, W_e and W_g: SFLv1 averages all three every round."""


class SplitFed(Method):
    name = "splitfed"
    Config = SplitFedConfig
    parts = {
        "device:torch": "splitedge.methods.splitfed.device:SplitFedDevice",
        "device:onnx": "splitedge.methods.splitfed.device_thin:SplitFedThinDevice",
        "edge": "splitedge.methods.splitfed.edge:SplitFedEdge",
        "cloud": "splitedge.methods.splitfed.cloud:SplitFedCloud",
    }

    def objective(self, role: str) -> list[Any]:
        """The server side (edge) minimises CE; the device only back-propagates the gradient the
        edge returned: d/d(act) of sum(act * grad) is grad, so the shared loop takes that step."""
        from splitedge.methods.training import LossTerm, cross_entropy_term

        if role == "device":
            return [LossTerm("split", lambda out, b: (out["activations"] * out["grad"]).sum(),
                             needs=("activations", "grad"))]
        return [cross_entropy_term()]

    def regularisers(self, role: str) -> list[Any]:
        """The representation is trained where the loss is: at the edge's server side."""
        return super().regularisers(role) if role == "edge" else []
