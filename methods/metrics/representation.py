"""What a representation learned, measured on features (numpy only; METHODS.md "Metrics").

Effective rank (Roy & Vetterli 2007): centre the feature matrix, take its singular values s,
normalise them to a distribution p = s / sum(s), and return exp(H(p)) with H the Shannon
entropy. It is 1 for features on one line (dimensional collapse) and D for isotropic features
in D dimensions. Alignment and uniformity (Wang & Isola 2020) are on L2-normalised features.
"""

from __future__ import annotations

import numpy as np


def effective_rank(features: np.ndarray, eps: float = 1e-12) -> float:
    """exp(entropy of the L1-normalised singular values of the centred [N, D] features)."""
    return rank_of_spectrum(spectrum(features, eps), eps)


def rank_of_spectrum(p: np.ndarray, eps: float = 1e-12) -> float:
    """exp(H(p)) of a normalised spectrum (`spectrum`): the effective rank without a second SVD."""
    p = np.asarray(p, dtype=np.float64)
    p = p[p > eps]
    return float(np.exp(-(p * np.log(p)).sum()))


def normalise(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)


def alignment(a: np.ndarray, b: np.ndarray) -> float:
    """Mean squared distance of positive pairs (rows of a and b), on L2-normalised features."""
    return float(np.mean(np.sum((normalise(a) - normalise(b)) ** 2, axis=1)))


def uniformity(x: np.ndarray, t: float = 2.0) -> float:
    """log mean over distinct pairs of exp(-t ||x_i - x_j||^2), on L2-normalised features."""
    z = normalise(x)
    sq = np.maximum(2.0 - 2.0 * z @ z.T, 0.0)
    iu = np.triu_indices(len(z), k=1)
    if not len(iu[0]):
        raise ValueError("uniformity needs at least two features")
    return float(np.log(np.mean(np.exp(-t * sq[iu]))))


def spectrum(features: np.ndarray, eps: float = 1e-12) -> np.ndarray:
    """Singular values of the centred [N, D] features, sorted descending, normalised to sum 1.

    This is the distribution p whose entropy gives `effective_rank`
    (exp(H(p))), shown whole: the rank says how many directions are used, the spectrum says how
    fast the used ones fade. All-equal features (nothing spans any direction) give
    (1, 0, ..., 0), matching effective rank 1.
    """
    x = np.asarray(features, dtype=np.float64)
    if x.ndim != 2 or len(x) < 2:
        raise ValueError(f"features must be [N >= 2, D], got shape {x.shape}")
    s = np.linalg.svd(x - x.mean(axis=0), compute_uv=False)  # LAPACK returns them descending
    if s.sum() <= eps:
        s = np.zeros_like(s)
        s[0] = 1.0
    return s / s.sum()
