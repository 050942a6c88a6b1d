"""Moments: exact merge (property test), streaming stability, wire-body round trip."""
from __future__ import annotations

import numpy as np
import pytest

from splitedge.methods.moments import (ClassMoments, MomentAccumulator, compute_moments, merge_moments,
                             moments_from_body, moments_to_body)

RTOL = 1e-9


def numpy_moments(x: np.ndarray, y: np.ndarray) -> ClassMoments:
    """Reference: per-class np.mean / np.var(ddof=1), var 0 for a single sample."""
    classes = np.unique(y)
    mean = np.stack([x[y == c].mean(axis=0) for c in classes])
    var = np.stack([x[y == c].var(axis=0, ddof=1) if (y == c).sum() > 1 else np.zeros(x.shape[1])
                    for c in classes])
    return ClassMoments(classes, np.array([(y == c).sum() for c in classes]), mean, var)


def assert_same(a: ClassMoments, b: ClassMoments, rtol: float = RTOL) -> None:
    np.testing.assert_array_equal(a.classes, b.classes)
    np.testing.assert_array_equal(a.counts, b.counts)
    np.testing.assert_allclose(a.mean, b.mean, rtol=rtol, atol=1e-12)
    np.testing.assert_allclose(a.var, b.var, rtol=rtol, atol=1e-12)


def make_data(rng: np.random.Generator, n: int = 300, d: int = 5) -> tuple[np.ndarray, np.ndarray]:
    """Classes of very different sizes, including a singleton class (7)."""
    y = np.concatenate([rng.integers(0, 5, n - 3), [5, 5, 7]])
    loc = rng.uniform(-50, 50, size=(8, d))
    x = loc[y] + rng.normal(size=(n, d)) * rng.uniform(0.1, 5, size=d)
    return x, y


def random_parts(rng: np.random.Generator, y: np.ndarray, n_parts: int) -> list[np.ndarray]:
    """Random assignment to parts; the last part also receives exactly one sample of class 0."""
    owner = rng.integers(0, max(n_parts - 1, 1), size=len(y))
    if n_parts > 1:
        owner[rng.choice(np.flatnonzero(y == 0))] = n_parts - 1
    return [np.flatnonzero(owner == k) for k in range(n_parts)]


@pytest.mark.parametrize("seed", range(6))
def test_merge_of_any_split_equals_whole(seed: int) -> None:
    rng = np.random.default_rng(seed)
    x, y = make_data(rng)
    whole = numpy_moments(x, y)
    for n_parts in range(1, 8):
        parts = [compute_moments(x[i], y[i]) for i in random_parts(rng, y, n_parts)]
        if n_parts > 1:
            assert parts[-1].counts[parts[-1].classes == 0][0] == 1  # a part with n=1 for a class
        assert_same(merge_moments(parts), whole)


@pytest.mark.parametrize("seed", range(3))
def test_two_level_merge_equals_whole(seed: int) -> None:
    rng = np.random.default_rng(100 + seed)
    x, y = make_data(rng, n=400)
    device_idx = random_parts(rng, y, 12)
    devices = [compute_moments(x[i], y[i]) for i in device_idx]
    edges = [merge_moments(devices[k:k + 4]) for k in range(0, 12, 4)]
    assert_same(merge_moments(edges), numpy_moments(x, y))


def test_parts_missing_classes() -> None:
    rng = np.random.default_rng(7)
    x, y = make_data(rng)
    parts = [compute_moments(x[y == c], y[y == c]) for c in np.unique(y)]  # one class per part
    assert_same(merge_moments(parts[::-1]), numpy_moments(x, y))


@pytest.mark.parametrize("batch", [1, 3, 17])
def test_streaming_tiny_batches_equals_one_shot(batch: int) -> None:
    rng = np.random.default_rng(batch)
    x, y = make_data(rng, n=200)
    batches = [(x[s:s + batch].astype(np.float32 if s % 2 else np.float64), y[s:s + batch])
               for s in range(0, len(y), batch)]  # any float dtype is accepted
    acc = MomentAccumulator(x.shape[1])
    for xb, yb in batches:
        acc.add(xb, yb)
    got = acc.result()
    assert np.all(np.diff(got.classes) > 0)
    assert_same(got, numpy_moments(np.concatenate([b[0].astype(np.float64) for b in batches]), y))


def test_large_mean_offset_stays_accurate() -> None:
    rng = np.random.default_rng(0)
    y = rng.integers(0, 3, 5000)
    x = 1e6 + rng.normal(size=(5000, 4))
    acc = MomentAccumulator(4)
    for s in range(0, 5000, 7):
        acc.add(x[s:s + 7], y[s:s + 7])
    ref = numpy_moments(x, y)
    np.testing.assert_allclose(acc.result().var, ref.var, rtol=1e-7)
    halves = [compute_moments(x[:2500], y[:2500]), compute_moments(x[2500:], y[2500:])]
    np.testing.assert_allclose(merge_moments(halves).var, ref.var, rtol=1e-7)


def test_body_round_trip() -> None:
    rng = np.random.default_rng(3)
    m = compute_moments(*make_data(rng))
    body = moments_to_body(m, dtype="f8", space="we", versions={"wc": 2, "we": 1})
    assert body["mean"].dtype == np.dtype("<f8") and body["classes"].dtype == np.dtype("<i8")
    assert (body["versions"], body["space"]) == ({"wc": 2, "we": 1}, "we")
    assert_same(moments_from_body(body), m, rtol=0)
    back = moments_from_body(moments_to_body(m, dtype="f4"))
    assert back.mean.dtype == np.float64
    assert_same(back, m, rtol=1e-6)
    assert moments_to_body(m, dtype="f2")["var"].dtype == np.dtype("<f2")


def test_validation_errors() -> None:
    m = compute_moments(np.ones((3, 2)), np.array([0, 0, 1]))
    np.testing.assert_array_equal(m.var, 0.0)
    with pytest.raises(ValueError):
        ClassMoments(np.array([0, 1]), np.array([1]), np.zeros((2, 2)), np.zeros((2, 2)))
    with pytest.raises(ValueError):
        ClassMoments(np.array([0, 0]), np.array([1, 1]), np.zeros((2, 2)), np.zeros((2, 2)))
    with pytest.raises(ValueError):
        MomentAccumulator(2).add(np.ones((3, 3)), np.zeros(3, dtype=int))
    with pytest.raises(ValueError):
        merge_moments([m, compute_moments(np.ones((1, 3)), np.array([0]))])
    with pytest.raises(ValueError):
        moments_to_body(ClassMoments(m.classes, m.counts, m.mean + 1e6, m.var), dtype="f2")
    with pytest.raises(ValueError):
        moments_from_body({"classes": m.classes, "counts": m.counts, "mean": m.mean})
