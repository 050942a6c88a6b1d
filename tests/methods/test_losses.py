"""methods.losses against hand-computed values and an independent numpy reference."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from splitedge.methods.losses import feddecorr_loss, supcon_loss

# Four unit vectors at 90 degrees: z_i.z_j is 0 for neighbours and -1 for opposites.
SQUARE = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0], [0.0, -1.0]])


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def _numpy_supcon(f: np.ndarray, y: np.ndarray, tau: float) -> float:
    """Independent loop reference: definition from METHODS.md, float64."""
    z = f / np.linalg.norm(f, axis=1, keepdims=True)
    losses = []
    for i in range(len(z)):
        others = [j for j in range(len(z)) if j != i]
        pos = [j for j in others if y[j] == y[i]]
        if not pos:
            continue
        denom = sum(math.exp(z[i] @ z[j] / tau) for j in others)
        losses.append(-np.mean([z[i] @ z[p] / tau - math.log(denom) for p in pos]))
    return float(np.mean(losses))


def test_supcon_hand_computed_square():
    # Each anchor: positive logit 0, negatives 0 and -1/0.5 = -2.
    # loss = -(0 - log(e^0 + e^0 + e^-2)) = log(2 + e^-2)
    loss = supcon_loss(SQUARE, torch.tensor([0, 0, 1, 1]), tau=0.5)
    assert loss.item() == pytest.approx(math.log(2 + math.exp(-2)), rel=1e-6)


def test_supcon_matches_numpy_reference():
    rng = np.random.default_rng(0)
    f = rng.normal(size=(9, 5))
    y = np.array([0, 1, 0, 2, 1, 1, 0, 3, 2])     # label 3 has no positive
    loss = supcon_loss(torch.tensor(f), torch.tensor(y), tau=0.3)
    assert loss.item() == pytest.approx(_numpy_supcon(f, y, 0.3), rel=1e-9)


def test_anchor_without_positive_excluded_not_nan():
    feats = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0]], requires_grad=True)
    loss = supcon_loss(feats, torch.tensor([0, 0, 1]), tau=0.5)
    # Anchor 2 (label 1) has no positive and is excluded. Positive logit is 0 for both others;
    # anchor 0's negative is (-1, 0) at -2 -> log(1 + e^-2); anchor 1's at 0 -> log(2).
    expected = (math.log(1 + math.exp(-2)) + math.log(2)) / 2
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    loss.backward()
    assert torch.isfinite(feats.grad).all()


def test_no_positive_at_all_gives_zero_with_grad():
    feats = torch.randn(4, 3, requires_grad=True)
    loss = supcon_loss(feats, torch.arange(4))
    assert loss.item() == 0.0 and loss.requires_grad
    loss.backward()
    assert torch.equal(feats.grad, torch.zeros_like(feats))


def test_scale_invariant():
    gen = torch.Generator().manual_seed(0)
    feats, labels = torch.randn(8, 4, generator=gen), torch.tensor([0, 1] * 4)
    assert supcon_loss(feats * 37.0, labels).item() == pytest.approx(
        supcon_loss(feats, labels).item(), rel=1e-5)


def test_nt_xent_hand_computed_and_equals_instance_labels():
    # Views stacked view-major: sample 0 = rows 0 and 2, sample 1 = rows 1 and 3.
    # Each anchor's positive is opposite (logit -2); negatives 0 and 0.
    loss = supcon_loss(SQUARE, None, tau=0.5)
    assert loss.item() == pytest.approx(2 + math.log(2 + math.exp(-2)), rel=1e-6)
    feats = torch.randn(6, 3)
    assert torch.allclose(supcon_loss(feats), supcon_loss(feats, torch.tensor([0, 1, 2] * 2)))


def test_supcon_bad_shapes_raise():
    with pytest.raises(ValueError):
        supcon_loss(torch.randn(3, 2))                       # 3 not a multiple of 2 views
    with pytest.raises(ValueError):
        supcon_loss(torch.randn(4, 2), torch.tensor([0, 1]))


def test_feddecorr_collapse_large_whitened_small():
    gen = torch.Generator().manual_seed(0)
    n, c = 64, 8
    collapsed = torch.randn(n, 1, generator=gen) * torch.randn(1, c, generator=gen)
    q, _ = torch.linalg.qr(torch.randn(n, c, generator=gen))
    whitened = q - q.mean(0)                       # near-orthogonal columns: almost uncorrelated
    big, small = feddecorr_loss(collapsed).item(), feddecorr_loss(whitened).item()
    assert big == pytest.approx((n - 1) ** 2 / n, rel=1e-3)   # |corr| = 1 -> K_ij = +-(n-1)
    assert small < 1e-2 * big
    assert feddecorr_loss(torch.randn(1, c)).item() == 0.0
