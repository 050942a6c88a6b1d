"""FedAvg whose devices minimise label-smoothed cross-entropy (Szegedy et al. 2016).

A plug-in method is a `Method` subclass: its typed settings (a `MethodConfig` dataclass; a
field declared with `flag` gets its own command-line flag, here `--label-smoothing`), the parts
each tier runs (import paths, imported only on the tier that runs them) and its hooks. This
one reuses FedAvg's parts and changes one hook, the devices' objective. Its devices train in
torch only: the numpy trainer of a thin device knows FedAvg's plain cross-entropy, so the
method lists no `device:onnx` part, and a sim or a device asked to run it on onnx says so
before round 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from splitedge.methods.config import flag
from splitedge.methods.fedavg.config import FedAvgConfig
from splitedge.methods.fedavg.method import FedAvg


@dataclass(frozen=True)
class LabelSmoothingConfig(FedAvgConfig):
    label_smoothing: float = flag(0.1, "share of each label's probability spread evenly over the classes")

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 <= self.label_smoothing < 1:
            raise ValueError(f"label_smoothing must be in [0, 1), got {self.label_smoothing}")


class FedAvgLabelSmoothing(FedAvg):
    name = "fedavg-ls"
    Config = LabelSmoothingConfig
    parts = {role: path for role, path in FedAvg.parts.items() if role != "device:onnx"}

    def objective(self, role: str) -> list[Any]:
        import torch.nn.functional as F

        from splitedge.methods.training import LossTerm

        smoothing = self.config.label_smoothing
        return [LossTerm("ce", lambda out, b: F.cross_entropy(out["logits"], b.y, label_smoothing=smoothing),
                         1.0, ("logits",))]
