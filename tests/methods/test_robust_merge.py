"""Robust merges of per-class moments (H-SFP `robust` option): bit-identical exact merge by
default, little change on clean data, bounded damage from one device with a mean shifted by 1e3."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from splitedge.methods.hsfp.config import HSFPConfig
from splitedge.methods.moments import (ROBUST_MERGES, ClassMoments, compute_moments, merge_moments,
                                       robust_merge)

D = 12


def devices(seed: int, n_devices: int = 8, d: int = D) -> list[ClassMoments]:
    """Moments of devices drawing the same class-conditional Gaussians (unit variance, class c
    centred at 3c), with label skew: each device holds a random subset of its classes' samples."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n_devices):
        n = int(rng.integers(40, 200))
        y = rng.choice(4, size=n, p=rng.dirichlet(np.full(4, 1.0)))
        x = rng.normal(size=(n, d)) + 3.0 * y[:, None]
        out.append(compute_moments(x, y))
    return out


def shifted(m: ClassMoments, by: float) -> ClassMoments:
    return ClassMoments(m.classes, m.counts, m.mean + by, m.var)


def gap(a: ClassMoments, b: ClassMoments) -> float:
    """Largest L2 distance between the two merges' class means, in units of the class's std."""
    np.testing.assert_array_equal(a.classes, b.classes)
    std = np.sqrt(b.var.sum(axis=1))
    return float(np.max(np.sqrt(np.square(a.mean - b.mean).sum(axis=1)) / std))


@pytest.mark.parametrize("seed", range(3))
def test_none_is_the_exact_merge_bit_for_bit(seed: int) -> None:
    parts = devices(seed)
    exact, none = merge_moments(parts), robust_merge(parts, "none")
    assert exact.mean.tobytes() == none.mean.tobytes() and exact.var.tobytes() == none.var.tobytes()
    np.testing.assert_array_equal(exact.counts, none.counts)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("how", ROBUST_MERGES)
def test_on_clean_data_a_robust_merge_changes_little(seed: int, how: str) -> None:
    parts = devices(seed)
    exact = merge_moments(parts)
    got = robust_merge(parts, how, reference=robust_merge(parts, how))
    np.testing.assert_array_equal(got.counts, exact.counts)  # counts stay the exact sums
    assert gap(got, exact) < 0.25
    ratio = got.var.sum(axis=1) / exact.var.sum(axis=1)  # a class's total variance
    assert np.all((ratio > 0.8) & (ratio < 1.25)), ratio
    np.testing.assert_allclose(got.var, exact.var, rtol=0.5)
    if how == "clip":  # nothing lies beyond 2 std on clean data: the merge is the exact one
        assert got.mean.tobytes() == exact.mean.tobytes()


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("reference", ["none", "last merge"])
def test_one_device_shifted_by_1e3_moves_only_the_exact_merge(seed: int, reference: str) -> None:
    parts = devices(seed)
    clean = merge_moments(parts[1:])
    poisoned = [shifted(parts[0], 1e3), *parts[1:]]
    # Assert: the exact merge follows the rogue ...
    assert gap(robust_merge(poisoned, "none"), clean) > 20
    share = max(float(n) / float(clean.counts[clean.classes == c][0] + n)
                for c, n in zip(parts[0].classes.tolist(), parts[0].counts.tolist()))  # the rogue's largest weight
    for how in ("clip", "trimmed", "median"):
        ref = robust_merge(parts[1:], how) if reference == "last merge" else None
        got = robust_merge(poisoned, how, reference=ref)
        # ... a robust merge stays within a fraction of a class's std of the clean devices' merge; a
        # clipped rogue still pulls by up to clip_k (2) stds times its share of the class's count
        assert gap(got, clean) < (2 * share + 0.15 if how == "clip" else 0.6), how
        assert np.all(got.var < 3 * clean.var + 1.0), how  # no 1e6 between-device variance either


def test_a_device_with_a_huge_variance_is_contained() -> None:
    parts = devices(5)
    wide = ClassMoments(parts[0].classes, parts[0].counts, parts[0].mean, parts[0].var * 1e12)
    clean = merge_moments(parts[1:])
    assert np.max(robust_merge([wide, *parts[1:]], "none").var) > 1e9
    for how in ("clip", "trimmed", "median"):
        got = robust_merge([wide, *parts[1:]], how)
        assert np.max(got.var / clean.var) < 5, how


def test_two_sources_of_a_class_merge_exactly_under_trimming() -> None:
    """With two sources nothing tells the outlier apart: trimmed and median merge them exactly."""
    a, b = devices(1, n_devices=2)
    exact = merge_moments([a, b])
    for how in ("trimmed", "median"):
        np.testing.assert_allclose(robust_merge([a, b], how).mean, exact.mean, rtol=1e-12)
        np.testing.assert_allclose(robust_merge([a, b], how).var, exact.var, rtol=1e-9)


def test_clip_without_a_reference_variance_does_not_clip() -> None:
    """A reference class seen once (var 0) gives no scale: the parts merge exactly."""
    one = compute_moments(np.ones((1, D)), np.array([0]))
    parts = [compute_moments(np.random.default_rng(1).normal(size=(5, D)), np.zeros(5, np.int64)), one]
    got = robust_merge(parts, "clip", reference=one)
    assert got.mean.tobytes() == merge_moments(parts).mean.tobytes()


def test_the_config_names_the_merge() -> None:
    assert HSFPConfig().robust == "clip" and HSFPConfig(secagg="full").robust == "none"  # auto
    assert HSFPConfig(robust="median").robust == "median"
    for bad in ({"robust": "mean"}, {"robust_trim": 0.5}, {"robust_clip_k": 0.0}):
        with pytest.raises(ValueError, match="robust"):
            HSFPConfig(**bad)
    with pytest.raises(ValueError, match="robust merge must be one of"):
        robust_merge(devices(0), "mean")


# -- properties --------------------------------------------------------------------------

@st.composite
def federations(draw: st.DrawFn) -> list[ClassMoments]:
    """2-7 sources over classes 0-3 with random counts, means and variances."""
    m = draw(st.integers(2, 7))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    d = draw(st.integers(1, 5))
    out = []
    for _ in range(m):
        classes = np.flatnonzero(rng.random(4) < 0.7)
        if len(classes) == 0:
            classes = np.array([int(rng.integers(4))])
        k = len(classes)
        out.append(ClassMoments(classes, rng.integers(1, 50, k), rng.normal(scale=rng.uniform(0.1, 100), size=(k, d)),
                                rng.uniform(0, 10, size=(k, d)) * (rng.random((k, 1)) < 0.9)))
    return out


def _within_source_range(parts: list[ClassMoments], got: ClassMoments) -> None:
    for j, c in enumerate(got.classes.tolist()):
        means = np.stack([p.mean[p.classes == c][0] for p in parts if c in p.classes])
        assert np.all(got.mean[j] >= means.min(axis=0) - 1e-9 * (1 + np.abs(means).max()))
        assert np.all(got.mean[j] <= means.max(axis=0) + 1e-9 * (1 + np.abs(means).max()))


@settings(max_examples=60, deadline=None)
@given(federations(), st.sampled_from(ROBUST_MERGES))
def test_every_merge_keeps_counts_and_stays_inside_the_sources(parts: list[ClassMoments], how: str) -> None:
    exact = merge_moments(parts)
    got = robust_merge(parts, how)
    np.testing.assert_array_equal(got.classes, exact.classes)
    np.testing.assert_array_equal(got.counts, exact.counts)
    assert np.all(np.isfinite(got.mean)) and np.all(got.var >= 0)
    _within_source_range(parts, got)  # a coordinate-wise merge never leaves the sources' range


@settings(max_examples=60, deadline=None)
@given(federations(), st.sampled_from(ROBUST_MERGES), st.floats(-1e3, 1e3), st.randoms(use_true_random=False))
def test_merges_are_order_free_and_move_with_a_common_shift(parts: list[ClassMoments], how: str, shift: float,
                                                             rnd) -> None:
    base = robust_merge(parts, how)
    order = list(parts)
    rnd.shuffle(order)
    tol = 1e-9 * (1 + np.abs(base.mean).max() + abs(shift))
    np.testing.assert_allclose(robust_merge(order, how).mean, base.mean, atol=tol)
    moved = robust_merge([shifted(p, shift) for p in parts], how)
    np.testing.assert_allclose(moved.mean, base.mean + shift, atol=tol)
    np.testing.assert_allclose(moved.var, base.var, atol=1e-6 * (1 + base.var.max()) + 1e-6 * shift**2)


@settings(max_examples=60, deadline=None)
@given(federations(), st.floats(0.5, 4.0))
def test_clipped_means_stay_within_k_reference_stds(parts: list[ClassMoments], k: float) -> None:
    """Each clipped part lies inside the ball, so their count-weighted mean does too."""
    reference = merge_moments(parts[:1])
    got = robust_merge(parts, "clip", reference=reference, clip_k=k)
    for j, c in enumerate(got.classes.tolist()):
        if c not in reference.classes:
            continue
        r = int(np.flatnonzero(reference.classes == c)[0])
        spread = reference.var[r].sum()
        if spread > 0:
            dist = np.sqrt(np.square(got.mean[j] - reference.mean[r]).sum())
            assert dist <= k * np.sqrt(spread) * (1 + 1e-9)


@settings(max_examples=40, deadline=None)
@given(federations())
def test_trimming_nothing_is_the_exact_merge(parts: list[ClassMoments]) -> None:
    exact = merge_moments(parts)
    got = robust_merge(parts, "trimmed", trim=0.0)
    scale = 1 + np.abs(exact.mean).max()
    np.testing.assert_allclose(got.mean, exact.mean, atol=1e-9 * scale)
    np.testing.assert_allclose(got.var, exact.var, rtol=1e-7, atol=1e-7 * scale**2)


@settings(max_examples=40, deadline=None)
@given(federations(), st.floats(1e2, 1e9))
def test_one_outlier_among_three_or_more_cannot_leave_the_others_range(parts: list[ClassMoments], by: float) -> None:
    """Median and trimmed drop at least one source at each end once three hold a class."""
    rogue = shifted(parts[0], by)
    honest = parts[1:]
    for how in ("trimmed", "median"):
        got = robust_merge([rogue, *honest], how)
        for j, c in enumerate(got.classes.tolist()):
            held = [p for p in honest if c in p.classes]
            if len(held) < 2 or c not in rogue.classes:
                continue  # a class only the rogue and one other hold cannot be told apart
            means = np.stack([p.mean[p.classes == c][0] for p in held])
            eps = 1e-9 * (1 + np.abs(means).max())
            assert np.all(got.mean[j] <= means.max(axis=0) + eps), how


def test_a_reference_variance_that_is_only_round_off_clips_nothing() -> None:
    """The median source of a class has variance 0; after a common shift of 1e3 the merge's
    arithmetic left 1e-10 of it, and the clip pulled every source onto the centre (found by
    the shift property above)."""
    def one(n: int, mu: float, v: float) -> ClassMoments:
        return ClassMoments(np.array([1]), np.array([n]), np.array([[mu]]), np.array([[v]]))

    parts = [(41, 2.1738352, 6.46212476), (30, 14.70419699, 0.0), (24, -0.30747534, 0.0)]
    base = robust_merge([one(*p) for p in parts], "clip")
    for shift in (48.0, 1e3):
        moved = robust_merge([one(n, mu + shift, v) for n, mu, v in parts], "clip")
        np.testing.assert_allclose(moved.mean - shift, base.mean, atol=1e-9 * (1 + shift))


def test_the_default_rule_is_clip_and_the_exact_merge_says_so_once(caplog) -> None:
    """robust=auto is clip, or none under secagg (an edge sees only its devices' sum); a run that
    chooses the exact merge says once what it gives up (issue 57, item 4)."""
    from splitedge.cloud.options import EXACT_MERGE, build_run_config
    from splitedge.methods.data.datasets import load_dataset

    _, _, info = load_dataset("digits", None, max_train=100, max_test=50)
    with caplog.at_level("WARNING", logger="splitedge.cloud.options"):
        assert build_run_config("fedavg", info, None, 0, {}).method.robust == "clip"
        assert build_run_config("hsfp", info, None, 0, {"secagg": "full"}).method.robust == "none"
        assert not caplog.records
        assert build_run_config("hsfp", info, None, 0, {"robust": "none"}).method.robust == "none"
    assert [r.getMessage() for r in caplog.records] == [EXACT_MERGE]
