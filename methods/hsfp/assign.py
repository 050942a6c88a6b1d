"""Device-to-edge assignment for H-SFP from the devices' label histograms (numpy; sklearn for
the clustering). The H-SFP paper names random assignment as its limitation: an edge trains W_e
only on the classes its devices hold."""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np


def by_clusters(hists: Mapping[str, np.ndarray], edges: Sequence[str]) -> dict[str, str]:
    """Similar devices together: CFLHKD's agglomerative clustering, one cluster per edge."""
    from splitedge.methods.clustering import cluster_devices

    clusters = cluster_devices(hists, n_clusters=min(len(edges), len(hists)))
    return {d: edges[k] for d, k in clusters.items()}


def balanced(hists: Mapping[str, np.ndarray], edges: Sequence[str]) -> dict[str, str]:
    """Each edge a sample of the whole: devices, largest first, go to the edge whose label mix
    (with them) is closest to the federation's, among the edges holding the fewest samples."""
    total = sum(np.asarray(h, dtype=np.float64) for h in hists.values())
    target = total / max(total.sum(), 1.0)
    held = {e: np.zeros_like(target) for e in edges}
    out: dict[str, str] = {}
    for dev in sorted(hists, key=lambda d: (-float(np.sum(hists[d])), d)):
        h = np.asarray(hists[dev], dtype=np.float64)
        least = min(float(v.sum()) for v in held.values())
        # keep edges' sizes even: only edges that, with this device, would not pass the smallest one's
        # size plus the device's own (an edge already at that size waits for the others)
        open_edges = [e for e in edges if held[e].sum() == least or held[e].sum() < least + h.sum()]

        def gap(e: str) -> float:
            mix = held[e] + h
            return float(np.abs(mix / max(mix.sum(), 1.0) - target).sum())

        best = min(open_edges, key=lambda e: (gap(e), e))
        held[best] += h
        out[dev] = best
    return out
