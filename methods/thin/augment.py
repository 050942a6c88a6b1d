"""The SupCon views of methods/hsfp/augment.py in numpy: zero-padded random crop, then a random
horizontal flip, drawn per sample from a numpy Generator."""

from __future__ import annotations

import numpy as np


def crop_flip(x: np.ndarray, rng: np.random.Generator, pad: int | None = None) -> np.ndarray:
    """[B, C, H, W] -> the same shape: each sample cropped from its zero-padded self and flipped
    left-right with probability 1/2 (pad: 4 for 32x32, 1 for 8x8, as default_pad)."""
    b, _, h, w = x.shape
    pad = max(1, min(h, w) // 8) if pad is None else int(pad)
    padded = np.pad(x, ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    oy = rng.integers(0, 2 * pad + 1, b)
    ox = rng.integers(0, 2 * pad + 1, b)
    rows = (oy[:, None] + np.arange(h))[:, None, :, None]  # [B, 1, H, 1]
    cols = (ox[:, None] + np.arange(w))[:, None, None, :]  # [B, 1, 1, W]
    out = padded[np.arange(b)[:, None, None, None], np.arange(x.shape[1])[None, :, None, None], rows, cols]
    flip = rng.random(b) < 0.5
    out[flip] = out[flip][..., ::-1]
    return np.ascontiguousarray(out, dtype=np.float32)


def two_views(x: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """[view1; view2] stacked view-major ([2B, ...]), the layout SupCon takes."""
    return np.concatenate([crop_flip(x, rng), crop_flip(x, rng)])
