"""FedProto settings (METHODS.md: lambda = 1); they travel, typed, in the round announcement."""

from __future__ import annotations

from dataclasses import dataclass

from splitedge.methods.config import MethodConfig, flag


@dataclass(frozen=True)
class FedProtoConfig(MethodConfig):
    local_epochs: int = flag(1, "local epochs per round on a device")
    device_batch: int = 32
    device_lr: float = 0.05
    momentum: float = 0.9
    weight_decay: float = 5e-4
    # local loss: CE + proto_lambda * ||f(x) - proto_y||^2, "mse" divides by the feature dim D
    # like the official code; "sq_l2" is the literal METHODS.md sum (see loss.py for why not default)
    proto_lambda: float = 1.0
    proto_distance: str = "mse"
    # share of each device's data held out to measure its personalised accuracy
    holdout: float = 0.2
    # dtype of the device prototypes on the wire (edges forward float64 so the cloud's mean is exact)
    proto_dtype: str = "f4"
    # the prototypes' dimension (the representation's): the cloud sets it from the model before
    # round 1 (FedProto.settle), so numpy-only edges refuse another one from the first message on
    dim: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.proto_dtype not in ("f2", "f4", "f8"):
            raise ValueError(f"proto_dtype must be f2, f4 or f8, got {self.proto_dtype!r}")
        if self.proto_distance not in ("mse", "sq_l2"):
            raise ValueError(f"proto_distance must be mse or sq_l2, got {self.proto_distance!r}")
        if not 0.0 < self.holdout < 1.0:
            raise ValueError(f"holdout must be in (0, 1), got {self.holdout}")
        if self.local_epochs < 1 or self.device_batch < 2 or self.proto_lambda < 0:
            raise ValueError(f"bad FedProto config: {self}")
