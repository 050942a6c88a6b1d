"""FedAvg settings (they travel, typed, in the round announcement).

Device optimiser settings match the H-SFP device (SGD 0.05, momentum 0.9, wd 5e-4) so the
baselines differ in what crosses the wire, not in how hard the device trains.
"""

from __future__ import annotations

from dataclasses import dataclass

from splitedge.methods.config import MethodConfig, flag


@dataclass(frozen=True)
class FedAvgConfig(MethodConfig):
    # 0: devices train nothing and send the model back as they got it, so it stays as initialised:
    # with calibrate=lda the bench's lower bound (a random network with the calibrated head)
    local_epochs: int = flag(1, "local epochs per round on a device")
    device_lr: float = 0.05
    momentum: float = 0.9
    weight_decay: float = 5e-4
    device_batch: int = 32

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.local_epochs < 0 or self.device_batch < 2 or self.device_lr <= 0:
            raise ValueError(f"bad FedAvg config: {self}")
