"""A fixed simplex-ETF classifier: a target every device shares for W_c (issue 12, item 4).

With SupCon and a private projection head, each device pulls its W_c towards its own target,
and averaging such W_c copies mixes features laid out differently. A simplex equiangular tight
frame (K unit vectors at equal, maximal angles; the layout neural collapse converges to) built
from the run's seed is the same on every device and never trains, so each device's W_c learns
to place its classes at the same fixed points and the averages agree (FedETF, Li et al. 2023).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from splitedge.methods.simplex import simplex_etf


class EtfHead(nn.Module):
    """Cosine logits against the fixed ETF, scaled by 1/tau: normalised features -> [B, K]."""

    def __init__(self, dim: int, classes: int, seed: int, tau: float) -> None:
        super().__init__()
        self.register_buffer("etf", torch.from_numpy(simplex_etf(dim, classes, seed).astype(np.float32)))
        self.tau = float(tau)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return F.normalize(features, dim=1) @ self.etf.T / self.tau
