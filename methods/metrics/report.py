"""What a learned representation is worth, measured on a labelled split (METHODS.md "Metrics").

The self-supervised methods never see labels while training, so their accuracy on the test
split says nothing; what they are worth is what a cheap classifier can read off their frozen
features. `representation_report` gives that for one encoder on "the real test split": the split
is cut, with a seeded permutation, into halves A and B; the linear probe and the kNN classifier
are fitted on A's features and scored on B's (so no test image is both fitted and scored), and
alignment, uniformity, effective rank and the spectrum use the whole split. The cloud calls it
every few rounds and the bench calls it on the final encoder, so both report the same numbers.

numpy at import time; torch is imported only by the linear probe and matplotlib only by the
plot, so the kNN and the spectrum run where neither is installed.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import numpy as np

from splitedge.methods.metrics.representation import alignment, effective_rank, normalise, spectrum, uniformity

if TYPE_CHECKING:
    import torch

Encode = Callable[[np.ndarray], np.ndarray]
Views = Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]]


def _check_labelled(x: np.ndarray, y: np.ndarray, num_classes: int, what: str) -> None:
    """A caller's mismatched or out-of-range input is a bug: name it instead of mis-scoring."""
    if x.ndim != 2 or len(x) == 0 or len(x) != len(y):
        raise ValueError(f"{what}: need features [N >= 1, D] and N labels, got {x.shape} and {len(y)} labels")
    if y.min() < 0 or y.max() >= num_classes:
        raise ValueError(f"{what}: labels must lie in [0, {num_classes}), got [{y.min()}, {y.max()}]")


def standardise(train_x: np.ndarray, test_x: np.ndarray, eps: float = 1e-8) -> tuple[np.ndarray, np.ndarray]:
    """Both sets z-scored with the train set's per-column mean and std.

    Encoders differ in feature scale by orders of magnitude (raw pooled ReLU features vs
    normalised ones), and one fixed Adam lr over a fixed number of epochs converges equally far
    only on unit-scale inputs; so the probe measures the representation, not its scale. Train
    statistics only, so nothing about the scored half leaks into the fit. A constant column
    (std 0) becomes 0 instead of dividing by zero.
    """
    mean = train_x.mean(axis=0)
    std = np.maximum(train_x.std(axis=0), eps)
    return (train_x - mean) / std, (test_x - mean) / std


def linear_probe(train_x: np.ndarray, train_y: np.ndarray, test_x: np.ndarray, test_y: np.ndarray, *,
                 num_classes: int, epochs: int = 100, lr: float = 3e-3, batch: int = 256, seed: int = 0) -> float:
    """Top-1 accuracy on the test features of a linear layer trained on the train features.

    Features are precomputed (the encoder is frozen), standardised with the train statistics
    (see `standardise`), then `epochs` shuffled passes of Adam(lr) with cross-entropy through the
    project's training loop. The layer starts at zero, not at torch's random init: the problem
    is convex, so the start barely matters, and zeros keep the global torch RNG untouched.
    """
    import torch

    from splitedge.methods.metrics.evaluate import accuracy
    from splitedge.methods.torch_utils import tensor_batches
    from splitedge.methods.training import Batch, cross_entropy_term, train_epochs

    train_x, test_x = np.asarray(train_x, np.float64), np.asarray(test_x, np.float64)
    train_y, test_y = np.asarray(train_y, np.int64), np.asarray(test_y, np.int64)
    _check_labelled(train_x, train_y, num_classes, "linear probe train set")
    _check_labelled(test_x, test_y, num_classes, "linear probe test set")
    xtr, xte = (torch.from_numpy(a.astype(np.float32)) for a in standardise(train_x, test_x))
    layer = _zero_linear(xtr.shape[1], num_classes)
    opt = torch.optim.Adam(layer.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(seed)

    def forward(b: Batch) -> dict[str, torch.Tensor]:
        return {"logits": layer(b.x)}

    train_epochs(forward, [cross_entropy_term()], tensor_batches(xtr, torch.from_numpy(train_y), batch, gen),
                 opt, [layer], epochs=epochs)
    return accuracy(layer, xte, torch.from_numpy(test_y))


def _zero_linear(dim: int, num_classes: int) -> torch.nn.Linear:
    import torch

    layer = torch.nn.Linear(dim, num_classes)
    with torch.no_grad():
        layer.weight.zero_()
        layer.bias.zero_()
    return layer


def knn_accuracy(train_x: np.ndarray, train_y: np.ndarray, test_x: np.ndarray, test_y: np.ndarray, *,
                 num_classes: int, k: int = 20, temperature: float = 0.1, chunk: int = 512) -> float:
    """Top-1 accuracy of a cosine-similarity weighted kNN (InstDisc / DINO evaluation).

    Each test feature votes with its k most similar train features, each weighted by
    exp(similarity / temperature), and takes the class with the largest summed weight (ties: the
    lowest class index). No training and no hyper-parameters to tune beyond k and temperature,
    which is why it complements the probe. Test rows go `chunk` at a time, so memory is
    chunk x len(train) similarities, not the whole test x train matrix.
    """
    train_x, test_x = np.asarray(train_x, np.float64), np.asarray(test_x, np.float64)
    train_y, test_y = np.asarray(train_y, np.int64), np.asarray(test_y, np.int64)
    _check_labelled(train_x, train_y, num_classes, "kNN train set")
    _check_labelled(test_x, test_y, num_classes, "kNN test set")
    if k < 1 or temperature <= 0 or chunk < 1:
        raise ValueError(f"kNN needs k >= 1, temperature > 0 and chunk >= 1, got {k}, {temperature}, {chunk}")
    bank, queries = normalise(train_x), normalise(test_x)
    k = min(k, len(bank))
    correct = 0
    for start in range(0, len(queries), chunk):
        pred = _knn_votes(queries[start:start + chunk] @ bank.T, train_y, num_classes, k, temperature)
        correct += int((pred == test_y[start:start + chunk]).sum())
    return correct / len(test_y)


def _knn_votes(sim: np.ndarray, train_y: np.ndarray, num_classes: int, k: int, temperature: float) -> np.ndarray:
    """Predicted class per row of a [B, N_train] cosine-similarity block."""
    nearest = np.argpartition(-sim, k - 1, axis=1)[:, :k]
    weights = np.exp(np.take_along_axis(sim, nearest, axis=1) / temperature)
    scores = np.zeros((len(sim), num_classes))
    np.add.at(scores, (np.arange(len(sim))[:, None], train_y[nearest]), weights)
    return scores.argmax(axis=1)


def split_halves(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Indices of halves A (fit) and B (score) of an n-sample split, from a seeded permutation."""
    if n < 2:
        raise ValueError(f"a test split of {n} samples cannot be cut into a fit and a score half")
    order = np.random.default_rng(seed).permutation(n)
    return order[: n // 2], order[n // 2:]


def _features(values: np.ndarray, n: int, what: str) -> np.ndarray:
    """A caller's encoder output as float64 [n, D], checked to have one row per image."""
    features = np.asarray(values, dtype=np.float64)
    if features.ndim != 2 or len(features) != n:
        raise ValueError(f"{what} must map {n} images to features [{n}, D], got shape {features.shape}")
    return features


def representation_report(encode: Encode, test: tuple[np.ndarray, np.ndarray], *, num_classes: int,
                          views: Views | None = None, seed: int = 0, probe_epochs: int = 100,
                          uniformity_samples: int = 2000) -> dict[str, Any]:
    """Probe and kNN accuracy (fit on half A, scored on half B), alignment (if `views` is given),
    uniformity, effective rank and spectrum (whole split) of a frozen encoder, as plain values
    ready for a metrics line or a JSON document.

    `encode(images_uint8) -> [N, D]` and `views(images_uint8) -> (features of view 1, of view 2)`
    are the caller's (already batched, in eval mode). Uniformity is over all pairs, so it runs
    on a seeded subsample of at most `uniformity_samples` rows to keep it O(samples^2).
    """
    x, y = test
    y = np.asarray(y, dtype=np.int64)
    if len(x) != len(y):
        raise ValueError(f"test split has {len(x)} images but {len(y)} labels")
    a, b = split_halves(len(y), seed)
    features = _features(encode(x), len(y), "encode")
    out: dict[str, Any] = {
        "probe_accuracy": linear_probe(features[a], y[a], features[b], y[b], num_classes=num_classes,
                                       epochs=probe_epochs, seed=seed),
        "knn_accuracy": knn_accuracy(features[a], y[a], features[b], y[b], num_classes=num_classes),
    }
    if views is not None:
        first, second = views(x)
        out["alignment"] = alignment(_features(first, len(y), "views"), _features(second, len(y), "views"))
    sub = np.random.default_rng([seed, 1]).permutation(len(y))[:uniformity_samples]
    out.update(uniformity=uniformity(features[sub]), effective_rank=effective_rank(features),
               spectrum=[float(v) for v in spectrum(features)], probe_samples=len(a), eval_samples=len(b))
    return out


FLOOR = 1e-8
"""Normalised singular values below this are numerical zeros for the spectrum plot."""


def plot_spectra(curves: Mapping[str, Sequence[float]], path: Path, title: str = "") -> Path:
    """One line per named spectrum (e.g. per method or per round), log y, written to `path`.

    Values below FLOOR (directions a collapsed encoder does not use, and float round-off of
    zero: 1e-18 after an SVD) are left out rather than clipped: a log axis cannot show zeros,
    and round-off would stretch it down over twenty decades and flatten every real difference.
    """
    if not curves:
        raise ValueError("plot_spectra needs at least one curve")
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, values in curves.items():
        v = np.asarray(values, dtype=np.float64)
        ax.plot(np.arange(1, len(v) + 1), np.where(v >= FLOOR, v, np.nan), marker=".", label=name)
    ax.set_yscale("log")
    ax.set(xlabel="index of the singular value (1-based)", ylabel="normalised singular values (sorted)",
           title=title or "normalised singular values (sorted)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return Path(path)


def _pyplot() -> Any:
    """pyplot on the Agg backend (headless cloud and bench boxes). Not bench.lib.report.pyplot:
    methods/ sits below bench/ and the cloud imports this module, so it must not import bench."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
