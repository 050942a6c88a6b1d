"""FedMAR / DecMAR settings (they travel, typed, in the round announcement)."""

from __future__ import annotations

from dataclasses import dataclass

from splitedge.methods.ssl.config import SSLConfig


@dataclass(frozen=True)
class MARConfig(SSLConfig):
    """The self-supervised device and report settings, the small ViT MAE, and the MAR term.
    Devices train the ViT with AdamW (`device_lr`, `weight_decay`); SGD does not train it."""

    device_lr: float = 1e-3
    weight_decay: float = 0.05
    optimizer: str = "adamw"
    encoder: str = "vit"

    # the masked autoencoder (models/vit_mae.py): the ViT encoder's settings (patch 4, width
    # 128, depth 4, 4 heads) are SSLConfig's; 75 % of the patches masked, a light decoder
    mask_ratio: float = 0.75
    decoder_dim: int = 64
    decoder_depth: int = 2
    # MAR: + gamma_k * A-MMD(z, z_bar), gamma_k from g_max to g_min over `gamma_cap` participations
    mar: bool = True  # False: plain MAE
    g_min: float = 1e-3
    g_max: float = 0.1
    gamma_cap: int = 10
    ammd: str = "ours"  # "paper": the paper's kernel and bandwidth against the participants' latents (losses.py)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 < self.mask_ratio < 1 or self.encoder != "vit":
            raise ValueError(f"bad MAE settings: mask_ratio {self.mask_ratio} (in (0, 1)), encoder {self.encoder!r} "
                             "(the masked autoencoder is a ViT)")
        if not 0 <= self.g_min <= self.g_max or self.gamma_cap < 1:
            raise ValueError("need 0 <= g_min <= g_max and gamma_cap >= 1")
        if self.ammd not in ("ours", "paper"):
            raise ValueError(f"ammd must be 'ours' or 'paper', got {self.ammd!r}")


@dataclass(frozen=True)
class DecMARConfig(MARConfig):
    """DecMAR: devices on a connected Erdos-Renyi graph (or a ring), no aggregator."""

    degree: float = 4.0  # the graph's mean degree
    graph: str = "er"  # or "ring"
    gather_timeout_s: float = 60.0  # a round waits this long for a neighbour, then goes on without it

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.graph not in ("er", "ring") or self.degree <= 0 or self.gather_timeout_s <= 0:
            raise ValueError(f"bad DecMAR settings: graph {self.graph!r}, degree {self.degree}")
