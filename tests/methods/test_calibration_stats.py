"""Head statistics for calibration (methods/calibration/stats.py): exact streaming and merging,
the wire record in both covariance forms and its checks, and the closed-form classifier."""

from __future__ import annotations

import numpy as np
import pytest

from splitedge.methods.calibration.lda import lda_classifier
from splitedge.methods.calibration.stats import (
    HeadStatsAccumulator, check_head_stats, head_stats_arrays, head_stats_from_arrays, merge_head_stats,
)
from splitedge.protocol.errors import ProtocolError


def _data(seed: int = 0, n: int = 600, dim: int = 6, classes: int = 4, offset: float = 50.0):
    rng = np.random.default_rng(seed)
    y = rng.integers(0, classes, n)
    centres = rng.normal(0, 3, (classes, dim)) + offset  # far from zero: precision matters
    mix = rng.normal(0, 1, (dim, dim))
    x = centres[y] + rng.normal(0, 1, (n, dim)) @ mix
    return x, y


def _direct(x, y):
    classes = np.unique(y)
    mean = np.stack([x[y == c].mean(0) for c in classes])
    centred = x - mean[np.searchsorted(classes, y)]
    return classes, mean, centred.T @ centred / len(y)


def test_streamed_batches_equal_the_one_shot_statistics() -> None:
    x, y = _data()
    acc = HeadStatsAccumulator(x.shape[1])
    for start in range(0, len(y), 37):  # batches that miss classes now and then
        acc.add(x[start:start + 37], y[start:start + 37])
    s = acc.result()
    classes, mean, cov = _direct(x, y)
    np.testing.assert_array_equal(s.classes, classes)
    assert s.counts.tolist() == [int((y == c).sum()) for c in classes]
    np.testing.assert_allclose(s.mean, mean, rtol=1e-12)
    np.testing.assert_allclose(s.cov, cov, rtol=1e-9, atol=1e-9)


def test_merging_devices_equals_pooling_their_data() -> None:
    x, y = _data(1)
    cuts = [0, 50, 260, 600]  # unequal devices; the first holds few classes
    parts = []
    for a, b in zip(cuts, cuts[1:]):
        acc = HeadStatsAccumulator(x.shape[1])
        acc.add(x[a:b], y[a:b])
        parts.append(acc.result())
    merged = merge_head_stats(parts)
    classes, mean, cov = _direct(x, y)
    np.testing.assert_allclose(merged.mean, mean, rtol=1e-12)
    np.testing.assert_allclose(merged.cov, cov, rtol=1e-9, atol=1e-9)
    assert merged.total == len(y)


@pytest.mark.parametrize("dtype", ["f2", "f4"])
def test_the_wire_record_round_trips_and_passes_its_checks(dtype: str) -> None:
    x, y = _data(2, offset=0.0)
    acc = HeadStatsAccumulator(x.shape[1])
    acc.add(x, y)
    s = acc.result()
    arrays = head_stats_arrays(s, dtype)
    assert arrays["cov"].shape == (21,)  # upper triangle of 6 x 6
    check_head_stats(arrays, dim=6, num_classes=4, dtype=dtype)
    back = head_stats_from_arrays(arrays)
    tol = 2e-3 if dtype == "f2" else 1e-6
    np.testing.assert_allclose(back.cov, s.cov, rtol=tol, atol=tol * np.abs(s.cov).max())
    np.testing.assert_array_equal(back.cov, back.cov.T)


def _good() -> dict:
    x, y = _data(3, offset=0.0)
    acc = HeadStatsAccumulator(x.shape[1])
    acc.add(x, y)
    return head_stats_arrays(acc.result(), "f4")


@pytest.mark.parametrize("mutate, rule", [
    (lambda a: a.pop("cov"), "state.arrays"),
    (lambda a: a.update(extra=np.zeros(1, "<f4")), "state.arrays"),
    (lambda a: a.update(mean=a["mean"][:, :5].copy()), "state.dim"),
    (lambda a: a.update(cov=a["cov"][:-1].copy()), "state.dim"),
    (lambda a: a.update(classes=np.array([0, 1, 2, 9], "<i8")), "state.classes"),
    (lambda a: a.update(classes=np.array([0, 1, 1, 2], "<i8")), "state.classes"),
    (lambda a: a.update(counts=np.array([5, 0, 5, 5], "<i8")), "state.counts"),
    (lambda a: a.update(mean=a["mean"].astype("<f2")), "state.dtype"),
    (lambda a: a["cov"].__setitem__(0, -1.0), "state.range"),
])
def test_a_record_that_does_not_fit_the_federation_is_refused_with_its_rule(mutate, rule: str) -> None:
    arrays = _good()
    mutate(arrays)
    with pytest.raises(ProtocolError) as err:
        check_head_stats(arrays, dim=6, num_classes=4, dtype="f4")
    assert err.value.rule == rule


def test_the_closed_form_classifier_agrees_with_sklearn_lda() -> None:
    from sklearn.discriminant_analysis import LinearDiscriminantAnalysis

    x, y = _data(4, n=2000, classes=5)
    acc = HeadStatsAccumulator(x.shape[1])
    acc.add(x, y)
    weight, bias = lda_classifier(acc.result(), 7, shrink=1e-6)  # classes 5 and 6 held by nobody
    ours = np.argmax(x @ weight.T + bias, axis=1)
    theirs = LinearDiscriminantAnalysis(solver="lsqr").fit(x, y).predict(x)
    assert (ours == theirs).mean() > 0.995
    assert (ours == y).mean() > 0.8 and not np.isin(ours, [5, 6]).any()
    assert np.all(weight[5:] == 0) and np.all(bias[5:] < -1e3)


def test_the_diagonal_form_carries_d_values_and_a_diagonal_classifier() -> None:
    x, y = _data(5, offset=0.0)
    acc = HeadStatsAccumulator(x.shape[1])
    acc.add(x, y)
    s = acc.result()
    arrays = head_stats_arrays(s, "f4", cov="diag")
    assert arrays["cov"].shape == (6,)
    check_head_stats(arrays, dim=6, num_classes=4, dtype="f4", cov="diag")
    with pytest.raises(ProtocolError) as err:  # a full record where the run says diagonal, and back
        check_head_stats(head_stats_arrays(s, "f4"), dim=6, num_classes=4, dtype="f4", cov="diag")
    assert err.value.rule == "state.dim"
    back = head_stats_from_arrays(arrays)
    np.testing.assert_allclose(np.diag(back.cov), np.diag(s.cov), rtol=1e-6)
    assert np.count_nonzero(back.cov - np.diag(np.diag(back.cov))) == 0


def _devices(n_devices: int = 7, seed: int = 6) -> list:
    """Head statistics of devices holding slices of one data set (each holds every class)."""
    x, y = _data(seed, n=2100, classes=4, offset=0.0)
    parts = []
    for idx in np.array_split(np.arange(len(y)), n_devices):
        acc = HeadStatsAccumulator(x.shape[1])
        acc.add(x[idx], y[idx])
        parts.append(acc.result())
    return parts, x, y


def _scaled(s, mean: float = 50.0, cov: float = 1e3):
    from splitedge.methods.calibration.stats import HeadStats

    return HeadStats(s.classes, s.counts, s.mean * mean, s.cov * cov)


def test_robust_none_is_the_exact_merge_bit_for_bit() -> None:
    from splitedge.methods.calibration.robust import robust_head_merge

    parts, _, _ = _devices()
    exact, none = merge_head_stats(parts), robust_head_merge(parts, "none")
    assert np.array_equal(exact.mean, none.mean) and np.array_equal(exact.cov, none.cov)


@pytest.mark.parametrize("how", ["clip", "trimmed", "median"])
def test_a_scaled_device_moves_the_robust_head_little_and_the_exact_one_far(how: str) -> None:
    from splitedge.methods.calibration.robust import robust_head_merge

    # Prepare: seven honest devices, then the same with device 3 scaling its record
    parts, x, y = _devices()
    clean = merge_head_stats(parts)
    poisoned = [*parts[:3], _scaled(parts[3]), *parts[4:]]

    def accuracy(s) -> float:
        w, b = lda_classifier(s, 4)
        return float((np.argmax(x @ w.T + b, axis=1) == y).mean())

    # Execute
    exact, robust = merge_head_stats(poisoned), robust_head_merge(poisoned, how)
    honest = robust_head_merge(parts, how)
    # Assert: the exact merge follows the rogue; the robust one stays near the clean statistics
    # and classifies as well (honest devices alone: the robust rule costs little)
    scale = np.abs(clean.mean).max()
    assert np.abs(exact.mean - clean.mean).max() > 2 * scale
    assert np.abs(robust.mean - clean.mean).max() < 0.5 * scale, np.abs(robust.mean - clean.mean).max()
    assert np.trace(robust.cov) < 3 * np.trace(clean.cov) < np.trace(exact.cov) / 10
    assert accuracy(robust) > accuracy(clean) - 0.05 > accuracy(exact), (accuracy(robust), accuracy(clean), accuracy(exact))
    assert accuracy(honest) > accuracy(clean) - 0.02
    assert robust.counts.tolist() == clean.counts.tolist()  # counts stay exact sums


def test_a_unit_constant_within_every_class_has_a_variance_of_zero_not_below() -> None:
    """A dead ReLU (a unit 0 for every image) or any unit constant within each class: the scatter
    minus the class means' outer products left -1e-17 on its diagonal, which every receiver
    refuses (state.range); it is 0, with its row and column."""
    from splitedge.methods.calibration.stats import HeadStatsAccumulator

    rng = np.random.default_rng(0)
    x = rng.normal(size=(300, 5)) * 3 + 40.0
    y = np.arange(300) % 3
    x[:, 2] = 0.0  # dead
    x[:, 4] = np.array([0.1, 7.3, 1e3])[y]  # constant within each class, far apart between them
    acc = HeadStatsAccumulator(5)
    for i in range(0, 300, 7):
        acc.add(x[i:i + 7], y[i:i + 7])
    s = acc.result()
    assert (np.diagonal(s.cov) >= 0).all() and s.cov[2, 2] == 0 and s.cov[4, 4] < 1e-9
    assert not s.cov[2].any()
    want = sum(np.cov(x[y == c].T, bias=True) * (y == c).sum() for c in range(3)) / 300
    np.testing.assert_allclose(s.cov, want, atol=1e-9)
