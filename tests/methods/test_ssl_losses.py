"""methods.ssl_losses and methods.ssd_scales against hand-computed values on tiny batches."""
from __future__ import annotations

import math
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from splitedge.methods.ssl.ssd_scales import dsr_scales
from splitedge.methods.ssl.losses import (align_loss, dsr_loss, pd_loss, simsiam_loss,
                                          uniformity_loss)


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def test_simsiam_hand_computed_and_stop_gradient():
    # Prepare
    p1 = torch.tensor([[1.0, 0.0], [0.0, 1.0]], requires_grad=True)
    p2 = torch.tensor([[1.0, 1.0], [0.0, 2.0]], requires_grad=True)
    z1 = torch.tensor([[-1.0, 0.0], [0.0, 3.0]], requires_grad=True)
    z2 = torch.tensor([[1.0, 0.0], [1.0, 1.0]], requires_grad=True)
    # Execute
    loss = simsiam_loss(p1, p2, z1, z2)
    loss.backward()
    # Assert
    # cos(p1, z2) = (1, 1/sqrt2)  -> D1 = -(1 + 1/sqrt2)/2
    # cos(p2, z1) = (-1/sqrt2, 1) -> D2 = -(1 - 1/sqrt2)/2
    # loss = D1/2 + D2/2 = -(2)/4 = -0.5
    assert loss.item() == pytest.approx(-0.5, abs=1e-6)
    assert z1.grad is None and z2.grad is None
    assert p1.grad.abs().sum() > 0 and p2.grad.abs().sum() > 0


def test_simsiam_shape_mismatch_raises():
    with pytest.raises(ValueError):
        simsiam_loss(torch.ones(2, 3), torch.ones(2, 3), torch.ones(2, 3), torch.ones(3, 3))


def test_align_hand_computed_rows_normalised_inside():
    # Prepare: normalised z1 = [[1,0],[0,1]], z2 = [[0,1],[0,1]]: squared distances 2 and 0.
    z1 = torch.tensor([[3.0, 0.0], [0.0, 2.0]], requires_grad=True)
    z2 = torch.tensor([[0.0, 5.0], [0.0, 1.0]])
    # Execute
    loss2, loss1 = align_loss(z1, z2), align_loss(z1, z2, alpha=1.0)
    loss1.backward()
    # Assert: alpha=2 -> (2 + 0)/2 = 1; alpha=1 -> (sqrt2 + 0)/2; equal rows give a finite grad.
    assert loss2.item() == pytest.approx(1.0, abs=1e-6)
    assert loss1.item() == pytest.approx(math.sqrt(2) / 2, abs=1e-6)
    assert torch.isfinite(z1.grad).all()
    with pytest.raises(ValueError):
        align_loss(z1, z2[:1])


def test_uniformity_hand_computed():
    # Two orthogonal unit vectors: ||a-b||^2 = 2 -> log exp(-2*2) = -4.
    assert uniformity_loss(torch.tensor([[1.0, 0.0], [0.0, 1.0]])).item() == pytest.approx(-4.0)
    # (2,0), (0,1), (-1,0): unit rows with pair distances^2 2, 4, 2; t = 1
    # -> log((e^-2 + e^-4 + e^-2) / 3)
    z = torch.tensor([[2.0, 0.0], [0.0, 1.0], [-1.0, 0.0]])
    expected = math.log((2 * math.exp(-2) + math.exp(-4)) / 3)
    assert uniformity_loss(z, t=1.0).item() == pytest.approx(expected, rel=1e-6)


def test_uniformity_equal_rows_zero_with_finite_grad_and_needs_two_rows():
    z = torch.tensor([[1.0, 1.0], [2.0, 2.0]], requires_grad=True)
    loss = uniformity_loss(z)                       # same direction: distance 0 -> log 1 = 0
    loss.backward()
    assert loss.item() == pytest.approx(0.0, abs=1e-6)
    assert torch.isfinite(z.grad).all()
    with pytest.raises(ValueError):
        uniformity_loss(torch.ones(1, 3))


def test_dsr_identity_basis_hand_computed_and_gradient():
    # Prepare: rows already unit length; Q = I, d = (10, 1) stretches the first axis.
    x = torch.tensor([[0.6, 0.8], [1.0, 0.0]], requires_grad=True)
    q, d = torch.eye(2), torch.tensor([10.0, 1.0])
    # Execute
    loss = dsr_loss(x, q, d)
    loss.backward()
    # Assert: row 0 -> (6, 0.8) / sqrt(36.64); row 1 -> (1, 0), its own target.
    target0 = torch.tensor([6.0, 0.8]) / math.sqrt(36.64)
    diff0 = torch.tensor([0.6, 0.8]) - target0      # (-0.3912, 0.6678), squared norm 0.5990
    norm = diff0.norm().item()
    assert loss.item() == pytest.approx(norm / 2, rel=1e-5)
    # Target is stop-grad, so d/dx ||x - t||_F / N = (x - t) / (N ||x - t||_F).
    expected_grad = torch.stack([diff0 / (2 * norm), torch.zeros(2)])
    assert torch.allclose(x.grad, expected_grad, atol=1e-6)


def test_dsr_rotated_basis_and_numpy_inputs():
    # Columns of q are (0, -1) and (1, 0): d = (10, 1) stretches the y axis, as Q=I, d=(1, 10) does.
    x = torch.tensor([[0.6, 0.8], [0.0, 1.0], [0.8, -0.6]])
    q = np.array([[0.0, 1.0], [-1.0, 0.0]], dtype=np.float32)
    rotated = dsr_loss(x, q, np.array([10.0, 1.0], dtype=np.float32))
    assert rotated.item() == pytest.approx(
        dsr_loss(x, torch.eye(2), torch.tensor([1.0, 10.0])).item(), rel=1e-6)


def test_dsr_bad_shapes_raise():
    x = torch.ones(3, 2)
    with pytest.raises(ValueError):
        dsr_loss(x, torch.eye(3), torch.ones(2))
    with pytest.raises(ValueError):
        dsr_loss(x, torch.eye(2), torch.ones(3))
    with pytest.raises(ValueError):
        dsr_loss(torch.ones(2), torch.eye(2), torch.ones(2))


def test_pd_hand_computed_and_gradients_reach_both():
    # Prepare: with tau = 0.5, z/tau = [[0, 0], [ln3, 0]] -> p = [[1/2, 1/2], [3/4, 1/4]]
    #          and h/tau = [[ln3, 0], [0, 0]] -> q = [[3/4, 1/4], [1/2, 1/2]].
    ln3 = math.log(3)
    z = torch.tensor([[0.0, 0.0], [ln3 / 2, 0.0]], requires_grad=True)
    h = torch.tensor([[ln3 / 2, 0.0], [0.0, 0.0]], requires_grad=True)
    # Execute
    loss = pd_loss(h, z, tau=0.5)
    loss.backward()
    # Assert: KL row 0 = 1/2 ln(2/3) + 1/2 ln 2; row 1 = 3/4 ln(3/2) + 1/4 ln(1/2); batch mean.
    row0 = 0.5 * math.log(2 / 3) + 0.5 * math.log(2)
    row1 = 0.75 * math.log(1.5) + 0.25 * math.log(0.5)
    assert loss.item() == pytest.approx((row0 + row1) / 2, rel=1e-6)
    assert h.grad.abs().sum() > 0 and z.grad.abs().sum() > 0
    reference = F.kl_div(F.log_softmax(h / 0.5, 1), F.log_softmax(z / 0.5, 1),
                         reduction="batchmean", log_target=True)
    assert loss.item() == pytest.approx(reference.item(), rel=1e-6)


def test_pd_shape_mismatch_raises():
    with pytest.raises(ValueError):
        pd_loss(torch.ones(2, 3), torch.ones(2, 4))


def test_dsr_scales_disjoint_sets_and_orthonormal_basis():
    # Prepare: dim 10, 3 devices -> 3 directions each, 1 left over.
    devices = ["d2", "d0", "d1"]
    # Execute
    q, scales = dsr_scales(10, devices, 10.0, np.random.default_rng(3))
    # Assert
    assert list(scales) == devices
    sets = [set(np.flatnonzero(d == 10.0)) for d in scales.values()]
    assert all(len(s) == 3 for s in sets)
    assert len(set.union(*sets)) == 9                       # pairwise disjoint
    assert all(d.dtype == np.float32 and set(d.tolist()) <= {10.0, 1.0} for d in scales.values())
    assert q.dtype == np.float32 and q.shape == (10, 10)
    assert np.allclose(q.T @ q, np.eye(10), atol=1e-5)


def test_dsr_scales_basis_is_the_sign_fixed_qr_factor():
    # Q is drawn first: Q^T G must be upper triangular with a positive diagonal (the unique QR).
    g = np.random.default_rng(5).standard_normal((4, 4))
    q, _ = dsr_scales(4, ["a"], 2.0, np.random.default_rng(5))
    r = q.astype(np.float64).T @ g
    assert np.allclose(np.tril(r, -1), 0, atol=1e-5) and (np.diag(r) > 0).all()


def test_dsr_scales_deterministic_for_a_seed():
    q1, s1 = dsr_scales(8, ["a", "b"], 10.0, np.random.default_rng(0))
    q2, s2 = dsr_scales(8, ["a", "b"], 10.0, np.random.default_rng(0))
    q3, s3 = dsr_scales(8, ["a", "b"], 10.0, np.random.default_rng(1))
    assert np.array_equal(q1, q2) and all(np.array_equal(s1[k], s2[k]) for k in s1)
    assert not np.array_equal(q1, q3)


@pytest.mark.parametrize("dim, devices, alpha", [
    (2, ["a", "b", "c"], 10.0),     # K > dim
    (4, ["a", "b"], 0.0),           # alpha <= 0
    (4, [], 10.0),                  # no devices
    (4, ["a", "a"], 10.0),          # duplicate ids would share one entry
])
def test_dsr_scales_bad_arguments_raise(dim, devices, alpha):
    with pytest.raises(ValueError):
        dsr_scales(dim, devices, alpha, np.random.default_rng(0))


def test_dsr_scales_does_not_import_torch():
    code = ("import sys, numpy as np\n"
            "from splitedge.methods.ssl.ssd_scales import dsr_scales\n"
            "dsr_scales(4, ['a'], 10.0, np.random.default_rng(0))\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_ssd_paper_forms_against_hand_computations():
    from splitedge.methods.ssl.losses import dsr_paper_loss, pd_paper_loss

    # DSR: the mean squared error to x scaled on the coordinate axes, the target not renormalised
    x = torch.tensor([[0.6, 0.8], [1.0, 0.0]], requires_grad=True)
    d = torch.tensor([10.0, 1.0])
    want = ((0.6 - 6.0) ** 2 + 0 + (1.0 - 10.0) ** 2 + 0) / 4
    loss = dsr_paper_loss(x, d)
    assert loss.item() == pytest.approx(want)
    loss.backward()  # the target is detached: d/dx mean (x - t)^2 = 2 (x - t) / 4
    assert x.grad.flatten().tolist() == pytest.approx([2 * (0.6 - 6.0) / 4, 0.0, 2 * (1.0 - 10.0) / 4, 0.0])
    # PD: KL(softmax(h) || softmax(z)), the encoder's distribution first, temperature 1
    h = torch.tensor([[1.0, 0.0]], requires_grad=True)
    z = torch.tensor([[0.0, 2.0]], requires_grad=True)
    p = [math.exp(1) / (math.exp(1) + 1), 1 / (math.exp(1) + 1)]
    q = [1 / (1 + math.exp(2)), math.exp(2) / (1 + math.exp(2))]
    kl = sum(pi * math.log(pi / qi) for pi, qi in zip(p, q))
    out = pd_paper_loss(h, z)
    assert out.item() == pytest.approx(kl, rel=1e-6)
    out.backward()
    assert h.grad.abs().sum() > 0 and z.grad.abs().sum() > 0  # both sides learn, as in the code's form
    with pytest.raises(ValueError, match="d must be"):
        dsr_paper_loss(x.detach(), torch.ones(3))
