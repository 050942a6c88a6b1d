"""Differential privacy of device releases (methods/privacy/dp.py) and its accountant."""

from __future__ import annotations

import json
import logging
import math
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from splitedge.methods.calibration.stats import HeadStatsAccumulator
from splitedge.methods.moments import ClassMoments, compute_moments
from splitedge.methods.privacy import dp

K, D = 4, 3
finite = st.floats(-1e6, 1e6, allow_nan=False, allow_infinity=False)


def _scaled_query(acc: dp.ClippedSums) -> np.ndarray:
    """The concatenation the mechanism noises, each part divided by its sensitivity."""
    return np.concatenate([np.ravel(q) / s for q, s in acc.parts()])


@settings(max_examples=150, deadline=None)
@given(data=hnp.arrays(np.float64, st.tuples(st.integers(0, 12), st.just(D)), elements=finite),
       labels=st.lists(st.integers(0, K - 1), min_size=12, max_size=12),
       extra=hnp.arrays(np.float64, D, elements=finite), extra_label=st.integers(0, K - 1),
       clip=st.floats(0.01, 100.0), second=st.sampled_from(dp.SECONDS))
def test_one_image_moves_the_query_by_at_most_the_sensitivity(data, labels, extra, extra_label, clip, second):
    # Prepare: the same data with and without one more image (any feature vector, any class)
    y = np.array(labels[:len(data)], dtype=np.int64)
    without, with_ = dp.ClippedSums(D, K, clip, second), dp.ClippedSums(D, K, clip, second)
    without.add(data, y)
    with_.add(np.vstack([data, extra]), np.append(y, extra_label))
    # Execute
    moved = np.linalg.norm(_scaled_query(with_) - _scaled_query(without))
    # Assert
    assert moved <= math.sqrt(len(without.parts())) * (1 + 1e-9)


def test_noise_scale_matches_sigma():
    # Prepare
    rng = np.random.default_rng(7)
    acc = dp.ClippedSums(20, 10, clip=3.0, second="class")
    acc.add(rng.normal(size=(50, 20)), rng.integers(0, 10, 50))
    sigma, draws = 0.7, 300
    # Execute
    noise = [[r - q for r, (q, _) in zip(dp.gaussian_mechanism(acc.parts(), sigma, rng), acc.parts())]
             for _ in range(draws)]
    # Assert: part i gets sd sigma sqrt(3) Delta_i
    for i, sens in enumerate((1.0, 3.0, 9.0)):
        sd = np.std(np.concatenate([np.ravel(n[i]) for n in noise]))
        assert sd == pytest.approx(sigma * math.sqrt(3) * sens, rel=0.05)


def test_weight_noise_scale_and_clip():
    # Prepare
    rng = np.random.default_rng(3)
    start = {"w": np.zeros((40, 50), np.float32), "steps": np.array(7)}
    weights = {"w": np.full((40, 50), 2.0, np.float32), "steps": np.array(9)}
    # Execute
    clipped = dp.clip_update(weights, start, clip=1.5)
    sent = dp.dp_weights(weights, start, clip=1.5, sigma=0.5, rng=rng)
    # Assert
    assert np.linalg.norm(clipped["w"]) == pytest.approx(1.5)
    assert sent["w"].dtype == np.float32 and sent["steps"] == 7  # non-float entries are start's
    noise = sent["w"].astype(np.float64) - clipped["w"]
    assert np.std(noise) == pytest.approx(0.5 * 2 * 1.5, rel=0.05)


def test_no_noise_and_no_clipping_gives_the_exact_statistics():
    # Prepare
    rng = np.random.default_rng(1)
    x = rng.normal(0.5, 2.0, size=(300, 6))
    y = rng.integers(0, 5, 300)
    y[y == 3] = 2  # class 3 of 0..6 held by nobody: not released
    # Execute
    m = dp.dp_moments(x, y, 7, clip=1e6, sigma=0.0)
    h = dp.dp_head_stats(x, y, 7, clip=1e6, sigma=0.0)
    classes, counts, means = dp.dp_class_means(x, y, 7, clip=1e6, sigma=0.0)
    # Assert
    want = compute_moments(x, y)
    assert np.array_equal(m.classes, want.classes) and np.array_equal(m.counts, want.counts)
    np.testing.assert_allclose(m.mean, want.mean, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(m.var, want.var, rtol=1e-9, atol=1e-12)
    acc = HeadStatsAccumulator(6)
    acc.add(x, y)
    exact = acc.result()
    assert np.array_equal(h.classes, exact.classes) and np.array_equal(h.counts, exact.counts)
    np.testing.assert_allclose(h.cov, exact.cov, rtol=1e-9, atol=1e-12)
    assert np.array_equal(classes, want.classes) and np.array_equal(counts, want.counts)
    np.testing.assert_allclose(means, want.mean, rtol=1e-12, atol=1e-12)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(0, 40), sigma=st.floats(0.0, 20.0), clip=st.floats(0.01, 50.0),
       scale=st.floats(1e-3, 1e3), keep_sd=st.floats(0.0, 4.0), seed=st.integers(0, 2**32 - 1))
def test_noisy_statistics_are_always_valid(n, sigma, clip, scale, keep_sd, seed):
    # Prepare
    rng = np.random.default_rng(seed)
    x, y = rng.normal(0, scale, size=(n, 5)), rng.integers(0, 6, n)
    # Execute
    m = dp.dp_moments(x, y, 6, clip=clip, sigma=sigma, rng=rng, keep_sd=keep_sd)
    h = dp.dp_head_stats(x, y, 6, clip=clip, sigma=sigma, rng=rng, keep_sd=keep_sd)
    hd = dp.dp_head_stats(x, y, 6, clip=clip, sigma=sigma, rng=rng, cov="diag", keep_sd=keep_sd)
    classes, counts, means = dp.dp_class_means(x, y, 6, clip=clip, sigma=sigma, rng=rng, keep_sd=keep_sd)
    # Assert: ClassMoments validates itself (finite, var >= 0, counts >= 1, unique classes)
    assert isinstance(m, ClassMoments) and ((m.var >= 0) & (m.var <= clip ** 2 * (1 + 1e-9))).all()
    for mean in (m.mean, h.mean, hd.mean, means):
        assert np.isfinite(mean).all() and (np.linalg.norm(mean, axis=1) <= clip * (1 + 1e-9)).all()
    for c in (m.counts, h.counts, hd.counts, counts):
        assert (c >= 1).all()
    for s in (h, hd):
        assert np.isfinite(s.cov).all() and np.allclose(s.cov, s.cov.T)
        assert np.linalg.eigvalsh(s.cov).min() >= -1e-9 * max(1.0, clip ** 2)
    assert set(m.classes.tolist()) <= set(range(6)) and set(classes.tolist()) <= set(range(6))


def test_absent_classes_are_released_as_noise_and_mostly_dropped():
    # Prepare: a device holding class 0 only, of a 200-class federation
    rng = np.random.default_rng(5)
    x, y = rng.normal(size=(100, 4)), np.zeros(100, np.int64)
    # Execute
    m = dp.dp_moments(x, y, 200, clip=3.0, sigma=1.0, rng=rng)
    # Assert: class 0 kept; about 2.3 % of the 199 absent ones survive the noisy-count rule
    assert 0 in m.classes and len(m.classes) - 1 <= 15


# -- the accountant ----------------------------------------------------------------------------

def _analytic_epsilon(sigma: float, delta: float) -> float:
    """Balle & Wang (2018), Theorem 8: the Gaussian mechanism of sensitivity 1 and sd sigma is
    (eps, delta)-DP iff Phi(1/(2 sigma) - eps sigma) - e^eps Phi(-1/(2 sigma) - eps sigma) <= delta."""
    phi = lambda t: 0.5 * math.erfc(-t / math.sqrt(2))  # noqa: E731
    gap = lambda e: phi(1 / (2 * sigma) - e * sigma) - math.exp(e) * phi(-1 / (2 * sigma) - e * sigma) - delta  # noqa: E731
    lo, hi = 0.0, 1.0
    while gap(hi) > 0:
        lo, hi = hi, 2 * hi
    for _ in range(100):
        lo, hi = ((lo + hi) / 2, hi) if gap((lo + hi) / 2) > 0 else (lo, (lo + hi) / 2)
    return hi


@pytest.fixture(scope="module")
def accountant():
    pytest.importorskip("dp_accounting")
    from splitedge.methods.privacy import accountant

    return accountant


def test_epsilon_falls_with_sigma_and_grows_with_releases(accountant):
    grid = [[accountant.epsilon(s, r, 1e-5) for r in (1, 10, 50)] for s in (0.5, 1.0, 2.0, 4.0)]
    for row in grid:
        assert row == sorted(row) and len(set(row)) == 3
    for col in zip(*grid):
        assert list(col) == sorted(col, reverse=True)
    assert accountant.epsilon(1.0, 0) == 0.0 and accountant.epsilon(0.0, 3) == math.inf


@pytest.mark.parametrize("sigma", [0.8, 2.0, 5.0])
def test_one_release_matches_the_analytic_gaussian_mechanism(accountant, sigma):
    exact = _analytic_epsilon(sigma, 1e-5)
    assert accountant.epsilon(sigma, 1, 1e-5, method="pld") == pytest.approx(exact, rel=0.01)
    rdp = accountant.epsilon(sigma, 1, 1e-5, method="rdp")
    assert exact <= rdp <= 1.3 * exact  # RDP is an upper bound, a little loose


def test_composition_matches_the_analytic_form(accountant):
    # R Gaussians of multiplier sigma are exactly one of multiplier sigma / sqrt(R)
    exact = _analytic_epsilon(2.0 / math.sqrt(4), 1e-5)
    assert accountant.epsilon(2.0, 4, 1e-5, method="pld") == pytest.approx(exact, rel=0.01)


@pytest.mark.parametrize("target,releases", [(4.0, 1), (4.0, 50), (0.5, 10)])
def test_sigma_for_epsilon_round_trips(accountant, target, releases):
    sigma = accountant.sigma_for_epsilon(target, releases, 1e-5)
    assert accountant.epsilon(sigma, releases, 1e-5) <= target
    assert accountant.epsilon(sigma * 0.995, releases, 1e-5) > target


def test_ledger_composes_what_was_sent(accountant):
    ledger = accountant.Ledger()
    for r in range(1, 11):
        ledger.record(r, 2.0)
        if r % 5 == 0:
            ledger.record(r, 4.0)
    assert ledger.epsilon(round_=1) == pytest.approx(accountant.epsilon(2.0, 1))
    assert accountant.epsilon(2.0, 10) < ledger.epsilon() < accountant.epsilon(2.0, 12)
    assert accountant.releases(10, 5, offset=1) == 2 and accountant.releases(10, 4, last=True) == 3


def test_accountant_without_dp_accounting_says_what_to_install(monkeypatch):
    from splitedge.methods.privacy import accountant

    monkeypatch.setitem(sys.modules, "dp_accounting", None)
    with pytest.raises(ImportError, match="pip install"):
        accountant.epsilon(1.0, 1)


# In the manner of tests/thin/test_thin_imports.py: the device side stays torch-free (and needs no
# dp-accounting), checked in a fresh interpreter.
_THIN_DP = """
import json, sys
import numpy as np
from splitedge.methods.privacy import dp
rng = np.random.default_rng(0)
x, y = rng.normal(size=(30, 8)), np.arange(30) % 3
dp.dp_moments(x, y, 5, clip=2.0, sigma=1.0, rng=rng)
dp.dp_head_stats(x, y, 5, clip=2.0, sigma=1.0, rng=rng)
dp.dp_weights({"w": np.ones(3)}, {"w": np.zeros(3)}, clip=1.0, sigma=1.0, rng=rng)
print(json.dumps([m for m in ("torch", "torchvision", "dp_accounting") if m in sys.modules]))
"""


def test_dp_does_not_import_torch():
    proc = subprocess.run([sys.executable, "-c", _THIN_DP], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == []


def test_a_diverged_update_fails_the_round_in_one_logged_line(caplog):
    """Local training that diverged under DP noise: clip_update refuses the non-finite update
    with RoundFailed, which a node logs as one line (no traceback) and counts."""
    from splitedge.methods.contract import RoundFailed
    from splitedge.protocol.codec import Envelope
    from splitedge.runtime.node import Node

    start = {"w": np.zeros(4, np.float32)}
    with pytest.raises(RoundFailed, match="diverged"):
        dp.clip_update({"w": np.array([1, np.inf, 0, 0], np.float32)}, start, clip=1.0)

    class Diverging(Node):
        def handle(self, topic_: str, env: Envelope) -> None:
            dp.dp_weights({"w": np.full(4, np.nan, np.float32)}, start, clip=1.0, sigma=1.0,
                          rng=np.random.default_rng(0))

    node = Diverging(run="r", tier="device", node_id="d0")
    with caplog.at_level(logging.ERROR, logger="splitedge.runtime.node"):
        node.dispatch(("t", Envelope(kind="round", run="r", round=3, sender="e0", body={})))
    assert node.errors == 1 and not node.busy
    (record,) = caplog.records
    assert record.exc_info is None and "device d0: handling round from e0 failed: local training diverged" \
        in record.getMessage()


def test_features_that_diverged_fail_the_round_in_one_line() -> None:
    """A W_c whose output is not finite (local training diverged) fails the device's round with
    RoundFailed, in the clear statistics and in the clipped sums a DP release is made from."""
    from splitedge.methods.contract import RoundFailed
    from splitedge.methods.moments import MomentAccumulator

    x, y = np.array([[1.0, np.nan], [0.0, 1.0]]), np.array([0, 1])
    with pytest.raises(RoundFailed, match="not finite"):
        MomentAccumulator(2).add(x, y)
    with pytest.raises(RoundFailed, match="not finite"):
        dp.ClippedSums(2, 2, clip=1.0).add(x, y)
