"""Settings of the self-supervised methods (they travel, typed, in the round announcement)."""

from __future__ import annotations

from dataclasses import dataclass

from splitedge.methods.fedavg.config import FedAvgConfig


@dataclass(frozen=True)
class SSLConfig(FedAvgConfig):
    """FedAvg's device settings (local_epochs, device_lr, momentum, weight_decay), larger batches
    (more pairs for the contrastive terms), and the views, projector and report."""

    device_batch: int = 64
    crop_scale_min: float = 0.2  # random resized crop keeps 20..100 % of the area
    # projector (and SimSiam's predictor): hidden width = proj_hidden x the encoder's dimension
    proj_hidden: int = 4
    # align-uniform: L = align + beta * (unif(z1) + unif(z2)) / 2
    beta: float = 1.0
    probe_epochs: int = 100
    knn_k: int = 20
    # the encoder: "split" (the run's split model up to its classifier) or "vit" (the small ViT
    # of models/vit_mae.py, the masked-modelling methods' encoder, for a like-for-like baseline)
    encoder: str = "split"
    patch: int = 4
    vit_dim: int = 128
    vit_depth: int = 4
    vit_heads: int = 4
    # the device optimiser: "sgd" (momentum, weight_decay) or "adamw" (ViTs need it)
    optimizer: str = "sgd"

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 < self.crop_scale_min <= 1 or self.proj_hidden < 1 or self.beta < 0:
            raise ValueError(f"bad self-supervised config: {self}")
        if self.encoder not in ("split", "vit") or self.optimizer not in ("sgd", "adamw"):
            raise ValueError(f"encoder must be split or vit (got {self.encoder!r}), "
                             f"optimizer sgd or adamw (got {self.optimizer!r})")
        if self.patch < 1 or self.vit_dim % 4 or self.vit_dim % self.vit_heads:
            raise ValueError(f"bad ViT settings: patch {self.patch}, vit_dim {self.vit_dim} "
                             f"(a multiple of 4 and of vit_heads {self.vit_heads})")


@dataclass(frozen=True)
class SSDConfig(SSLConfig):
    """SSD (METHODS.md): align-uniform + gamma * DSR + delta * PD; `dsr`/`pd` off for the ablation."""

    dsr: bool = True
    pd: bool = True
    gamma: float = 1.0
    delta: float = 0.1
    alpha: float = 10.0  # scale of a device's own directions in DSR
    pd_tau: float = 0.5
    form: str = "code"  # DSR and PD as the authors' code has them, or "paper" (methods/ssl/losses.py)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.alpha <= 0 or self.gamma < 0 or self.delta < 0 or self.pd_tau <= 0:
            raise ValueError(f"bad SSD config: {self}")
        if self.form not in ("code", "paper"):
            raise ValueError(f"SSD's form must be 'code' or 'paper', got {self.form!r}")
