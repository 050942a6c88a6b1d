"""Self-supervised losses (METHODS.md "SSD", "Shared pieces/Metrics"): SimSiam, alignment,
uniformity, SSD's dimension-scaling regulariser (DSR) and projection distillation (PD).

All take batches of row vectors [N, D] and return a scalar. Where a formula has a stop-gradient
it is a `.detach()` here, so callers can rely on no gradient reaching that input. The DSR
targets (Q, d) are drawn torch-free by `methods.ssd_scales.dsr_scales`.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def _check_rows(name: str, x: torch.Tensor) -> None:
    if x.dim() != 2:
        raise ValueError(f"{name} must be [N, D], got {tuple(x.shape)}")


def _check_pair(a_name: str, a: torch.Tensor, b_name: str, b: torch.Tensor) -> None:
    _check_rows(a_name, a)
    if a.shape != b.shape:
        raise ValueError(f"{a_name} and {b_name} must have the same shape, "
                         f"got {tuple(a.shape)} and {tuple(b.shape)}")


def _neg_cosine(p: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """SimSiam's D(p, z) = -mean_i cos(p_i, stopgrad(z_i))."""
    return -F.cosine_similarity(p, z.detach(), dim=1).mean()


def simsiam_loss(p1: torch.Tensor, p2: torch.Tensor,
                 z1: torch.Tensor, z2: torch.Tensor) -> torch.Tensor:
    """SimSiam (Chen & He 2021): D(p1, stopgrad(z2))/2 + D(p2, stopgrad(z1))/2.

    p = predictor outputs, z = projector outputs of the two views, all [N, D];
    D(p, z) = -mean_i cos(p_i, z_i). The stop-gradient on z is what keeps SimSiam from
    collapsing, so no gradient reaches z1 or z2 through this loss. Range [-1, 1].
    """
    for name, t in (("p2", p2), ("z1", z1), ("z2", z2)):
        _check_pair("p1", p1, name, t)
    return _neg_cosine(p1, z2) / 2 + _neg_cosine(p2, z1) / 2


def align_loss(z1: torch.Tensor, z2: torch.Tensor, alpha: float = 2.0) -> torch.Tensor:
    """Alignment (Wang & Isola 2020): mean_i ||zh1_i - zh2_i||_2^alpha, zh = rows L2-normalised.

    Rows are normalised here because the loss is defined on the unit sphere; with alpha = 2
    this is the METHODS.md metric (mean squared distance of positive pairs, in [0, 4]).
    """
    _check_pair("z1", z1, "z2", z2)
    if not alpha > 0:
        raise ValueError(f"alpha must be > 0, got {alpha}")
    diff = F.normalize(z1, dim=1) - F.normalize(z2, dim=1)
    return torch.linalg.vector_norm(diff, dim=1).pow(alpha).mean()


def uniformity_loss(z: torch.Tensor, t: float = 2.0) -> torch.Tensor:
    """Uniformity (Wang & Isola 2020): log mean_{i<j} exp(-t ||zh_i - zh_j||^2), zh unit rows.

    On unit rows ||zh_i - zh_j||^2 = 2 - 2 zh_i.zh_j, so the pairwise distances come from one
    Gram matrix (no [N, N, D] difference tensor, and no sqrt whose gradient is undefined for
    equal rows, as torch.pdist has); logsumexp keeps the log of a tiny mean finite.
    Lower is more uniform: 0 when all rows are equal, -4t for two opposite rows (the bound).
    """
    _check_rows("z", z)
    n = z.shape[0]
    if n < 2:
        raise ValueError(f"uniformity needs at least 2 rows, got {n}")
    if not t > 0:
        raise ValueError(f"t must be > 0, got {t}")
    zh = F.normalize(z, dim=1)
    i, j = torch.triu_indices(n, n, offset=1, device=z.device)
    sq_dist = (2 - 2 * (zh @ zh.T)[i, j]).clamp_min(0)    # rounding can dip below 0
    return torch.logsumexp(-t * sq_dist, dim=0) - math.log(i.numel())


def _check_dsr_shapes(z_hat: torch.Tensor, q: torch.Tensor, d: torch.Tensor) -> None:
    _check_rows("z_hat", z_hat)
    dim = z_hat.shape[1]
    if q.shape != (dim, dim):
        raise ValueError(f"q must be [{dim}, {dim}], got {tuple(q.shape)}")
    if d.shape != (dim,):
        raise ValueError(f"d must be [{dim}], got {tuple(d.shape)}")
    if z_hat.shape[0] == 0:
        raise ValueError("z_hat must have at least one row")


def dsr_loss(z_hat: torch.Tensor, q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """SSD's dimension-scaling regulariser: || x - stopgrad(normalize(x Q diag(d) Q^T)) ||_F / N.

    x = z_hat [N, D], the caller's L2-normalised projections (not renormalised here: the
    gradient must see x as the caller made it); q [D, D] orthonormal, d [D] the device's
    scales (alpha on its own directions, 1 elsewhere; see ssd_scales.dsr_scales). The target
    stretches x along the device's directions and is put back on the sphere, pulling each
    device's representations towards its own share of the space. q and d may be numpy
    arrays: they are converted to x's dtype and device.
    """
    q = torch.as_tensor(q, dtype=z_hat.dtype, device=z_hat.device)
    d = torch.as_tensor(d, dtype=z_hat.dtype, device=z_hat.device)
    _check_dsr_shapes(z_hat, q, d)
    target = F.normalize((z_hat @ q * d) @ q.T, dim=1).detach()
    return torch.linalg.vector_norm(z_hat - target) / z_hat.shape[0]


def pd_loss(h: torch.Tensor, z: torch.Tensor, tau: float = 0.5) -> torch.Tensor:
    """SSD's projection distillation: KL(softmax(z / tau) || softmax(h / tau)), batch mean.

    h encoder features and z projections, both [N, D]; the KL sums over D and is averaged
    over N: mean_i sum_c p_ic (log p_ic - log q_ic), p = softmax(z/tau), q = softmax(h/tau).
    Unlike usual distillation there is no stop-gradient: the paper trains both sides, so
    h and z both receive gradients.
    """
    _check_pair("h", h, "z", z)
    if not tau > 0:
        raise ValueError(f"tau must be > 0, got {tau}")
    log_p = F.log_softmax(z / tau, dim=1)
    log_q = F.log_softmax(h / tau, dim=1)
    return (log_p.exp() * (log_p - log_q)).sum(dim=1).mean()


def dsr_paper_loss(z_hat: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """SSD's DSR as the paper writes it: the mean squared error between x = z_hat [N, D] and
    stopgrad(x * d), the device's scales applied on the coordinate axes (no rotation Q) and
    the target not put back on the sphere. The authors' code (dsr_loss, the default) rotates by
    a random orthonormal Q, renormalises the target and takes a Frobenius norm over N."""
    d = torch.as_tensor(d, dtype=z_hat.dtype, device=z_hat.device)
    _check_rows("z_hat", z_hat)
    if d.shape != (z_hat.shape[1],) or z_hat.shape[0] == 0:
        raise ValueError(f"d must be [{z_hat.shape[1]}] and z_hat non-empty, got {tuple(d.shape)}, "
                         f"{tuple(z_hat.shape)}")
    return F.mse_loss(z_hat, (z_hat * d).detach())


def pd_paper_loss(h: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """SSD's projection distillation as the paper writes it: KL(softmax(h) || softmax(z)), the
    encoder's distribution against the projector's, batch mean, gradients into both. The
    authors' code (pd_loss, the default) takes the reverse direction at temperature 0.5."""
    _check_pair("h", h, "z", z)
    log_p = F.log_softmax(h, dim=1)
    log_q = F.log_softmax(z, dim=1)
    return (log_p.exp() * (log_p - log_q)).sum(dim=1).mean()
