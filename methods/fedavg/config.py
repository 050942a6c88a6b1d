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
    # the uplink (methods/update_codec.py): "none" sends the trained model whole; "int8" its
    # update as int8 with a scale per tensor, "topk" the update_topk share of its entries largest
    # in magnitude; both keep what they leave out and add it to the next update (error feedback)
    update_codec: str = flag("none", "how a device's update travels up: none (the model whole), int8 (4x fewer bytes) "
                                     "or topk (update_topk of its entries), with error feedback",
                             choices=("none", "int8", "topk"))
    update_topk: float = 0.01

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.local_epochs < 0 or self.device_batch < 2 or self.device_lr <= 0:
            raise ValueError(f"bad FedAvg config: {self}")
        if self.update_codec not in ("none", "int8", "topk") or not 0 < self.update_topk <= 1:
            raise ValueError(f"update_codec must be none, int8 or topk and update_topk in (0, 1], got "
                             f"{self.update_codec!r} and {self.update_topk}")
        if self.update_codec != "none" and self.secagg != "off":
            raise ValueError(f"update_codec={self.update_codec} with secagg: a secure sum adds whole vectors; leave "
                             f"update_codec at none under secagg")
