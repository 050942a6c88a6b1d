"""The edge merge at its floor (issue 58, item 3): moments of a narrower wire dtype are held as
they came and accumulated in float64 without copies, and every result is the one the plain
formula of 52b8928 gave (the same float64 operations in the same order: to the bit)."""
from __future__ import annotations

import numpy as np
import pytest

from splitedge.methods.moments import (ClassMoments, merge_moments, moments_from_body, moments_to_body,
                                       moments_without, robust_merge)


def old_merge(parts: list[ClassMoments]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """merge_moments of 52b8928, verbatim, on float64 copies of the parts."""
    dim = parts[0].dim
    p_classes = [p.classes for p in parts]
    p_counts = [p.counts for p in parts]
    p_mean = [np.asarray(p.raw_mean, dtype=np.float64) for p in parts]  # what ClassMoments held then
    p_var = [np.asarray(p.raw_var, dtype=np.float64) for p in parts]
    classes = np.unique(np.concatenate(p_classes))
    n = np.zeros(len(classes), dtype=np.int64)
    for c, k in zip(p_classes, p_counts):
        n[np.searchsorted(classes, c)] += k
    mean = np.zeros((len(classes), dim))
    for c, k, mu in zip(p_classes, p_counts, p_mean):
        idx = np.searchsorted(classes, c)
        mean[idx] += mu * (k / n[idx])[:, None]
    m2 = np.zeros((len(classes), dim))
    for c, k, mu, v in zip(p_classes, p_counts, p_mean, p_var):
        idx = np.searchsorted(classes, c)
        m2[idx] += (k - 1)[:, None] * v + k[:, None] * np.square(mu - mean[idx])
    denom = np.maximum(n - 1, 1)[:, None].astype(np.float64)
    return classes, n, mean, np.where(n[:, None] > 1, np.maximum(m2, 0.0) / denom, 0.0)


def device_bodies(rng: np.random.Generator, devices: int, dim: int, dtype: str, num_classes: int = 10) -> list[dict]:
    """Device bodies of the wire dtype: classes missing on some devices (one device has none,
    one has its classes out of order), single-sample classes (variance 0), means far from 0."""
    bodies = []
    for d in range(devices):
        held = np.sort(rng.choice(num_classes, size=int(rng.integers(1, num_classes + 1)), replace=False))
        if d == 1:
            held = held[::-1].copy()
        if d == 2:
            held = held[:0]
        counts = rng.integers(1, 80, len(held))
        counts[rng.random(len(held)) < 0.25] = 1
        mean = rng.normal(size=(len(held), dim)) * rng.uniform(0.1, 3) + rng.uniform(-40, 40, size=(len(held), 1))
        var = rng.random((len(held), dim)) * rng.uniform(0.01, 4)
        var[counts == 1] = 0.0
        bodies.append(moments_to_body(ClassMoments(held, counts, mean, var), dtype=dtype))
    return bodies


def as_tuple(m: ClassMoments) -> tuple[np.ndarray, ...]:
    return m.classes, m.counts, m.mean, m.var


@pytest.mark.parametrize("dtype", ["f4", "f2", "f8"])
@pytest.mark.parametrize("seed", range(6))
def test_merge_equals_the_old_formula(dtype: str, seed: int) -> None:
    rng = np.random.default_rng(seed)
    parts = [moments_from_body(b) for b in device_bodies(rng, int(rng.integers(1, 9)), int(rng.integers(1, 70)), dtype)]
    got, want = merge_moments(parts), old_merge(parts)
    for g, w in zip(as_tuple(got), want):
        assert g.dtype == w.dtype
        np.testing.assert_allclose(g, w, rtol=1e-15, atol=0)  # to float64 rounding ...
        assert np.array_equal(g, w)  # ... and in fact to the bit: the same operations in the same order
    assert (got.var[got.counts == 1] == 0).all()
    # robust_merge "none" is the merge itself
    assert all(np.array_equal(a, b) for a, b in zip(as_tuple(robust_merge(parts, "none")), want))


def test_single_sample_and_one_device() -> None:
    one = moments_from_body(moments_to_body(ClassMoments([3], [1], np.full((1, 4), 2.5), np.zeros((1, 4))), "f4"))
    m = merge_moments([one])
    assert m.counts.tolist() == [1] and (m.var == 0).all() and (m.mean == 2.5).all()
    two = merge_moments([one, one])  # two single samples at the same point: variance 0, count 2
    assert two.counts.tolist() == [2] and (two.var == 0).all()


def test_wire_arrays_are_held_not_copied() -> None:
    body = device_bodies(np.random.default_rng(0), 1, 16, "f4")[0]
    m = moments_from_body(body)
    assert m.raw_mean is body["mean"] and m.raw_var is body["var"]  # no per-message float64 copy
    assert m.mean.dtype == np.float64 and m.var.dtype == np.float64 and m.dim == 16
    np.testing.assert_array_equal(m.mean, body["mean"].astype(np.float64))
    wide = ClassMoments(m.classes, m.counts, m.mean, m.var)
    assert wide.raw_mean.dtype == np.float64 and wide.mean is wide.raw_mean
    again = moments_to_body(m, dtype="f4")  # back on the wire unchanged
    assert np.array_equal(again["mean"], body["mean"]) and again["mean"].dtype == np.dtype("<f4")


@pytest.mark.parametrize("how", ["none", "clip", "trimmed", "median"])
def test_robust_merges_same_on_held_and_widened(how: str) -> None:
    """Every merge rule gives the same result on parts held as f4 as on their float64 copies."""
    rng = np.random.default_rng(7)
    held = [moments_from_body(b) for b in device_bodies(rng, 7, 12, "f4")]
    wide = [ClassMoments(p.classes, p.counts, p.mean, p.var) for p in held]
    reference = merge_moments(wide[:3])
    a = robust_merge(held, how, reference=reference, clip_k=0.5)
    b = robust_merge(wide, how, reference=reference, clip_k=0.5)
    assert all(np.array_equal(x, y) for x, y in zip(as_tuple(a), as_tuple(b)))
    rest_a, rest_b = moments_without(merge_moments(held), held[0]), moments_without(merge_moments(wide), wide[0])
    assert all(np.array_equal(x, y) for x, y in zip(as_tuple(rest_a), as_tuple(rest_b)))


def test_float64_overflow_still_refused() -> None:
    big = ClassMoments([0], [2], np.full((1, 3), 1e200), np.zeros((1, 3)))
    small = ClassMoments([0], [2], np.full((1, 3), -1e200), np.zeros((1, 3)))
    with pytest.raises(ValueError, match="finite"), np.errstate(over="ignore"):
        merge_moments([big, small])
    with pytest.raises(ValueError, match="finite"):
        ClassMoments([0], [1], np.full((1, 2), np.inf, dtype=np.float32), np.zeros((1, 2), np.float32))
    with pytest.raises(ValueError, match="unique"):
        ClassMoments([1, 1], [1, 1], np.zeros((2, 2), np.float32), np.zeros((2, 2), np.float32))
    with pytest.raises(ValueError, match="counts"):
        ClassMoments([0, 1], [1, 0], np.zeros((2, 2), np.float32), np.zeros((2, 2), np.float32))


def test_bench_merge_paths_agree() -> None:
    """bench merge: the floor, the edge's path and (where the history is here) 52b8928's agree to the bit."""
    from splitedge.bench import merge as bench

    s = bench.MergeSettings(counts=(3,), dim=32, repeats=1, min_cpu=0.0)
    bodies = bench.decoded_bodies(5, s)
    floor = bench.floor_path(s)(bodies)
    from splitedge.methods import moments

    assert bench.same(bench.edge_path(moments, s)(bodies), floor)
    try:
        old = bench.module_at(bench.BEFORE)
    except ValueError:
        pytest.skip("the checkout holds no 52b8928")
    assert bench.same(bench.edge_path(old, s)(bodies), floor)
    config, results = bench.run(bench.MergeSettings(counts=(2,), dim=16, repeats=1, min_cpu=0.0, before=bench.BEFORE))
    row = results["rows"][0]
    assert row["identical"] == {"splitedge": True, "before": True} and set(row["ratio"]) == {"splitedge", "before"}
    assert "| 2 |" in bench.markdown(results)


def test_bench_merge_suite_from_the_command_line(tmp_path) -> None:
    """`splitedge bench merge` is a registered suite: JSON and markdown with the ratio to the floor."""
    import json

    from splitedge.cli import main

    assert main(["bench", "merge", "--quick", "--counts", "2", "--dims", "16", "--out", str(tmp_path), "--no-plots"]) == 0
    doc = json.loads((tmp_path / "merge.json").read_text())
    assert doc["command"].startswith("splitedge bench merge --quick") and "--counts 2 --dims 16" in doc["command"]
    assert "--dataset" not in doc["command"]  # only the options the suite reads
    row = doc["results"]["rows"][0]
    assert row["messages"] == 2 and row["identical"] == {"splitedge": True} and row["ratio"]["splitedge"] > 0
    assert "splitedge / floor (CPU)" in (tmp_path / "merge.md").read_text()
