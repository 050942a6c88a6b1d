"""The shared simplex-ETF target for W_c (`device_target=etf`): the frame's geometry, the same
frame on every device of a run, and a device that trains against it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from splitedge.methods.hsfp.etf import simplex_etf
from parts import device_ctx


def test_simplex_etf_has_unit_rows_at_equal_maximal_angles() -> None:
    etf = simplex_etf(32, 10, seed=3)
    gram = etf @ etf.T
    np.testing.assert_allclose(np.diag(gram), 1.0, atol=1e-12)
    off = gram[~np.eye(10, dtype=bool)]
    np.testing.assert_allclose(off, -1 / 9, atol=1e-12)
    np.testing.assert_array_equal(simplex_etf(32, 10, seed=3), etf)  # every device builds the same one
    assert not np.allclose(simplex_etf(32, 10, seed=4), etf)
    with pytest.raises(ValueError, match="needs at least 10 feature dimensions"):
        simplex_etf(8, 10, seed=0)


def test_devices_share_a_fixed_etf_and_their_loss_falls() -> None:
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (64, 8, 8, 1), dtype=np.uint8)
    y = np.arange(64) % 4
    x[y == 1] //= 4  # classes a small W_c can tell apart
    x[y == 2] = 255 - x[y == 2]
    devices = []
    for seed, node in enumerate(("d0", "d1")):  # their own RNGs: private heads would differ
        ctx = device_ctx("hsfp", node, seed=seed, device_target="etf", device_lr=0.05)
        devices.append(ctx.method.device_part(ctx, (x, y), "torch"))
    a, b = devices
    assert torch.equal(a.head.etf, b.head.etf) and not list(a.head.parameters())  # shared, never trained
    before = a.head.etf.clone()
    losses = [a.train_epoch() for _ in range(6)]
    assert torch.equal(a.head.etf, before)
    assert "etf" in a.losses and losses[-1] < losses[0], losses
