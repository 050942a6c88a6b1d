"""The representation report: probe, kNN and spectrum against hand values and planted structure,
and the whole report on a tiny synthetic split (METHODS.md "Metrics")."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from splitedge.methods.metrics.report import knn_accuracy, linear_probe, plot_spectra, representation_report
from splitedge.methods.metrics.representation import spectrum
from splitedge.methods.metrics.representation import effective_rank


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def blobs(seed: int, n: int, classes: int = 4, dim: int = 16, spread: float = 10.0) -> tuple[np.ndarray, np.ndarray]:
    """Gaussian blobs whose centres are far apart: linearly separable features."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(classes, dim)) * spread
    y = rng.integers(0, classes, n)
    return centres[y] + rng.normal(size=(n, dim)), y


def test_linear_probe_separates_blobs_stays_at_chance_on_random_labels_and_is_deterministic() -> None:
    # Prepare
    x, y = blobs(0, 800)
    rng = np.random.default_rng(1)
    noise, random_y = rng.normal(size=(600, 16)), rng.integers(0, 4, 600)
    # Execute
    separable = linear_probe(x[:400], y[:400], x[400:], y[400:], num_classes=4, seed=3)
    again = linear_probe(x[:400], y[:400], x[400:], y[400:], num_classes=4, seed=3)
    chance = linear_probe(noise[:200], random_y[:200], noise[200:], random_y[200:], num_classes=4, epochs=50)
    # Assert
    assert separable > 0.95
    assert again == separable
    assert chance < 0.5


def test_linear_probe_rejects_labels_outside_the_classes() -> None:
    x, y = blobs(0, 20)
    with pytest.raises(ValueError, match="labels must lie in"):
        linear_probe(x, y, x, y, num_classes=2)


def _knn_case() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Unit vectors (one train point scaled by 5: cosine similarity ignores length).
    Query (1, 0): similarities 1 (class 0), 0.8, 0.8 (class 1), -1 (class 0); true label 1.
    Query (-1, 0): similarities -1, -0.8, -0.8, 1 (class 0); true label 0."""
    train_x = np.array([[5.0, 0.0], [0.8, 0.6], [0.8, -0.6], [-1.0, 0.0]])
    train_y = np.array([0, 1, 1, 0])
    return train_x, train_y, np.array([[1.0, 0.0], [-1.0, 0.0]]), np.array([1, 0])


@pytest.mark.parametrize("k, temperature, expected", [
    (1, 0.1, 0.5),  # each query takes its nearest point: (0, 0)
    (2, 0.1, 0.5),  # query 1: exp(1/T) for class 0 beats exp(0.8/T) for class 1 at any T
    # k=3, query 1: class 0 gets exp(1/T), class 1 gets 2 exp(0.8/T); class 1 wins iff T > 0.2/ln 2 = 0.289
    (3, 0.1, 0.5),  # exp(10) = 22026 > 2 exp(8) = 5962
    (3, 0.5, 1.0),  # exp(2) = 7.39 < 2 exp(1.6) = 9.91
])
def test_knn_hand_computed_with_temperature_weighting(k: int, temperature: float, expected: float) -> None:
    # Prepare
    train_x, train_y, test_x, test_y = _knn_case()
    # Execute
    acc = knn_accuracy(train_x, train_y, test_x, test_y, num_classes=2, k=k, temperature=temperature)
    # Assert (query 2 always gets class 0: exp(1/T) against 2 exp(-0.8/T))
    assert acc == expected


def test_knn_separates_blobs_whatever_the_chunk() -> None:
    x, y = blobs(2, 600)
    whole = knn_accuracy(x[:300], y[:300], x[300:], y[300:], num_classes=4)
    chunked = knn_accuracy(x[:300], y[:300], x[300:], y[300:], num_classes=4, chunk=7)
    assert whole > 0.95
    assert chunked == whole


def test_spectrum_is_a_sorted_distribution_whose_entropy_is_the_effective_rank() -> None:
    # Prepare
    rng = np.random.default_rng(4)
    x = rng.normal(size=(60, 8)) * np.linspace(0.1, 3.0, 8)
    line = rng.normal(size=(50, 1)) * rng.normal(size=(1, 6))
    # Execute
    p, p_line, p_const = spectrum(x), spectrum(line), spectrum(np.ones((5, 3)))
    # Assert
    assert p.sum() == pytest.approx(1.0, abs=1e-12)
    assert np.all(np.diff(p) <= 0)
    assert p_line[0] == pytest.approx(1.0) and np.all(p_line[1:] < 1e-8)
    assert math.exp(-(p * np.log(p)).sum()) == pytest.approx(effective_rank(x), rel=1e-12)
    assert p_const.tolist() == [1.0, 0.0, 0.0]  # all-equal features: effective rank 1


def quadrant_images(seed: int, n: int = 200) -> tuple[np.ndarray, np.ndarray]:
    """8x8x1 uint8 images whose label (0..3) is the quadrant that is bright: linearly readable."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 4, n)
    x = rng.integers(0, 60, size=(n, 8, 8, 1))
    for i, label in enumerate(y):
        r, c = divmod(int(label), 2)
        x[i, 4 * r:4 * r + 4, 4 * c:4 * c + 4] += 150
    return x.astype(np.uint8), y.astype(np.int64)


def linear_encoder(seed: int, dim: int = 16):
    w = np.random.default_rng(seed).normal(size=(64, dim))
    return lambda images: (images.reshape(len(images), -1) / 255.0) @ w


def noisy_views(encode, seed: int):
    def views(images: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        rng = np.random.default_rng(seed)
        jitter = lambda: np.clip(images + rng.integers(-8, 9, images.shape), 0, 255).astype(np.uint8)  # noqa: E731
        return encode(jitter()), encode(jitter())

    return views


def test_report_of_a_random_linear_encoder_has_every_value_and_counts() -> None:
    # Prepare
    test = quadrant_images(5)
    encode = linear_encoder(6)
    # Execute
    report = representation_report(encode, test, num_classes=4, views=noisy_views(encode, 7), seed=1, probe_epochs=30)
    again = representation_report(encode, test, num_classes=4, views=noisy_views(encode, 7), seed=1, probe_epochs=30)
    # Assert
    assert set(report) == {"probe_accuracy", "knn_accuracy", "alignment", "uniformity", "effective_rank",
                           "spectrum", "probe_samples", "eval_samples"}
    scalars = [v for key, v in report.items() if key != "spectrum"]
    assert all(math.isfinite(v) for v in scalars + report["spectrum"])
    assert report["probe_samples"] + report["eval_samples"] == 200 and report["probe_samples"] == 100
    assert report["probe_accuracy"] > 0.9 and report["knn_accuracy"] > 0.9
    assert 0.0 <= report["alignment"] < 0.1 and report["uniformity"] < 0.0
    assert len(report["spectrum"]) == 16 and sum(report["spectrum"]) == pytest.approx(1.0)
    assert again == report


def test_report_of_a_collapsed_encoder_has_rank_one_and_chance_accuracy() -> None:
    # Prepare
    images, y = quadrant_images(8)
    # Execute
    report = representation_report(lambda im: np.ones((len(im), 16)), (images, y), num_classes=4, probe_epochs=20)
    # Assert
    assert "alignment" not in report
    assert report["effective_rank"] == 1.0
    assert report["probe_accuracy"] < 0.4
    assert report["spectrum"][0] == 1.0


def test_report_rejects_an_encoder_that_drops_rows() -> None:
    images, y = quadrant_images(9, n=10)
    with pytest.raises(ValueError, match="encode must map 10 images"):
        representation_report(lambda im: np.ones((len(im) - 1, 4)), (images, y), num_classes=4)


def test_plot_spectra_writes_a_png(tmp_path) -> None:
    # Prepare
    curves = {"random": spectrum(np.random.default_rng(10).normal(size=(40, 6))), "collapsed": [1.0, 0.0, 0.0]}
    # Execute
    path = plot_spectra(curves, tmp_path / "spectra.png", title="two encoders")
    # Assert
    data = path.read_bytes()
    assert len(data) > 1000 and data[:8] == b"\x89PNG\r\n\x1a\n"
