"""The fixed simplex ETF target of H-SFP's `device_target="etf"` (methods/hsfp/etf.py), torch-free so
the thin trainer (methods/thin/trainer.py) builds the same matrix from the run's seed. In the shared
core because both use it: no shared module imports a method's package (tests/app/test_layering.py)."""

from __future__ import annotations

import numpy as np


def simplex_etf(dim: int, classes: int, seed: int) -> np.ndarray:
    """[classes, dim] unit rows with pairwise cosine -1/(K-1), the same for the same seed."""
    if classes < 2 or dim < classes:
        raise ValueError(f"a simplex ETF of {classes} classes needs at least {classes} feature dimensions, "
                         f"W_c gives {dim}")
    basis, _ = np.linalg.qr(np.random.default_rng(seed).standard_normal((dim, classes)))  # orthonormal columns
    centred = np.eye(classes) - np.full((classes, classes), 1.0 / classes)
    return (np.sqrt(classes / (classes - 1)) * basis @ centred).T
