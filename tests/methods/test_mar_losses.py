"""methods.mar_losses: A-MMD and the gamma schedule against hand-computed values."""
from __future__ import annotations

import math

import pytest
import torch

from splitedge.methods.mar.losses import ammd_loss, ammd_sigma, mar_gamma


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def _kernel(a: torch.Tensor, b: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    return torch.exp(-torch.cdist(a, b).pow(2) / (2 * sigma ** 2))


def _reference_ammd(z: torch.Tensor, z_bar: torch.Tensor, detach_sigma: bool) -> torch.Tensor:
    """Straight transcription of the formula, with the bandwidth detached or not."""
    i, j = torch.triu_indices(len(z), len(z), offset=1)
    sigma = (z[i] - z[j]).norm(dim=1).mean()
    sigma = sigma.detach() if detach_sigma else sigma
    off = ~torch.eye(len(z), dtype=torch.bool)
    return _kernel(z, z, sigma)[off].mean() - 2 * _kernel(z, z_bar, sigma).mean()


def test_gamma_endpoints_midpoint_and_monotone():
    # Prepare
    g_min, g_max = 1e-3, 0.1
    # Execute
    values = [mar_gamma(k) for k in range(0, 13)]
    # Assert
    assert values[0] == pytest.approx(g_max)
    assert values[10] == pytest.approx(g_min)
    assert values[12] == pytest.approx(g_min)                  # p is capped at 1
    assert mar_gamma(5) == pytest.approx((g_min + g_max) / 2)  # cos(pi/2) = 0
    assert mar_gamma(1, g_min=0.0, g_max=1.0, cap=4) == pytest.approx((1 + math.cos(math.pi / 4)) / 2)
    assert all(a > b for a, b in zip(values[:10], values[1:11]))
    assert isinstance(values[3], float)


@pytest.mark.parametrize("kw", [{"participations": -1}, {"participations": 1, "cap": 0},
                                {"participations": 1, "g_min": 0.2, "g_max": 0.1}])
def test_gamma_rejects_bad_arguments(kw):
    with pytest.raises(ValueError):
        mar_gamma(kw.pop("participations"), **kw)


def test_ammd_hand_computed_one_reference_point():
    # Prepare: z = {0, 2}, z_bar = {1}; sigma = |0 - 2| = 2, so 2 sigma^2 = 8
    z = torch.tensor([[0.0], [2.0]])
    z_bar = torch.tensor([1.0])
    # Execute
    loss = ammd_loss(z, z_bar)
    # Assert: within z: k(0, 2) = e^{-4/8}; no within-z_bar term (one point);
    # cross: k(0, 1) = k(2, 1) = e^{-1/8}
    assert ammd_sigma(z).item() == pytest.approx(2.0)
    assert loss.item() == pytest.approx(math.exp(-0.5) - 2 * math.exp(-0.125), abs=1e-6)
    assert ammd_loss(z, z_bar[None, :]).item() == pytest.approx(loss.item(), abs=1e-7)


def test_ammd_hand_computed_two_reference_points():
    # Prepare: z = {0, 2}, z_bar = {1, 3}; sigma = 2 (from z only), 2 sigma^2 = 8
    z = torch.tensor([[0.0], [2.0]])
    z_bar = torch.tensor([[1.0], [3.0]])
    # Execute
    loss = ammd_loss(z, z_bar)
    # Assert: within z_bar: k(1, 3) = e^{-4/8};
    # cross: d^2 = 1 (0-1), 9 (0-3), 1 (2-1), 1 (2-3)
    cross = (3 * math.exp(-1 / 8) + math.exp(-9 / 8)) / 4
    assert loss.item() == pytest.approx(2 * math.exp(-0.5) - 2 * cross, abs=1e-6)


def test_ammd_grows_with_reference_distance():
    # Prepare
    z = torch.randn(16, 8, generator=torch.Generator().manual_seed(0))
    near, far = z.mean(dim=0), z.mean(dim=0) + 10.0
    # Execute / Assert
    assert ammd_loss(z, far).item() > ammd_loss(z, near).item()
    assert ammd_loss(z, z + 10.0).item() > ammd_loss(z, z).item()


def test_ammd_no_gradient_through_sigma():
    # Prepare
    base = torch.randn(6, 3, generator=torch.Generator().manual_seed(1))
    z_bar = torch.randn(3, generator=torch.Generator().manual_seed(2))[None, :]
    grads = {}
    # Execute
    for name, fn in (("ours", lambda z: ammd_loss(z, z_bar)),
                     ("detached", lambda z: _reference_ammd(z, z_bar, True)),
                     ("attached", lambda z: _reference_ammd(z, z_bar, False))):
        z = base.clone().requires_grad_(True)
        fn(z).backward()
        grads[name] = z.grad
    # Assert: same gradient as the detached-sigma formula, unlike the attached one
    assert torch.allclose(grads["ours"], grads["detached"], atol=1e-6)
    assert not torch.allclose(grads["ours"], grads["attached"], atol=1e-4)


def test_ammd_degenerate_batches_stay_finite():
    # Prepare: one row (no pairs) and identical rows (sigma = 0) fall back to sigma = 1
    one = torch.zeros(1, 4, requires_grad=True)
    same = torch.ones(5, 4, requires_grad=True)
    # Execute
    loss_one = ammd_loss(one, torch.ones(4))
    loss_same = ammd_loss(same, torch.zeros(4))
    (loss_one + loss_same).backward()
    # Assert: within-z term is 0 for one row; identical rows give k = 1 within z
    assert loss_one.item() == pytest.approx(-2 * math.exp(-4 / 2), abs=1e-6)
    assert loss_same.item() == pytest.approx(1 - 2 * math.exp(-4 / 2), abs=1e-6)
    assert torch.isfinite(one.grad).all() and torch.isfinite(same.grad).all()


@pytest.mark.parametrize("z, z_bar", [
    (torch.zeros(4), torch.zeros(4)),            # z not [B, D]
    (torch.zeros(0, 4), torch.zeros(4)),         # empty batch
    (torch.zeros(3, 4), torch.zeros(5)),         # D mismatch
    (torch.zeros(3, 4), torch.zeros(2, 5)),      # D mismatch, set form
    (torch.zeros(3, 4), torch.zeros(0, 4)),      # empty reference
    (torch.zeros(3, 4), torch.zeros(1, 2, 4)),   # reference not [D] or [M, D]
])
def test_ammd_rejects_bad_shapes(z, z_bar):
    with pytest.raises(ValueError):
        ammd_loss(z, z_bar)


def test_ammd_paper_form_against_a_hand_computation():
    # z: 3 latents, the federation's: 2; the paper's kernel exp(-||a-b|| / (2 s)), s the mean
    # squared distance over the 10 pairs of the 5 pooled points
    from splitedge.methods.mar.losses import AMMD_FORMS, ammd_paper_loss

    z = torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.0, 2.0]])
    ref = torch.tensor([[1.0, 1.0], [3.0, 0.0]])
    pts = [tuple(p) for p in torch.cat([z, ref]).tolist()]
    sq = lambda a, b: (a[0] - b[0]) ** 2 + (a[1] - b[1]) ** 2  # noqa: E731
    s = sum(sq(pts[i], pts[j]) for i in range(5) for j in range(i + 1, 5)) / 10
    k = lambda a, b: math.exp(-math.sqrt(sq(a, b)) / (2 * s))  # noqa: E731
    zs, rs = pts[:3], pts[3:]
    within_z = sum(k(a, b) for i, a in enumerate(zs) for j, b in enumerate(zs) if i != j) / 6
    within_ref = (k(rs[0], rs[1]) + k(rs[1], rs[0])) / 2
    cross = sum(k(a, b) for a in zs for b in rs) / 6
    assert float(ammd_paper_loss(z, ref)) == pytest.approx(within_z + within_ref - 2 * cross, rel=1e-5)
    assert AMMD_FORMS["paper"] is ammd_paper_loss and AMMD_FORMS["ours"] is ammd_loss
    # it differs from our form, grows as the federation's latents move away, and has a gradient
    assert float(ammd_paper_loss(z, ref)) != pytest.approx(float(ammd_loss(z, ref)), rel=1e-3)
    assert float(ammd_paper_loss(z, ref + 10.0)) > float(ammd_paper_loss(z, ref))
    zg = z.clone().requires_grad_(True)
    ammd_paper_loss(zg, ref).backward()
    assert torch.isfinite(zg.grad).all() and zg.grad.abs().sum() > 0
