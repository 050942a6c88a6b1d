"""H-SFP device-to-edge assignment from label histograms (`--set assign=clusters|balanced`):
the placement rules by hand, and a federation whose devices move after round 1."""

from __future__ import annotations

import json
import logging

import numpy as np

from splitedge.methods.hsfp.assign import balanced, by_clusters


def _hists() -> dict[str, np.ndarray]:
    """Four devices: d0, d1 hold classes 0-1 only, d2, d3 classes 2-3 only (sizes 100 each)."""
    a, b = np.array([50.0, 50, 0, 0]), np.array([0.0, 0, 50, 50])
    return {"d0": a, "d1": a * 1.0, "d2": b, "d3": b * 1.0}


def test_clusters_put_devices_with_the_same_classes_on_one_edge() -> None:
    where = by_clusters(_hists(), ["e0", "e1"])
    assert where["d0"] == where["d1"] and where["d2"] == where["d3"] and where["d0"] != where["d2"]


def test_balanced_gives_each_edge_the_federation_s_label_mix_and_even_sizes() -> None:
    hists = _hists()
    where = balanced(hists, ["e0", "e1"])
    for e in ("e0", "e1"):
        mix = sum(hists[d] for d in where if where[d] == e)
        np.testing.assert_allclose(mix / mix.sum(), [0.25] * 4)  # each edge holds one device of each kind
    # any federation: edges' sizes differ by at most one device's
    rng = np.random.default_rng(0)
    hists = {f"d{i}": rng.integers(0, 100, 10).astype(float) for i in range(13)}
    where = balanced(hists, ["e0", "e1", "e2"])
    sizes = [sum(hists[d].sum() for d in where if where[d] == e) for e in ("e0", "e1", "e2")]
    assert max(sizes) - min(sizes) <= max(h.sum() for h in hists.values())


def test_assign_balanced_moves_devices_after_round_1_and_the_run_finishes(tmp_path, caplog) -> None:
    import torch

    from splitedge.sim import SimSettings, run_sim

    torch.set_num_threads(1)
    caplog.set_level(logging.INFO, logger="splitedge.methods.hsfp.cloud")
    s = SimSettings(rounds=3, devices=4, edges=2, alpha=0.3, out=tmp_path / "run",
                    overrides={"assign": "balanced"})
    summary = run_sim(s)
    placed = [r.message for r in caplog.records if "devices placed on edges (balanced)" in r.message]
    assert len(placed) == 1  # once, after round 1
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert summary["rounds_done"] == 3 and [m["edges"] for m in metrics] == [2, 2, 2]
    assert metrics[-1]["accuracy"] > metrics[0]["accuracy"] - 0.05  # the moves did not break the federation
