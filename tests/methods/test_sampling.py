"""Gaussian feature sampling: per-class allocation, convergence to the moments, reproducibility."""
from __future__ import annotations

import numpy as np
import pytest

from splitedge.methods.moments import ClassMoments
from splitedge.methods.hsfp.sampling import allocate_counts, sample_features


def moments(counts: list[int], d: int = 4, seed: int = 0) -> ClassMoments:
    rng = np.random.default_rng(seed)
    k = len(counts)
    return ClassMoments(np.arange(k) * 2 + 1, np.array(counts), rng.uniform(-3, 3, (k, d)),
                        rng.uniform(0.2, 4.0, (k, d)))


def test_allocation_sums_to_total_before_floor_and_cap() -> None:
    per = allocate_counts(np.array([333, 333, 334]), 100, floor=0)
    assert per.sum() == 100 and per.tolist() == [33, 33, 34]
    per = allocate_counts(np.array([1, 1, 1]), 10, floor=0)
    assert per.sum() == 10 and per.tolist() == [4, 3, 3]  # ties go to the lower class index


def test_floor_and_cap() -> None:
    per = allocate_counts(np.array([1, 1000]), 100, floor=8)
    assert per.tolist() == [8, 100]  # rare class lifted to the floor, so the sum exceeds total
    per = allocate_counts(np.array([1, 1000]), 100, floor=8, cap=50)
    assert per.tolist() == [8, 50]
    with pytest.raises(ValueError):
        allocate_counts(np.array([1]), 10, floor=8, cap=4)


def test_labels_follow_allocation_and_are_shuffled() -> None:
    m = moments([10, 300, 90])
    x, y = sample_features(m, 400, np.random.default_rng(1), floor=0)
    assert x.shape == (400, 4) and x.dtype == np.float32 and y.dtype == np.int64
    assert np.bincount(y, minlength=6)[[1, 3, 5]].tolist() == [10, 300, 90]
    assert not np.all(np.diff(y) >= 0)


def test_sample_moments_converge() -> None:
    m = moments([1, 1], d=3)
    x, y = sample_features(m, 40_000, np.random.default_rng(2), dtype=np.float64)
    for k, c in enumerate(m.classes):
        xc = x[y == c]
        np.testing.assert_allclose(xc.mean(axis=0), m.mean[k], atol=4 * np.sqrt(m.var[k].max() / len(xc)))
        np.testing.assert_allclose(xc.var(axis=0, ddof=1), m.var[k] + 1e-5, rtol=0.05)


def test_mean_only_has_almost_no_spread() -> None:
    m = moments([5, 5])
    x, y = sample_features(m, 2000, np.random.default_rng(3), mean_only=True)
    for k, c in enumerate(m.classes):
        assert np.abs(x[y == c] - m.mean[k]).max() < 0.03  # only the sqrt(eps) jitter remains
        assert x[y == c].std(axis=0).max() < 5e-3


def test_seeded_reproducible_and_chunk_boundaries(monkeypatch: pytest.MonkeyPatch) -> None:
    import splitedge.methods.hsfp.sampling as sampling

    m = moments([3, 7, 11])
    a = sample_features(m, 500, np.random.default_rng(4))
    b = sample_features(m, 500, np.random.default_rng(4))
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])
    monkeypatch.setattr(sampling, "CHUNK_ELEMENTS", 7)  # many tiny chunks: rows still complete
    x, y = sampling.sample_features(m, 500, np.random.default_rng(4))
    assert x.shape == (500, 4) and np.isfinite(x).all()
    np.testing.assert_array_equal(y, a[1])


def test_empty_moments() -> None:
    x, y = sample_features(ClassMoments.empty(6), 100, np.random.default_rng(0))
    assert x.shape == (0, 6) and y.shape == (0,)


def test_class_balanced_draws_every_class_alike() -> None:
    m = moments([10, 300, 90])
    _, y = sample_features(m, 300, np.random.default_rng(5), floor=0, balance=True)
    assert np.bincount(y, minlength=6)[[1, 3, 5]].tolist() == [100, 100, 100]


def test_mixture_keeps_each_sources_mode_and_its_share() -> None:
    """Two devices hold class 1 at means -5 and +5 (tiny spread): the merged Gaussian is one wide
    blob around 0, the mixture two tight modes drawn 1:3 like the counts."""
    from splitedge.methods.moments import merge_moments

    a = ClassMoments(np.array([1]), np.array([100]), np.full((1, 2), -5.0), np.full((1, 2), 0.01))
    b = ClassMoments(np.array([1, 3]), np.array([300, 50]), np.array([[5.0, 5.0], [0.0, 1.0]]),
                     np.full((2, 2), 0.01))
    merged = merge_moments([a, b])
    plain, _ = sample_features(merged, 4000, np.random.default_rng(6), floor=0)
    mix, y = sample_features(merged, 4000, np.random.default_rng(6), floor=0, parts=[a, b], shrink=0.0)
    ones = mix[y == 1, 0]
    assert np.abs(np.abs(ones) - 5).max() < 0.6  # every sample sits at a source's mode
    assert (ones > 0).mean() == pytest.approx(0.75, abs=0.03)
    assert np.abs(plain[y == 1, 0]).min() < 1.0  # the merged Gaussian puts samples between them
    np.testing.assert_allclose(mix[y == 3].mean(axis=0), [0.0, 1.0], atol=0.05)
    wide, yw = sample_features(merged, 4000, np.random.default_rng(6), floor=0, parts=[a, b], shrink=1.0)
    assert wide[yw == 1, 0].std() > 4.5  # shrink 1: each component takes the merged variance
    with pytest.raises(ValueError, match="class 3"):
        sample_features(merged, 100, np.random.default_rng(0), parts=[a])


def test_moments_without_undoes_a_merge() -> None:
    from splitedge.methods.moments import compute_moments, merge_moments, moments_without

    rng = np.random.default_rng(7)
    xa, ya = rng.normal(3, 2, (300, 5)), rng.integers(0, 3, 300)
    xb, yb = rng.normal(-1, 1, (200, 5)), rng.integers(1, 5, 200)
    a, b = compute_moments(xa, ya), compute_moments(xb, yb)
    rest = moments_without(merge_moments([a, b]), a)
    assert rest.classes.tolist() == b.classes.tolist() and rest.counts.tolist() == b.counts.tolist()
    np.testing.assert_allclose(rest.mean, b.mean, atol=1e-9)
    np.testing.assert_allclose(rest.var, b.var, rtol=1e-8)
    assert moments_without(a, a) is None
    with pytest.raises(ValueError):
        moments_without(a, b)  # b holds classes a does not
