"""Gaussian feature sampling: per-class allocation, convergence to the moments, reproducibility."""
from __future__ import annotations

import numpy as np
import pytest

from splitedge.methods.moments import ClassMoments
from splitedge.methods.sampling import allocate_counts, sample_features


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
    import splitedge.methods.sampling as sampling

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
