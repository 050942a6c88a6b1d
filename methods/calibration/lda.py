"""The closed-form classifier fitted on merged head statistics (numpy only)."""

from __future__ import annotations

import numpy as np

from splitedge.methods.calibration.stats import HeadStats


def lda_classifier(s: HeadStats, num_classes: int, *, shrink: float = 0.1,
                   absent_bias: float = -1e4) -> tuple[np.ndarray, np.ndarray]:
    """Weights [num_classes, D] and bias [num_classes] of the Bayes classifier for Gaussian
    classes with the shared covariance, shrunk toward its mean variance (Ledoit-Wolf style,
    weight `shrink`) so it stays invertible with few samples:
        Sigma_s = (1 - s) Sigma + s (tr(Sigma) / D) I,  W_c = Sigma_s^-1 mu_c,
        b_c = -1/2 mu_c^T Sigma_s^-1 mu_c + log pi_c.
    Priors are the classes' shares of the merged counts; a class nobody holds gets zero
    weights and `absent_bias`."""
    dim = s.dim
    scale = max(float(np.trace(s.cov)) / dim, 1e-12)
    cov = (1 - shrink) * s.cov + (shrink * scale + 1e-9 * scale) * np.eye(dim)
    w = np.linalg.solve(cov, s.mean.T).T  # [K, D]: Sigma^-1 mu_c
    b = -0.5 * np.einsum("kd,kd->k", w, s.mean) + np.log(s.counts / s.counts.sum())
    weight, bias = np.zeros((num_classes, dim)), np.full(num_classes, absent_bias)
    weight[s.classes], bias[s.classes] = w, b
    return weight, bias
