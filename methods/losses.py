"""Representation losses (METHODS.md): SupCon / NT-Xent and the FedDecorr regulariser."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def _instance_labels(n: int, views: int, device: torch.device) -> torch.Tensor:
    """NT-Xent labels: features stacked view-major ([view0; view1; ...]), so sample i of
    every view shares the label i and the positives of an anchor are its other views."""
    if views < 2 or n % views:
        raise ValueError(f"without labels, N={n} must be a multiple of views={views} >= 2")
    return torch.arange(n // views, device=device).repeat(views)


def supcon_loss(features: torch.Tensor, labels: torch.Tensor | None = None,
                tau: float = 0.5, *, views: int = 2) -> torch.Tensor:
    """Supervised contrastive loss (Khosla et al. 2020, L_out), base_tau = tau.

    features [N, D] (any scale: rows are L2-normalised here); labels [N]. For two augmented
    views pass `torch.cat([z1, z2])` and `labels.repeat(2)`. With labels=None this is
    NT-Xent: features must be `views` stacked view-major blocks of equal size.
    logits_ij = z_i.z_j / tau with j != i; loss_i = -mean_{p in P(i)} log softmax_i(p).
    Anchors with no positive are excluded; if none has one the loss is 0 (with grad).
    """
    if features.dim() != 2:
        raise ValueError(f"features must be [N, D], got {tuple(features.shape)}")
    n = features.shape[0]
    if labels is None:
        labels = _instance_labels(n, views, features.device)
    if labels.shape != (n,):
        raise ValueError(f"labels must be [{n}], got {tuple(labels.shape)}")
    if tau <= 0:
        raise ValueError(f"tau must be > 0, got {tau}")
    z = F.normalize(features, dim=1)
    logits = z @ z.T / tau
    self_mask = torch.eye(n, dtype=torch.bool, device=features.device)
    log_norm = torch.logsumexp(logits.masked_fill(self_mask, float("-inf")), dim=1, keepdim=True)
    pos = (labels[:, None] == labels[None, :]) & ~self_mask
    n_pos = pos.sum(dim=1)
    valid = n_pos > 0
    if not bool(valid.any()):
        return features.sum() * 0.0
    # where() (not multiply) keeps unused entries out of the sum even if they were inf.
    pos_log_prob = torch.where(pos, logits - log_norm, torch.zeros_like(logits)).sum(dim=1)
    loss = -pos_log_prob[valid] / n_pos[valid]
    return loss.mean()


def feddecorr_loss(x: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """FedDecorr (Shi et al. 2023): mean squared off-diagonal correlation, divided by N.

    x [N, C] pooled features. Columns are z-scored (unbiased var + eps), K = x^T x, the loss
    is mean(offdiag(K)^2) / N, the official code's scaling so beta stays comparable.
    """
    if x.dim() != 2:
        raise ValueError(f"x must be [N, C], got {tuple(x.shape)}")
    n, c = x.shape
    if n == 1 or c < 2:
        return x.sum() * 0.0
    x = x - x.mean(dim=0, keepdim=True)
    x = x / torch.sqrt(eps + x.var(dim=0, keepdim=True))
    k = x.T @ x
    off_diag = k[~torch.eye(c, dtype=torch.bool, device=x.device)]
    return off_diag.pow(2).mean() / n
