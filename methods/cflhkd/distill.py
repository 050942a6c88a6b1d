"""Teachers from class-wise mean logits, and the distillation term (torch only in kd_term)."""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np


def merge_tables(parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]], num_classes: int, how: str = "none", *,
                 clip_k: float = 2.0, trim: float = 0.2) -> tuple[np.ndarray, np.ndarray]:
    """Count-weighted mean logits per class over parts (classes i8[K], counts i8[K], logits [K, C]),
    or their merge by the run's robust rule `how` (methods/robust.py): returns (counts [C],
    logits [C, C]) with zero rows for classes nobody holds."""
    counts = np.zeros(num_classes, dtype=np.int64)
    sums = np.zeros((num_classes, num_classes), dtype=np.float64)
    if how != "none":
        from splitedge.methods.robust import robust_class_means

        classes, held, means = robust_class_means(parts, how, clip_k=clip_k, trim=trim)
        counts[classes] = held
        sums[classes] = means
        return counts, sums
    for classes, n, logits in parts:
        idx = np.asarray(classes, dtype=np.int64)
        counts[idx] += np.asarray(n, dtype=np.int64)
        sums[idx] += np.asarray(n, dtype=np.float64)[:, None] * np.asarray(logits, dtype=np.float64)
    return counts, sums / np.maximum(counts, 1)[:, None]


TEACHER_WEIGHTS = ("count", "equal")
"""How a teacher weighs the clusters that hold a class: by their counts (a large cluster
dominates), or each alike (no cluster's share of a class's teacher exceeds 1 / the clusters
holding it)."""


def teachers(tables: Mapping[int, tuple[np.ndarray, np.ndarray]], own: int | None,
             weighting: str = "count") -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(global [C, C], has_global [C], peers [C, C], has_peers [C]) from each cluster's
    (counts [C], logits [C, C]): the global teacher weighs every cluster holding a class by its
    count for it, or alike (`weighting="equal"`), the peer teacher every cluster but `own` (none
    known: the peer teacher is absent)."""
    if weighting not in TEACHER_WEIGHTS:
        raise ValueError(f"teacher weighting must be one of {TEACHER_WEIGHTS}, got {weighting!r}")

    def weight(counts: np.ndarray) -> np.ndarray:
        return counts if weighting == "count" else (np.asarray(counts) > 0).astype(np.int64)

    def weighted(keys: list[int]) -> tuple[np.ndarray, np.ndarray]:
        counts = sum((weight(tables[k][0]) for k in keys), np.zeros_like(next(iter(tables.values()))[0]))
        sums = sum((weight(tables[k][0])[:, None] * tables[k][1] for k in keys), 0.0)
        return np.asarray(sums, dtype=np.float64) / np.maximum(counts, 1)[:, None], counts > 0

    g, has_g = weighted(sorted(tables))
    peers = [k for k in sorted(tables) if own is not None and k != own]
    if peers:
        p, has_p = weighted(peers)
    else:
        p, has_p = np.zeros_like(g), np.zeros(len(g), dtype=bool)
    return g, has_g, p, has_p


def _kl(teacher_logits: Any, logits: Any, temperature: float) -> Any:
    """Mean over rows of KL(softmax(teacher / T) || softmax(logits / T))."""
    import torch.nn.functional as F

    t = F.softmax(teacher_logits / temperature, dim=1)
    log_s = F.log_softmax(logits / temperature, dim=1)
    return (t * (t.clamp_min(1e-12).log() - log_s)).sum(dim=1).mean()


def kd_term(name: str, key: str, temperature: float, weight: float) -> Any:
    """KL(softmax(teacher[y] / T) || softmax(logits / T)) x T^2 over the samples whose class has
    a teacher row (`batch.extra[key]` = (table [C, C] tensor, has [C] bool)); 0 without one."""
    from splitedge.methods.training import LossTerm

    def fn(out: Any, b: Any) -> Any:
        table = b.extra.get(key)
        if table is None:
            return out["logits"].sum() * 0.0
        teacher, has = table
        mask = has[b.y]
        if not bool(mask.any()):
            return out["logits"].sum() * 0.0
        kl = _kl(teacher[b.y[mask]], out["logits"][mask], temperature)
        return kl * temperature ** 2 * mask.float().mean()  # a batch mean over every sample, 0 where no teacher

    return LossTerm(name, fn, weight, needs=("logits",))


def kd_model_term(name: str, key: str, temperature: float, weight: float) -> Any:
    """KL(softmax(teacher(x) / T) || softmax(logits / T)) x T^2 with a teacher model's own outputs
    on each sample of the batch (`batch.extra[key]`, a split model, run in eval mode without
    gradient): the paper's teachers are models, not class-wise tables. 0 without one."""
    import torch

    from splitedge.methods.torch_utils import model_outputs
    from splitedge.methods.training import LossTerm

    def fn(out: Any, b: Any) -> Any:
        teacher = b.extra.get(key)
        if teacher is None:
            return out["logits"].sum() * 0.0
        with torch.no_grad():
            mode = teacher.training
            teacher.eval()
            soft = model_outputs(teacher, b.x)["logits"]
            teacher.train(mode)
        return _kl(soft, out["logits"], temperature) * temperature ** 2

    return LossTerm(name, fn, weight, needs=("logits",))
