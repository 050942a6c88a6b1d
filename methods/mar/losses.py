"""FedMAR / DecMAR losses (METHODS.md "FedMAR and DecMAR"): the A-MMD alignment between a
batch's MAE latents and the reference latents of the previous round, and its weight gamma_k.

The reconstruction loss itself is the MAE's own (models.vit_mae.MaskedAutoencoder's "loss");
the local objective is  loss_mae + mar_gamma(participations) * ammd_loss(latent, z_bar).
"""
from __future__ import annotations

import math

import torch


def _as_reference(z: torch.Tensor, z_bar: torch.Tensor) -> torch.Tensor:
    """z_bar as rows [M, D]: a single mean [D] becomes one row."""
    if z.dim() != 2 or z.shape[0] == 0:
        raise ValueError(f"z must be [B>0, D], got {tuple(z.shape)}")
    ref = z_bar.unsqueeze(0) if z_bar.dim() == 1 else z_bar
    if ref.dim() != 2 or ref.shape[0] == 0 or ref.shape[1] != z.shape[1]:
        raise ValueError(f"z_bar must be [{z.shape[1]}] or [M>0, {z.shape[1]}], "
                         f"got {tuple(z_bar.shape)}")
    return ref.to(dtype=z.dtype, device=z.device)


def _sq_dists(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """||a_i - b_j||^2 [N, M] from the difference tensor: exact and with a finite gradient at
    zero distance (the Gram-matrix form loses precision, cdist's sqrt has no gradient at 0).
    The batches here are small ([64, 128] latents), so the [N, M, D] tensor is cheap."""
    return (a[:, None, :] - b[None, :, :]).pow(2).sum(dim=-1)


def _off_diag_mean(k: torch.Tensor) -> torch.Tensor:
    """mean_{i != j} k_ij of a square kernel matrix; 0 (with grad) for fewer than 2 rows."""
    n = k.shape[0]
    if n < 2:
        return k.sum() * 0.0
    off = ~torch.eye(n, dtype=torch.bool, device=k.device)
    return k[off].mean()


def ammd_sigma(z: torch.Tensor) -> torch.Tensor:
    """Bandwidth: mean Euclidean distance over the pairs i < j of z, without gradient.
    1.0 when it is undefined or 0 (one row, or all rows equal), so the kernel stays finite."""
    with torch.no_grad():
        n = z.shape[0]
        if n < 2:
            return torch.ones((), dtype=z.dtype, device=z.device)
        i, j = torch.triu_indices(n, n, offset=1, device=z.device)
        sigma = (z[i] - z[j]).pow(2).sum(dim=1).sqrt().mean()
        return torch.where(sigma > 1e-12, sigma, torch.ones_like(sigma))


def ammd_loss(z: torch.Tensor, z_bar: torch.Tensor) -> torch.Tensor:
    """A-MMD^2 between the batch's latents z [B, D] and the reference latents z_bar.

    z_bar is [D] (one vector: the unweighted mean of the participants' mean latents, as the
    METHODS.md wording reads) or [M, D] (the M participants' mean latents themselves, so the
    reference is a set of points; M = 1 is the same as [D]). Both forms come from the same
    messages, and a caller that wants the single mean passes `z_bar.mean(0)`.

    With sigma = mean_{i<j} ||z_i - z_j|| (no gradient; 1 if undefined or 0) and
    k(a, b) = exp(-||a - b||^2 / (2 sigma^2)), this returns
        mean_{i != j} k(z_i, z_j) + mean_{a != b} k(zbar_a, zbar_b) - 2 mean_{i, a} k(z_i, zbar_a)
    i.e. MMD^2 with the diagonal removed from the two within-set terms (the unbiased
    U-statistic form); a within-set term over fewer than 2 items is 0. The z_bar term does not
    depend on z, so it changes the reported value, never the gradient; with one reference
    vector it is 0 and the value is the unbiased estimate minus 1 (so it can be negative).
    The bandwidth is detached so the loss cannot shrink by inflating sigma. z_bar is used as
    given (it is received data; pass a tensor without grad).
    """
    ref = _as_reference(z, z_bar)
    sigma = ammd_sigma(z)
    scale = 2.0 * sigma.pow(2)
    within_z = _off_diag_mean(torch.exp(-_sq_dists(z, z) / scale))
    within_ref = _off_diag_mean(torch.exp(-_sq_dists(ref, ref) / scale))
    cross = torch.exp(-_sq_dists(z, ref) / scale).mean()
    return within_z + within_ref - 2.0 * cross


def ammd_paper_loss(z: torch.Tensor, z_bar: torch.Tensor) -> torch.Tensor:
    """A-MMD^2 as the FedMAR paper writes its kernel: k(a, b) = exp(-||a - b|| / (2 s)) with the
    DISTANCE (not its square) over s = the mean squared distance between the points of the two
    sets pooled (z's rows and the reference's, pairs a < b; no gradient; 1 if 0 or undefined).
    The reference z_bar [M, D] is the federation's latents (each participant's mean latent of
    the previous round, `ammd=paper`), so the term matches the device's latent distribution to
    the federation's rather than pulling it towards one point. Within-set terms without their
    diagonal, as ammd_loss. Distances are sqrt(d^2 + 1e-12): finite gradients at 0."""
    ref = _as_reference(z, z_bar)
    with torch.no_grad():
        pooled = torch.cat([z, ref])
        n = pooled.shape[0]
        i, j = torch.triu_indices(n, n, offset=1, device=z.device)
        s = (pooled[i] - pooled[j]).pow(2).sum(dim=1).mean() if n >= 2 else torch.ones((), dtype=z.dtype)
        s = torch.where(s > 1e-12, s, torch.ones_like(s))

    def kernel(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.exp(-torch.sqrt(_sq_dists(a, b) + 1e-12) / (2.0 * s))

    return _off_diag_mean(kernel(z, z)) + _off_diag_mean(kernel(ref, ref)) - 2.0 * kernel(z, ref).mean()


AMMD_FORMS = {"ours": ammd_loss, "paper": ammd_paper_loss}
"""MARConfig.ammd: our first reading of METHODS.md (squared distance, the batch's bandwidth, one
mean reference vector), or the paper's (distance kernel, pooled bandwidth, the participants'
latents as the reference)."""


def mar_gamma(participations: int, *, g_min: float = 1e-3, g_max: float = 0.1,
              cap: int = 10) -> float:
    """Alignment weight gamma_k = g_min + (g_max - g_min) (1 + cos(pi p)) / 2 with
    p = min(1, participations / cap): g_max at the first participation, cosine-decayed to
    g_min once a device has taken part `cap` times."""
    if participations < 0:
        raise ValueError(f"participations must be >= 0, got {participations}")
    if cap <= 0:
        raise ValueError(f"cap must be > 0, got {cap}")
    if not 0.0 <= g_min <= g_max:
        raise ValueError(f"need 0 <= g_min <= g_max, got g_min={g_min}, g_max={g_max}")
    p = min(1.0, participations / cap)
    return g_min + (g_max - g_min) * (1.0 + math.cos(math.pi * p)) / 2.0
