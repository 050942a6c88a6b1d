"""A device's differentially private releases: where dp.py's mechanisms meet what a part sends.

With `dp_sigma > 0` a device part takes its per-class statistics through `private_accumulator`
(clipped sums of every class, noised once when the result is asked for) and its weight updates
through `private_weights`, and counts each release on the part (`dp_releases`, reported in its
`done` info; the cloud turns the counts into epsilon, accountant.py). The noise comes from the
operating system's entropy, never from the run's seed: a seed anyone can know would make it
removable (so a run with DP is not bit-reproducible).

After the noise, each release is fitted to what the device's hello already said in the clear
(which costs no privacy: post-processing of the release and of public facts): only classes the
hello announced, and the run's minimum count per class applied to the noisy counts (applied to
the true counts it would not be DP). The noisy counts are sent as released (rounded, at least 1):
never capped to the device's true sample count, which would keep the released total at or below
N at any sigma (not DP, and it would give away the N that `--private-reports` hides). The edge
fits them to what the device may count instead (`fit_to_allowance`: the samples its hello
announced, the operator's manifest entry), bounds that are public to the edge, so that too is
post-processing.
With `dp_devices` > 1 a device adds only its share of the noise and its raw release goes into
the edge's secure sum, which the edge post-processes instead (distributed.py).
numpy only: thin devices release the same way.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterable, Mapping, MutableMapping
from typing import Any

import numpy as np

from splitedge.methods.calibration.stats import HeadStats
from splitedge.methods.checks import STATISTIC_BUFFERS
from splitedge.methods.moments import ClassMoments
from splitedge.methods.privacy.distributed import device_sigma, shares_noise
from splitedge.methods.privacy.dp import (ClippedSums, Second, capped_counts, class_means_from, dp_weights,
                                         head_stats_from, moments_from)
from splitedge.methods.privacy.norm_stats import Layout, released_norm_statistics, sequential_sigma, with_statistics

Adapter = Callable[[Any], Any]


def entropy_rng() -> np.random.Generator:
    """A generator seeded from the OS (128 bits), for noise nobody can replay."""
    return np.random.default_rng(secrets.randbits(128))


def fit_to_hello(classes: np.ndarray, counts: np.ndarray, announced: np.ndarray, min_count: int) -> np.ndarray:
    """Which of a release's (classes, counts) rows may be sent: classes its hello `announced`
    (the classes it holds, or every class when it hides them) whose noisy count reaches the
    minimum count per class. A bool mask."""
    return np.isin(classes, np.asarray(announced)) & (counts >= min_count)


class PrivateSums(ClippedSums):
    """ClippedSums with the `result()` the shared accumulate() asks for: the one noisy release,
    post-processed by `adapter` (dp.moments_from, dp.head_stats_from) and counted on `part`."""

    def __init__(self, dim: int, *, part: Any, clip: float, second: Second, adapter: Adapter) -> None:
        super().__init__(dim, part.spec.num_classes, clip, second)
        self.part, self.adapter = part, adapter

    def result(self) -> Any:
        """The release, post-processed. When devices share the noise (distributed.py) the raw
        release is also kept on the part (`pending_release`) for the secure sum, the only way
        it may leave; nothing fitted from it alone is reported (no `withheld`)."""
        part = self.part
        part.dp_releases += 1
        noisy = self.release(device_sigma(part.cfg), entropy_rng())
        out = self.adapter(noisy)
        if shares_noise(part.cfg):
            part.pending_release, part.withheld = noisy, {}
        return out


def private_accumulator(part: Any, clip: float, second: Second, adapter: Adapter) -> Callable[[int], PrivateSums]:
    """An accumulator factory for preprocess.accumulate: `accumulator(dim)`."""
    return lambda dim: PrivateSums(dim, part=part, clip=clip, second=second, adapter=adapter)


def private_weights(part: Any, weights: Mapping[str, np.ndarray], start: Mapping[str, np.ndarray],
                    statistics: Mapping[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
    """What a device sends instead of `weights` trained from `start`: the update clipped to the
    run's `dp_update_clip` and noised (dp.dp_weights; its share of the noise when devices share
    it, distributed.py); counted as one release. BatchNorm's
    running statistics are estimates of the device's features, not trained values: they go up
    as `start` had them (never noised into variances below 0), or as `statistics`, their own
    private release (private_norm_statistics), has them."""
    part.dp_releases += 1
    trained = [k for k in weights if not k.endswith(STATISTIC_BUFFERS)]
    out = dp_weights({k: weights[k] for k in trained}, {k: start[k] for k in trained},
                     clip=part.cfg.dp_update_clip, sigma=device_sigma(part.cfg), rng=entropy_rng())
    sent = {k: out[k] if k in out else np.array(start[k], copy=True) for k in weights}
    return with_statistics(sent, statistics or {})


def private_norm_statistics(part: Any, layout: Layout, vectors_of: Callable[[str], Iterable[np.ndarray]],
                            adopt: Callable[[dict[str, np.ndarray]], None]) -> dict[str, np.ndarray]:
    """With `dp_bn_clip` > 0, the private release of the BatchNorm statistics of the model the
    device received: layer by layer in `layout`'s (forward) order, each layer's per-image input
    moments `vectors_of(name)` (norm_stats.py) taken after `adopt` gave the model the layers
    released before it. The L releases, each at sigma sqrt(L), cost what one release at sigma
    does (norm_stats.sequential_sigma): counted as one. Else, or for a model without BatchNorm,
    nothing: the statistics go up as received. A layer the noisy count dropped keeps its own."""
    if not layout or not part.cfg.dp_bn_clip > 0:
        return {}
    part.dp_releases += 1
    sigma, out = sequential_sigma(part.cfg.dp_sigma, len(layout)), {}
    for name, channels in layout:
        stats = released_norm_statistics(vectors_of(name), [(name, channels)], clip=part.cfg.dp_bn_clip,
                                         sigma=sigma, rng=entropy_rng())
        adopt(stats)
        out.update(stats)
    return out


def _fitted(part: Any, labels: np.ndarray, classes: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(rows kept, their counts) of a noisy release: the classes the device's hello announced
    whose noisy count reaches the minimum count per class, with their noisy counts as released
    (rounded, >= 1), whatever the device's true sample count. What it left out of the announced
    classes goes into `part.withheld`, as the floor reports it without DP, but from the release
    alone (post-processing): the classes, and their noisy counts where the release kept one (0
    for a class the noise itself hid), so an estimate."""
    announced = part.announced_classes(labels)
    rows = fit_to_hello(classes, counts, announced, part.min_class_count)
    held = set(announced.tolist())
    noisy = dict(zip(np.asarray(classes).tolist(), np.asarray(counts).tolist()))
    out = sorted(held - set(np.asarray(classes)[rows].tolist()))
    part.withheld = {"classes": len(out), "samples": int(sum(max(0, int(noisy.get(c, 0))) for c in out))} if out \
        else {}
    return rows, np.asarray(counts)[rows].astype(np.int64)


def fit_to_allowance(body: MutableMapping[str, Any], samples: int,
                     class_counts: Mapping[int, int] | None = None) -> None:
    """An edge's post-processing of a child's noisy per-class counts (a run with DP on) to what
    the child may count, in place: each class's count to at most the operator's manifest count
    for it (`class_counts`), then their total to at most `samples` (its hello's, within its
    manifest entry: dp.capped_counts). Both bounds are public to the edge, and the counts are
    a DP release, so this costs no privacy; it keeps every merge's counts within what each
    device announced, as when devices sent exact counts. Nothing changes when the counts fit, or
    when more classes than `samples` are named (check_within_samples then refuses them)."""
    record = body["arrays"] if isinstance(body.get("arrays"), MutableMapping) else body
    holder = body if body.get("counts") is not None or record is body else record
    counts = holder.get("counts")
    if counts is None or np.ndim(counts) != 1 or np.asarray(counts).dtype.kind not in "iu":
        return
    given = np.asarray(counts)
    fitted = given.astype(np.int64)
    named = holder.get("classes")
    if class_counts is not None and named is not None and np.shape(named) == given.shape:
        bound = np.array([class_counts.get(int(c), 0) for c in np.asarray(named).tolist()], dtype=np.int64)
        fitted = np.where(bound >= 1, np.minimum(fitted, bound), fitted)  # a class not held is refused, not fitted
    if 0 < len(fitted) <= samples and (fitted >= 1).all():
        fitted = capped_counts(fitted, samples)
    if not np.array_equal(fitted, given):
        holder["counts"] = fitted.astype(given.dtype)


def private_moments(part: Any, labels: np.ndarray) -> Adapter:
    """NoisySums -> the ClassMoments a device may send (dp.moments_from, fitted to its hello)."""
    def adapt(noisy: Any) -> ClassMoments:
        m = moments_from(noisy)
        rows, counts = _fitted(part, labels, m.classes, m.counts)
        return ClassMoments(m.classes[rows], counts, m.mean[rows], m.var[rows]) if rows.any() else \
            ClassMoments.empty(m.dim)
    return adapt


def private_head_stats(part: Any, labels: np.ndarray) -> Adapter:
    """NoisySums -> the HeadStats a device may send (dp.head_stats_from, fitted to its hello; the
    shared covariance stays the one of the release). May hold no class: then nothing is sent."""
    def adapt(noisy: Any) -> HeadStats:
        h = head_stats_from(noisy)
        rows, counts = _fitted(part, labels, h.classes, h.counts)
        return HeadStats(h.classes[rows], counts, h.mean[rows], h.cov)
    return adapt


ClassMeans = tuple[np.ndarray, np.ndarray, np.ndarray]


def private_class_means(part: Any, labels: np.ndarray) -> Adapter:
    """NoisySums (second "none") -> the (classes, counts, means) a device may send: FedProto's
    prototypes, CFLHKD's class-wise mean logits (dp.class_means_from, fitted to its hello)."""
    def adapt(noisy: Any) -> ClassMeans:
        classes, counts, means = class_means_from(noisy)
        rows, kept = _fitted(part, labels, classes, counts)
        return classes[rows], kept, means[rows]
    return adapt


def private_means_of(part: Any, rows: Any, labels: np.ndarray, dim: int) -> ClassMeans:
    """One private release of the class means of `rows` (feature batches [N, dim] with their
    labels, every class: the floor applies to the noisy counts), clipped to the run's `dp_clip`."""
    sums = private_accumulator(part, part.cfg.dp_clip, "none", private_class_means(part, labels))(dim)
    for x, y in rows:
        sums.add(x, y)
    return sums.result()
