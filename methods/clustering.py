"""Which devices belong together: agglomerative clustering on cosine distance (METHODS.md "CFLHKD").
Shared: CFLHKD's clusters and H-SFP's device-to-edge assignment (methods/hsfp/assign.py) use it.

After the warm-up round the cloud holds one signal vector per device (its flattened model
update, or its label histogram) and groups devices whose signals point the same way: average
linkage on cosine distance, with the number of clusters given or cut at a distance threshold.
Cosine, because update magnitudes differ with data size and learning rate while the direction
says what the device's data pulls the model towards; average linkage, because single linkage
chains distinct groups through one in-between device and complete linkage lets one noisy
device split its group.

Everything is keyed by device id and walked in sorted id order, and clusters are numbered by
their smallest (sorted) member, so the same signals give the same numbering whatever order
the devices reported in. numpy at import time; scikit-learn, scipy and matplotlib are imported
inside the functions that need them, so a thin device can import this module without them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

import numpy as np

EPS = 1e-12
"""Signal norms at or below this count as zero: their direction (and so cosine) is undefined."""


def _rows(signals: Mapping[str, np.ndarray]) -> tuple[list[str], np.ndarray]:
    """Sorted ids and their signals as float64 rows [N, D], flattened and checked."""
    if not signals:
        raise ValueError("need at least one device signal")
    ids = sorted(signals)
    flat = [np.asarray(signals[d], dtype=np.float64).ravel() for d in ids]
    size = flat[0].size
    for d, row in zip(ids, flat):
        if row.size != size:
            raise ValueError(f"device {d!r}: signal has {row.size} values, device {ids[0]!r} has {size}")
        if not np.all(np.isfinite(row)):
            raise ValueError(f"device {d!r}: signal has non-finite values")
        if np.linalg.norm(row) <= EPS:
            raise ValueError(f"device {d!r}: signal is all zeros, its cosine distance is undefined")
    return ids, np.stack(flat)


def _unit(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def cosine_distances(signals: Mapping[str, np.ndarray], center: bool = False) -> tuple[list[str], np.ndarray]:
    """Sorted device ids and the [N, N] matrix of 1 - cos between their signals.

    With `center`, the devices' mean signal is subtracted first: model updates share a large
    common part (what every device learns early on), which makes all of them point the same
    way; what is left says where each device's data pulls differently. (Kept uncentred when
    that leaves a zero row, e.g. two devices or identical signals.)
    Clipped to [0, 2] with an exact zero diagonal, so round-off never gives a negative distance
    or a device at a distance from itself (average linkage and the threshold cut read it as is).
    """
    ids, x = _rows(signals)
    if center and len(ids) > 2:
        centred = x - x.mean(axis=0, keepdims=True)
        if np.all(np.linalg.norm(centred, axis=1) > EPS * max(1.0, float(np.abs(x).max()))):
            x = centred
    z = _unit(x)
    d = np.clip(1.0 - z @ z.T, 0.0, 2.0)
    d = (d + d.T) / 2.0
    np.fill_diagonal(d, 0.0)
    return ids, d


def _number_by_smallest_id(ids: list[str], labels: np.ndarray) -> dict[str, int]:
    """Relabel clusters 0..K-1 in order of first appearance along the sorted ids."""
    renumber: dict[int, int] = {}
    return {d: renumber.setdefault(int(lab), len(renumber)) for d, lab in zip(ids, labels)}


def cluster_devices(signals: Mapping[str, np.ndarray], *, n_clusters: int | None = None,
                    distance_threshold: float | None = None, max_clusters: int | None = None,
                    center: bool = False) -> dict[str, int]:
    """Device -> cluster index (0..K-1, numbered by each cluster's smallest device id).

    Exactly one of `n_clusters` (K fixed) or `distance_threshold` (clusters at a linkage
    distance >= threshold are not merged, scikit-learn's rule; K follows from the data).
    `max_clusters` caps K for the threshold cut: more clusters than the edges can host is
    re-cut at n_clusters=max_clusters. Scikit-learn's AgglomerativeClustering, average linkage,
    on the precomputed `cosine_distances` matrix (the same numbers as metric="cosine", and the
    same matrix `drifted` and the caller see).
    """
    if (n_clusters is None) == (distance_threshold is None):
        raise ValueError("give exactly one of n_clusters or distance_threshold")
    if n_clusters is not None and n_clusters < 1:
        raise ValueError(f"n_clusters must be >= 1, got {n_clusters}")
    if distance_threshold is not None and not (np.isfinite(distance_threshold) and distance_threshold >= 0):
        raise ValueError(f"distance_threshold must be a finite number >= 0, got {distance_threshold}")
    if max_clusters is not None:
        if max_clusters < 1:
            raise ValueError(f"max_clusters must be >= 1, got {max_clusters}")
        if n_clusters is not None and n_clusters > max_clusters:
            raise ValueError(f"n_clusters={n_clusters} exceeds max_clusters={max_clusters}")
    ids, dist = cosine_distances(signals, center=center)
    if n_clusters is not None and n_clusters > len(ids):
        raise ValueError(f"n_clusters={n_clusters} but only {len(ids)} devices")
    if len(ids) == 1:
        return {ids[0]: 0}  # scikit-learn needs two samples; one device is one cluster

    from sklearn.cluster import AgglomerativeClustering

    def cut(**kwargs: Any) -> np.ndarray:
        return AgglomerativeClustering(metric="precomputed", linkage="average", **kwargs).fit_predict(dist)

    if n_clusters is not None:
        labels = cut(n_clusters=n_clusters)
    else:
        labels = cut(n_clusters=None, distance_threshold=distance_threshold)
        if max_clusters is not None and len(np.unique(labels)) > max_clusters:
            labels = cut(n_clusters=max_clusters)
    return _number_by_smallest_id(ids, labels)


def label_histogram(counts: Mapping[int, int] | np.ndarray, num_classes: int) -> np.ndarray:
    """Class distribution of a device (float64 [num_classes], sum 1), an alternative signal.

    `counts` is {class: samples} or an array of per-class counts of length num_classes (for
    raw labels use np.bincount(labels, minlength=num_classes)). Normalised, so devices with the
    same classes in the same proportions match whatever their sizes (cosine ignores scale
    anyway; the sum-1 form is what a histogram plot or a JSON record wants).
    """
    if num_classes < 1:
        raise ValueError(f"num_classes must be >= 1, got {num_classes}")
    if isinstance(counts, Mapping):
        hist = np.zeros(num_classes, dtype=np.float64)
        for c, n in counts.items():
            if not 0 <= int(c) < num_classes:
                raise ValueError(f"class {c} outside [0, {num_classes})")
            hist[int(c)] += n
    else:
        hist = np.asarray(counts, dtype=np.float64)
        if hist.shape != (num_classes,):
            raise ValueError(f"per-class counts must have shape ({num_classes},), got {hist.shape}")
    if not np.all(np.isfinite(hist)) or np.any(hist < 0):
        raise ValueError("class counts must be finite and >= 0")
    total = hist.sum()
    if total <= 0:
        raise ValueError("class counts sum to 0: a device without samples has no histogram")
    return hist / total


def drifted(signals: Mapping[str, np.ndarray], assignment: Mapping[str, int], threshold: float) -> list[str]:
    """Devices (sorted) whose signal is at cosine distance > threshold from their cluster's centroid.

    The centroid is the mean of the L2-normalised signals of the cluster's members that are in
    `signals` (the device itself included, so a singleton never drifts); unit vectors first so
    one device with a large update does not drag the centroid its way. A centroid of norm ~0
    (members pointing in opposite directions) has no direction: its members count as at
    distance 1. A device with a signal but no cluster is a caller mistake (assign it first).
    """
    ids, x = _rows(signals)
    missing = [d for d in ids if d not in assignment]
    if missing:
        raise ValueError(f"devices without a cluster: {missing}")
    z = _unit(x)
    labels = np.array([int(assignment[d]) for d in ids])
    out = []
    for k in np.unique(labels):
        members = labels == k
        if members.sum() == 1:
            continue  # its own centroid: distance 0 exactly, not round-off above a threshold of 0
        centroid = z[members].mean(axis=0)
        norm = np.linalg.norm(centroid)
        dist = 1.0 - z[members] @ centroid / norm if norm > EPS else np.ones(int(members.sum()))
        out += [d for d, far in zip(np.asarray(ids)[members], dist > threshold) if far]
    return sorted(str(d) for d in out)


def adjusted_rand(assignment: Mapping[str, int], truth: Mapping[str, int]) -> float:
    """Adjusted Rand index (scikit-learn) of the clustering against the planted groups, over the
    devices both know (sorted): 1 for the same partition whatever the cluster names, ~0 for chance."""
    common = sorted(set(assignment) & set(truth))
    if not common:
        raise ValueError("assignment and truth share no device")
    from sklearn.metrics import adjusted_rand_score

    return float(adjusted_rand_score([truth[d] for d in common], [assignment[d] for d in common]))


def write_clusters(out_dir: Path, assignment: Mapping[str, int], signals: Mapping[str, np.ndarray], *,
                   edges: Mapping[int, str] | None = None, round_: int) -> list[Path]:
    """Write clusters.json and dendrogram.png into `out_dir`; returns the paths written.

    clusters.json: {"round", "devices": {id: {"cluster", "edge"?}}, "clusters": [{"cluster",
    "members", "size", "edge"?}]} with devices and members sorted and clusters by index; "edge"
    only when `edges` (cluster -> edge id) is given. dendrogram.png: scipy's average-linkage
    cosine tree over the assigned devices' signals, leaves labelled by device id and coloured
    by assigned cluster, so a reader sees where the cut fell. With fewer than two devices there
    is no tree, and only the JSON is written.
    """
    if not assignment:
        raise ValueError("empty assignment: nothing to write")
    ids = sorted(assignment)
    missing = [d for d in ids if d not in signals]
    if missing:
        raise ValueError(f"devices without a signal: {missing}")
    clusters = sorted({int(assignment[d]) for d in ids})
    if edges is not None and (absent := [k for k in clusters if k not in edges]):
        raise ValueError(f"clusters without an edge: {absent}")

    def with_edge(record: dict[str, Any], k: int) -> dict[str, Any]:
        return {**record, "edge": edges[k]} if edges is not None else record

    members = {k: [d for d in ids if int(assignment[d]) == k] for k in clusters}
    doc = {
        "round": int(round_),
        "devices": {d: with_edge({"cluster": int(assignment[d])}, int(assignment[d])) for d in ids},
        "clusters": [with_edge({"cluster": k, "members": members[k], "size": len(members[k])}, k)
                     for k in clusters],
    }
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / "clusters.json"
    json_path.write_text(json.dumps(doc, indent=2) + "\n")
    written = [json_path]
    if len(ids) >= 2:
        written.append(_dendrogram(out_dir / "dendrogram.png", {d: signals[d] for d in ids},
                                   {d: int(assignment[d]) for d in ids}, round_))
    return written


def _dendrogram(path: Path, signals: Mapping[str, np.ndarray], assignment: Mapping[str, int], round_: int) -> Path:
    from scipy.cluster.hierarchy import dendrogram, linkage

    ids, x = _rows(signals)
    tree = linkage(x, method="average", metric="cosine")
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(min(max(4.0, 0.35 * len(ids)), 12.0), 3.0))
    dendrogram(tree, labels=ids, ax=ax, leaf_rotation=90, color_threshold=0, above_threshold_color="0.4")
    palette = plt.get_cmap("tab10")
    for tick in ax.get_xticklabels():
        tick.set_color(palette(assignment[tick.get_text()] % 10))
    ax.set(ylabel="cosine distance (average linkage)", title=f"device clusters, round {round_}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _pyplot() -> Any:
    """pyplot on the Agg backend (the cloud is headless). Not bench.lib.report.pyplot: methods/
    sits below bench/, so it must not import bench."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
