"""Representation metrics against hand-computed values (METHODS.md "Metrics")."""

from __future__ import annotations

import math

import numpy as np
import pytest

from splitedge.methods.metrics.representation import alignment, effective_rank, uniformity


def test_effective_rank_is_one_on_a_line_and_d_when_isotropic() -> None:
    rng = np.random.default_rng(0)
    line = rng.normal(size=(200, 1)) * rng.normal(size=(1, 16))
    assert effective_rank(line) == pytest.approx(1.0, abs=1e-6)
    # singular values (3, 1) after centring -> p = (0.75, 0.25) -> exp(H)
    x = np.array([[3.0, 0.0], [-3.0, 0.0], [0.0, 1.0], [0.0, -1.0]]) / math.sqrt(2)
    h = -(0.75 * math.log(0.75) + 0.25 * math.log(0.25))
    assert effective_rank(x) == pytest.approx(math.exp(h), rel=1e-12)
    # an orthogonal design (equal singular values in 8 dimensions): exactly 8
    q, _ = np.linalg.qr(rng.normal(size=(64, 8)))
    assert effective_rank(np.vstack([q, -q])) == pytest.approx(8.0, rel=1e-9)
    assert effective_rank(np.ones((5, 3))) == 1.0
    with pytest.raises(ValueError):
        effective_rank(np.ones(3))


def test_alignment_and_uniformity_hand_computed() -> None:
    a = np.array([[1.0, 0.0], [0.0, 2.0]])
    b = np.array([[0.0, 3.0], [0.0, 1.0]])
    # normalised: a = e1, e2; b = e2, e2 -> squared distances 2 and 0 -> mean 1
    assert alignment(a, b) == pytest.approx(1.0)
    # two orthogonal unit vectors: ||x - y||^2 = 2 -> log exp(-2 * 2) = -4
    assert uniformity(np.eye(2)) == pytest.approx(-4.0)
    # three points at 120 degrees: each pair at squared distance 3 -> -6
    tri = np.array([[1.0, 0.0], [-0.5, math.sqrt(3) / 2], [-0.5, -math.sqrt(3) / 2]])
    assert uniformity(tri) == pytest.approx(-6.0)
