"""SplitFed (SFLv1) settings (they travel, typed, in the round announcement).

Device optimiser settings match FedAvg and the H-SFP device; the edge trains its server-side
copies with the same SGD so the split changes where the computation runs, not the optimiser.
"""

from __future__ import annotations

from dataclasses import dataclass

from splitedge.methods.config import MethodConfig, flag


@dataclass(frozen=True)
class SplitFedConfig(MethodConfig):
    local_epochs: int = flag(1, "local epochs per round on a device")
    device_batch: int = 32
    device_lr: float = 0.05
    edge_lr: float = 0.05
    momentum: float = 0.9
    weight_decay: float = 5e-4
    # wire: dtype of the W_c activations sent up (gradients are always f4 by the protocol)
    feature_dtype: str = "f4"
    # SFLv1: one server-side W_e+W_g copy per device, averaged at round end ("per-device");
    # "shared" trains one copy per edge on every device's batches in arrival order.
    server_model: str = "per-device"
    # how long a device waits for the gradients of one batch before the round fails
    reply_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.feature_dtype not in ("f2", "f4"):
            raise ValueError(f"feature_dtype must be f2 or f4, got {self.feature_dtype!r}")
        if self.server_model not in ("per-device", "shared"):
            raise ValueError(f"server_model must be per-device or shared, got {self.server_model!r}")
        if self.local_epochs < 1 or self.device_batch < 2 or self.reply_timeout_s <= 0:
            raise ValueError(f"bad SplitFed config: {self}")
