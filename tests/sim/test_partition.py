"""Partitions: exact coverage, min_size, skew grows as alpha shrinks, seeded determinism."""
from __future__ import annotations

import numpy as np
import pytest

from splitedge.methods.data.partition import apply_feature_skew, dirichlet, dirichlet_per_device, feature_skew, iid

LABELS = np.repeat(np.arange(10), 200)  # 2000 samples, 10 balanced classes


def assert_covers_once(parts: list[np.ndarray], n: int) -> None:
    allidx = np.concatenate(parts)
    assert len(allidx) == n
    np.testing.assert_array_equal(np.sort(allidx), np.arange(n))


def mean_label_entropy(parts: list[np.ndarray], labels: np.ndarray) -> float:
    ent = []
    for p in parts:
        q = np.bincount(labels[p], minlength=10) / len(p)
        ent.append(-(q[q > 0] * np.log(q[q > 0])).sum())
    return float(np.mean(ent))


def test_iid_covers_once_and_balanced() -> None:
    parts = iid(LABELS, 7, np.random.default_rng(0))
    assert_covers_once(parts, len(LABELS))
    assert max(map(len, parts)) - min(map(len, parts)) <= 1


@pytest.mark.parametrize("alpha", [0.1, 0.5, 100.0])
def test_dirichlet_covers_once_and_min_size(alpha: float) -> None:
    parts = dirichlet(LABELS, 20, alpha, np.random.default_rng(1), min_size=10)
    assert_covers_once(parts, len(LABELS))
    assert min(map(len, parts)) >= 10


def test_small_alpha_is_more_skewed() -> None:
    rng = np.random.default_rng(2)
    skewed = mean_label_entropy(dirichlet(LABELS, 10, 0.1, rng), LABELS)
    flat = mean_label_entropy(dirichlet(LABELS, 10, 100.0, rng), LABELS)
    assert skewed < 1.2 < 2.1 < flat <= np.log(10)


def test_seeded_determinism() -> None:
    for split in (lambda r: iid(LABELS, 5, r), lambda r: dirichlet(LABELS, 5, 0.3, r)):
        a, b = split(np.random.default_rng(3)), split(np.random.default_rng(3))
        assert all(np.array_equal(p, q) for p, q in zip(a, b))
    assert feature_skew(6, np.random.default_rng(3)) == feature_skew(6, np.random.default_rng(3))


@pytest.mark.parametrize("parts", [7, 300])
def test_per_device_dirichlet_splits_many_parts_evenly_and_skews_with_alpha(parts: int) -> None:
    # 300 parts of 2,000 samples: what NIID-Bench's per-class draw cannot do (below)
    split = dirichlet_per_device(LABELS, parts, 0.3, np.random.default_rng(4))
    assert_covers_once(split, len(LABELS))
    assert max(map(len, split)) - min(map(len, split)) <= 1
    skewed = mean_label_entropy(split, LABELS)
    flat = mean_label_entropy(dirichlet_per_device(LABELS, parts, 100.0, np.random.default_rng(4)), LABELS)
    assert skewed < 0.8 * flat
    again = dirichlet_per_device(LABELS, parts, 0.3, np.random.default_rng(4))
    assert all(np.array_equal(p, q) for p, q in zip(split, again))


def test_impossible_min_size_raises() -> None:
    with pytest.raises(ValueError):
        dirichlet(LABELS, 300, 0.5, np.random.default_rng(0), min_size=10)
    with pytest.raises(ValueError):
        iid(LABELS[:3], 4, np.random.default_rng(0))


def test_feature_skew_params_and_apply() -> None:
    params = feature_skew(8, np.random.default_rng(4), max_shift=0.1)
    assert sorted(p.rotation_k for p in params) == [0, 0, 1, 1, 2, 2, 3, 3]
    assert all(abs(s) <= 25.5 for p in params for s in p.colour_shift)
    x = np.random.default_rng(5).integers(0, 256, (3, 4, 4, 3), dtype=np.uint8)
    p = params[0]
    out = apply_feature_skew(x, p)
    ref = np.clip(np.rint(np.rot90(x, p.rotation_k, axes=(1, 2)) + np.array(p.colour_shift)), 0, 255)
    assert out.dtype == np.uint8 and out.shape == x.shape
    np.testing.assert_array_equal(out, ref.astype(np.uint8))
    assert apply_feature_skew(x[..., :1], p).shape == (3, 4, 4, 1)
