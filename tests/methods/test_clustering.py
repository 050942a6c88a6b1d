"""CFLHKD's device clustering recovers planted groups (METHODS.md "CFLHKD", the check)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from splitedge.methods.clustering import (adjusted_rand, cluster_devices, cosine_distances, drifted,
                                                 label_histogram, write_clusters)

DIM = 16


def planted(seed: int = 0, n: int = 12, groups: int = 3, noise: float = 0.02):
    """n devices in `groups` shuffled groups of equal size: signal = orthonormal group direction
    + small noise. Returns (signals, truth group per device, the group directions)."""
    rng = np.random.default_rng(seed)
    directions = np.linalg.qr(rng.normal(size=(DIM, groups)))[0].T  # [groups, DIM], orthonormal
    group_of = rng.permutation(np.arange(n) % groups)
    ids = [f"d{i:02d}" for i in range(n)]
    signals = {d: directions[g] + noise * rng.normal(size=DIM) for d, g in zip(ids, group_of)}
    return signals, {d: int(g) for d, g in zip(ids, group_of)}, directions


def by_smallest_id(truth: dict[str, int]) -> dict[str, int]:
    """The truth renamed the way cluster_devices numbers clusters (first seen along sorted ids)."""
    names: dict[int, int] = {}
    return {d: names.setdefault(truth[d], len(names)) for d in sorted(truth)}


def test_planted_groups_are_recovered_with_deterministic_numbering() -> None:
    signals, truth, _ = planted()
    fixed = cluster_devices(signals, n_clusters=3)
    assert adjusted_rand(fixed, truth) == 1.0
    assert fixed == by_smallest_id(truth)  # exact labels, not only the partition
    assert list(fixed) == sorted(signals)
    cut = cluster_devices(signals, distance_threshold=0.5)
    assert len(set(cut.values())) == 3 and cut == fixed
    # the same signals reported in another order give the same numbering
    order = np.random.default_rng(1).permutation(sorted(signals))
    shuffled = {str(d): signals[str(d)] for d in order}
    assert list(shuffled) != sorted(signals)
    assert cluster_devices(shuffled, n_clusters=3) == fixed
    assert cluster_devices(dict(reversed(list(signals.items()))), distance_threshold=0.5) == fixed


def test_signals_are_flattened_and_scale_does_not_matter() -> None:
    signals, truth, _ = planted(seed=2)
    rng = np.random.default_rng(3)
    # model updates arrive as tensors of any shape and size: only their direction counts
    reshaped = {d: (s * rng.uniform(0.01, 100.0)).reshape(4, 4) for d, s in signals.items()}
    assert cluster_devices(reshaped, n_clusters=3) == by_smallest_id(truth)


def test_label_histograms_of_disjoint_class_sets_cluster_by_class() -> None:
    rng = np.random.default_rng(4)
    class_sets = [(0, 1, 2), (3, 4, 5), (6, 7, 8, 9)]
    truth = {f"d{i}": i % 3 for i in range(9)}
    signals = {d: label_histogram({c: int(rng.integers(20, 60)) for c in class_sets[g]}, 10)
               for d, g in truth.items()}
    for hist in signals.values():
        assert hist.shape == (10,) and hist.sum() == pytest.approx(1.0)
    assignment = cluster_devices(signals, n_clusters=3)
    assert adjusted_rand(assignment, truth) == 1.0
    for k in set(assignment.values()):
        held = {tuple(np.flatnonzero(signals[d])) for d in assignment if assignment[d] == k}
        assert len(held) == 1


def test_label_histogram_inputs() -> None:
    np.testing.assert_allclose(label_histogram({0: 1, 3: 3}, 4), [0.25, 0, 0, 0.75])
    np.testing.assert_allclose(label_histogram(np.array([2, 2, 0, 4]), 4), [0.25, 0.25, 0, 0.5])
    with pytest.raises(ValueError, match="outside"):
        label_histogram({4: 1}, 4)
    with pytest.raises(ValueError, match="shape"):
        label_histogram(np.array([1, 2, 3]), 4)
    with pytest.raises(ValueError):
        label_histogram({0: -1, 1: 2}, 2)
    with pytest.raises(ValueError, match="sum to 0"):
        label_histogram({}, 3)


def test_max_clusters_caps_a_threshold_that_gives_more() -> None:
    signals, truth, _ = planted(seed=5)
    assert len(set(cluster_devices(signals, distance_threshold=1e-4).values())) == 12
    capped = cluster_devices(signals, distance_threshold=1e-4, max_clusters=3)
    assert capped == by_smallest_id(truth)
    assert len(set(cluster_devices(signals, distance_threshold=0.5, max_clusters=2).values())) == 2
    # a cap above what the threshold finds changes nothing
    assert cluster_devices(signals, distance_threshold=0.5, max_clusters=5) == capped


def test_small_cases() -> None:
    assert cluster_devices({"only": np.ones(3)}, n_clusters=1) == {"only": 0}
    assert cluster_devices({"only": np.ones(3)}, distance_threshold=0.5) == {"only": 0}
    signals, _, _ = planted(n=3)
    assert cluster_devices(signals, n_clusters=3) == {"d00": 0, "d01": 1, "d02": 2}


def test_cosine_distances_matrix() -> None:
    ids, d = cosine_distances({"b": np.array([0.0, 2.0]), "a": np.array([3.0, 0.0]), "c": np.array([-1.0, 0.0])})
    assert ids == ["a", "b", "c"]
    np.testing.assert_allclose(d, [[0, 1, 2], [1, 0, 1], [2, 1, 0]], atol=1e-12)


def test_drifted_names_only_the_device_that_moved() -> None:
    signals, truth, directions = planted(seed=6)
    assignment = cluster_devices(signals, n_clusters=3)
    assert drifted(signals, assignment, 0.3) == []
    mover = "d05"
    other = (truth[mover] + 1) % 3
    moved = {**signals, mover: directions[other] + 0.02 * np.random.default_rng(7).normal(size=DIM)}
    assert drifted(moved, assignment, 0.3) == [mover]
    # re-clustering puts it with its new group
    again = cluster_devices(moved, n_clusters=3)
    assert again[mover] == again[next(d for d in sorted(truth) if truth[d] == other)]
    # a singleton is its own centroid and never drifts
    assert drifted({"x": np.ones(2), "y": np.array([1.0, -1.0])}, {"x": 0, "y": 1}, 0.0) == []
    with pytest.raises(ValueError, match="without a cluster"):
        drifted(signals, {d: k for d, k in assignment.items() if d != "d00"}, 0.3)


def test_adjusted_rand_hand_cases() -> None:
    assert adjusted_rand({"a": 0, "b": 0, "c": 1, "d": 1}, {"a": 5, "b": 5, "c": 7, "d": 7}) == 1.0
    assert adjusted_rand({"a": 0, "b": 0, "c": 1, "d": 1}, {"a": 1, "b": 1, "c": 0, "d": 0}) == 1.0
    # contingency all ones: index 0, expected (2 * 2) / C(4, 2) = 2/3, max 2 -> (0 - 2/3) / (2 - 2/3)
    assert adjusted_rand({"a": 0, "b": 0, "c": 1, "d": 1}, {"a": 0, "b": 1, "c": 0, "d": 1}) == pytest.approx(-0.5)
    # only common devices count
    assert adjusted_rand({"a": 0, "b": 0, "c": 1, "x": 0}, {"a": 3, "b": 3, "c": 4, "y": 4}) == 1.0
    with pytest.raises(ValueError, match="no device"):
        adjusted_rand({"a": 0}, {"b": 0})


def test_caller_mistakes_are_value_errors() -> None:
    signals, _, _ = planted()
    with pytest.raises(ValueError, match="'d03'.*zeros"):
        cluster_devices({**signals, "d03": np.zeros(DIM)}, n_clusters=3)
    with pytest.raises(ValueError, match="only 12 devices"):
        cluster_devices(signals, n_clusters=13)
    with pytest.raises(ValueError, match="exactly one"):
        cluster_devices(signals, n_clusters=3, distance_threshold=0.5)
    with pytest.raises(ValueError, match="exactly one"):
        cluster_devices(signals)
    with pytest.raises(ValueError, match="exceeds max_clusters"):
        cluster_devices(signals, n_clusters=3, max_clusters=2)
    with pytest.raises(ValueError, match="'d01'.*values"):
        cluster_devices({**signals, "d01": np.ones(DIM + 1)}, n_clusters=3)
    with pytest.raises(ValueError, match="non-finite"):
        cluster_devices({**signals, "d01": np.full(DIM, np.nan)}, n_clusters=3)
    with pytest.raises(ValueError):
        cluster_devices({}, n_clusters=1)
    with pytest.raises(ValueError):
        cluster_devices(signals, n_clusters=0)
    with pytest.raises(ValueError):
        cluster_devices(signals, distance_threshold=-0.1)


def test_write_clusters_json_and_dendrogram(tmp_path) -> None:
    signals, _, _ = planted(seed=8)
    assignment = cluster_devices(signals, n_clusters=3)
    edges = {0: "e0", 1: "e1", 2: "e2"}
    paths = write_clusters(tmp_path / "round-4", assignment, signals, edges=edges, round_=4)
    assert [p.name for p in paths] == ["clusters.json", "dendrogram.png"]
    doc = json.loads(paths[0].read_text())
    assert doc["round"] == 4
    assert doc["devices"]["d00"] == {"cluster": assignment["d00"], "edge": edges[assignment["d00"]]}
    assert [c["cluster"] for c in doc["clusters"]] == [0, 1, 2]
    for c in doc["clusters"]:
        assert c["members"] == sorted(d for d in assignment if assignment[d] == c["cluster"])
        assert c["size"] == len(c["members"]) and c["edge"] == edges[c["cluster"]]
    png = paths[1].read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 1000
    # without edges no edge keys; a single device has no tree to draw
    plain = write_clusters(tmp_path / "one", {"d00": 0}, signals, round_=0)
    assert [p.name for p in plain] == ["clusters.json"]
    assert json.loads(plain[0].read_text()) == {
        "round": 0, "devices": {"d00": {"cluster": 0}}, "clusters": [{"cluster": 0, "members": ["d00"], "size": 1}]}
    with pytest.raises(ValueError, match="without an edge"):
        write_clusters(tmp_path / "x", assignment, signals, edges={0: "e0"}, round_=1)
    with pytest.raises(ValueError, match="without a signal"):
        write_clusters(tmp_path / "x", {**assignment, "new": 0}, signals, round_=1)


def test_import_pulls_in_no_heavy_module() -> None:
    code = ("import json, sys\n"
            "import splitedge.methods.clustering\n"
            "heavy = ('sklearn', 'scipy', 'matplotlib')\n"
            "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in heavy)))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert json.loads(out.stdout) == []


def test_centring_separates_groups_hidden_under_a_common_update() -> None:
    # Prepare: 3 groups of 4 devices; every update is a large shared direction plus its group's
    # small one (what early FedAvg updates look like: everyone learns the same first)
    rng = np.random.default_rng(0)
    common, groups = rng.normal(size=64) * 10, rng.normal(size=(3, 64))
    signals = {f"d{i:02d}": common + groups[i // 4] + 0.05 * rng.normal(size=64) for i in range(12)}
    # Execute
    raw = cluster_devices(signals, distance_threshold=0.5)
    centred = cluster_devices(signals, distance_threshold=0.5, center=True)
    # Assert: uncentred, the shared part makes one cluster; centred, the planted groups come back
    assert set(raw.values()) == {0}
    assert [centred[f"d{i:02d}"] for i in range(12)] == [0] * 4 + [1] * 4 + [2] * 4


def test_centring_keeps_two_devices_or_identical_signals_defined() -> None:
    same = {"a": np.ones(4), "b": np.ones(4), "c": np.ones(4)}
    assert set(cluster_devices(same, distance_threshold=0.5, center=True).values()) == {0}
    two = {"a": np.array([1.0, 0.0]), "b": np.array([1.0, 0.1])}
    assert cluster_devices(two, n_clusters=1, center=True) == {"a": 0, "b": 0}
