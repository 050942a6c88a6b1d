"""The device losses of H-SFP in numpy, each returning (loss, gradient of its input).

The same formulas as methods/losses.py (torch, autograd); tests/thin/test_thin_trainer.py checks each
value and gradient against torch's.
"""

from __future__ import annotations

import numpy as np

F32 = np.float32


def normalize(x: np.ndarray, eps: float = 1e-12) -> tuple[np.ndarray, np.ndarray]:
    """(rows of x scaled to unit length, their norms clamped at eps), as F.normalize."""
    norm = np.maximum(np.sqrt((x.astype(np.float64) ** 2).sum(axis=1, keepdims=True)), eps)
    return (x / norm).astype(F32), norm


def normalize_backward(grad: np.ndarray, z: np.ndarray, norm: np.ndarray) -> np.ndarray:
    """Gradient of x for z = x / |x| (rows whose norm was clamped pass it through scaled)."""
    radial = (grad * z).sum(axis=1, keepdims=True, dtype=np.float64)
    return ((grad - z * radial) / norm).astype(F32)


def supcon(features: np.ndarray, labels: np.ndarray, tau: float) -> tuple[float, np.ndarray]:
    """Supervised contrastive loss (Khosla et al. 2020, L_out), as methods.losses.supcon_loss.

    With logits l_ij = z_i.z_j / tau (j != i) and P(i) the other samples of i's class, the loss
    is the mean over anchors with a positive of -mean_{p in P(i)} log softmax_i(p); its gradient
    on the logits is (softmax_ij - [j in P(i)] / |P(i)|) / anchors.
    """
    n = len(features)
    z, norm = normalize(features)
    zd = z.astype(np.float64)
    logits = zd @ zd.T / tau
    np.fill_diagonal(logits, -np.inf)
    logits_max = logits.max(axis=1, keepdims=True)
    expd = np.exp(logits - logits_max)
    log_norm = logits_max + np.log(expd.sum(axis=1, keepdims=True))
    pos = labels[:, None] == labels[None, :]
    np.fill_diagonal(pos, False)
    n_pos = pos.sum(axis=1)
    valid = n_pos > 0
    if not valid.any():
        return 0.0, np.zeros_like(features, dtype=F32)
    log_prob = np.where(pos, logits - log_norm, 0.0)
    per_anchor = -log_prob.sum(axis=1)[valid] / n_pos[valid]
    loss = float(per_anchor.mean())
    softmax = expd / expd.sum(axis=1, keepdims=True)
    g = np.where(valid[:, None], softmax - pos / np.maximum(n_pos, 1)[:, None], 0.0) / valid.sum()
    dz = (g + g.T) @ zd / tau
    del n
    return loss, normalize_backward(dz.astype(F32), z, norm)


def etf_cross_entropy(features: np.ndarray, labels: np.ndarray, etf: np.ndarray, tau: float) -> tuple[float, np.ndarray]:
    """Cross-entropy of cosine logits against a fixed simplex ETF / tau (methods/hsfp/etf.py)."""
    z, norm = normalize(features)
    logits = z.astype(np.float64) @ etf.T.astype(np.float64) / tau
    logits -= logits.max(axis=1, keepdims=True)
    p = np.exp(logits)
    p /= p.sum(axis=1, keepdims=True)
    rows = np.arange(len(labels))
    loss = float(-np.log(p[rows, labels]).mean())
    p[rows, labels] -= 1.0
    dz = p @ etf.astype(np.float64) / tau / len(labels)
    return loss, normalize_backward(dz.astype(F32), z, norm)


def feddecorr(x: np.ndarray, eps: float = 1e-8) -> tuple[float, np.ndarray]:
    """FedDecorr (methods.losses.feddecorr_loss): mean squared off-diagonal correlation / N."""
    n, c = x.shape
    if n == 1 or c < 2:
        return 0.0, np.zeros_like(x, dtype=F32)
    xd = x.astype(np.float64)
    xc = xd - xd.mean(axis=0, keepdims=True)
    s = np.sqrt(eps + (xc ** 2).sum(axis=0, keepdims=True) / (n - 1))
    xn = xc / s
    k = xn.T @ xn
    np.fill_diagonal(k, 0.0)
    loss = float((k ** 2).sum() / (c * (c - 1)) / n)
    dxn = xn @ (4.0 * k / (c * (c - 1) * n))  # d/dxn of sum(K_offdiag^2) is 2 xn (dK + dK^T), dK = 2K/(...)
    ds = -(dxn * xc).sum(axis=0, keepdims=True) / s ** 2
    dxc = dxn / s + ds / s * xc / (n - 1)
    return loss, (dxc - dxc.mean(axis=0, keepdims=True)).astype(F32)
