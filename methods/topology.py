"""Peer graphs for decentralised learning: who talks to whom in a run with peers (DecMAR).

A graph is a plain ``dict`` mapping each device id to the sorted tuple of its neighbours'
ids: undirected (symmetric), no self-loops, keys in the order the devices were given.

* :func:`erdos_renyi` draws G(n, p) with p = mean_degree / (n - 1), resampled until connected
  (../shared/METHODS.md, "FedMAR and DecMAR"); :func:`ring` is the deterministic baseline.
* :func:`write_graph` saves ``graph.json`` and ``graph.png`` for a run's report.
* protocol/acl.py's ``peer_acl`` turns a graph into the broker ACL that enforces it.

Shared by DecMAR's cloud part (it places the peers), the serverless device runtime (it checks
the plan's graph) and ``splitedge peers`` (it draws one), so it sits beside the methods.

numpy at import time; matplotlib only inside :func:`write_graph`.
"""

from __future__ import annotations

import json
import math
from collections import deque
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from splitedge.protocol.acl import check_devices, check_graph  # noqa: F401 (check_graph belongs to this API too)

Graph = dict[str, tuple[str, ...]]


# -- building graphs ------------------------------------------------------------------------
def _from_adjacency(ids: list[str], adj: np.ndarray) -> Graph:
    return {d: tuple(sorted(ids[j] for j in np.flatnonzero(adj[i]))) for i, d in enumerate(ids)}


def _adjacency_connected(adj: np.ndarray) -> bool:
    n = len(adj)
    seen = np.zeros(n, dtype=bool)
    seen[0] = True
    frontier = np.zeros(n, dtype=bool)
    frontier[0] = True
    while frontier.any():
        reach = adj[frontier].any(axis=0) & ~seen
        seen |= reach
        frontier = reach
    return bool(seen.all())


def erdos_renyi(devices: Sequence[str], mean_degree: float, rng: np.random.Generator,
                max_tries: int = 1000) -> Graph:
    """A connected Erdos-Renyi graph G(n, p), p = mean_degree / (n - 1) clipped to [0, 1].

    Each try draws every pair independently (one ``rng.random`` matrix, upper triangle), and
    is kept only if connected; after ``max_tries`` failures a ValueError names the degree. The
    result depends only on the device order, the degree and the rng state. ``mean_degree`` is
    the expected degree of the unconditioned draw: keeping only connected graphs raises the
    realised mean somewhat at low degrees (a connected graph has >= n - 1 edges, so a mean
    degree >= 2 (n - 1) / n). mean_degree >= n - 1 gives the complete graph.
    """
    ids = check_devices(devices)
    if not isinstance(mean_degree, (int, float, np.integer, np.floating)) or not math.isfinite(mean_degree) \
            or mean_degree < 0:
        raise ValueError(f"mean_degree must be a finite number >= 0, got {mean_degree!r}")
    if max_tries < 1:
        raise ValueError(f"max_tries must be >= 1, got {max_tries}")
    n = len(ids)
    if n == 1:
        return {ids[0]: ()}
    p = min(1.0, max(0.0, float(mean_degree) / (n - 1)))
    upper = np.triu(np.ones((n, n), dtype=bool), k=1)
    if p > 0:
        for _ in range(max_tries):
            adj = (rng.random((n, n)) < p) & upper
            adj |= adj.T
            if _adjacency_connected(adj):
                return _from_adjacency(ids, adj)
    raise ValueError(f"no connected Erdos-Renyi graph on {n} devices with mean degree {mean_degree:g} "
                     f"(p = {p:.4g}) in {max_tries} tries; raise the mean degree (about ln(n) = "
                     f"{math.log(n):.2f} or more connects most draws) or max_tries")


def ring(devices: Sequence[str]) -> Graph:
    """Each device linked to the ones before and after it (in the given order, wrapping round).

    Two devices get one neighbour each, a single device none."""
    ids = check_devices(devices)
    n = len(ids)
    return {d: tuple(sorted({ids[(i - 1) % n], ids[(i + 1) % n]} - {d})) for i, d in enumerate(ids)}


# -- reading graphs -------------------------------------------------------------------------
def is_connected(graph: Mapping[str, Sequence[str]]) -> bool:
    """True when every device reaches every other one (a single device is connected, an empty
    graph is not)."""
    if not graph:
        return False
    start = next(iter(graph))
    seen = {start}
    queue = deque([start])
    while queue:
        for p in graph[queue.popleft()]:
            if p not in seen:
                seen.add(p)
                queue.append(p)
    return len(seen) == len(graph)


def degrees(graph: Mapping[str, Sequence[str]]) -> dict[str, int]:
    """Number of neighbours per device."""
    return {d: len(nbrs) for d, nbrs in graph.items()}


def edge_list(graph: Mapping[str, Sequence[str]]) -> list[list[str]]:
    """Each link once as ``[a, b]`` with a < b, the list sorted."""
    return sorted([a, b] for a, nbrs in graph.items() for b in nbrs if a < b)


def mean_degree(graph: Mapping[str, Sequence[str]]) -> float:
    """Average number of neighbours (2 |E| / n); 0 for an empty graph."""
    return float(np.mean(list(degrees(graph).values()))) if graph else 0.0


# -- files ----------------------------------------------------------------------------------
def write_graph(out_dir: Path, graph: Mapping[str, Sequence[str]], *, title: str = "") -> list[Path]:
    """Write ``graph.json`` and ``graph.png`` into ``out_dir`` (created); returns both paths.

    The JSON holds ``edges`` (:func:`edge_list`), ``neighbours`` (sorted, per device, in the
    graph's order), ``degrees``, ``mean_degree``, ``connected``, ``devices`` and ``title``.
    The picture puts the devices on a circle in the graph's order, links as straight lines.
    """
    check_graph(graph)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    devices = list(graph)
    doc: dict[str, Any] = {
        "title": title,
        "devices": devices,
        "edges": edge_list(graph),
        "neighbours": {d: sorted(graph[d]) for d in devices},
        "degrees": degrees(graph),
        "mean_degree": mean_degree(graph),
        "connected": is_connected(graph),
    }
    json_path = out / "graph.json"
    json_path.write_text(json.dumps(doc, indent=1) + "\n")
    png_path = out / "graph.png"
    _plot(png_path, graph, title or f"{len(devices)} devices, mean degree {doc['mean_degree']:.2f}")
    return [json_path, png_path]


def _plot(path: Path, graph: Mapping[str, Sequence[str]], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    devices = list(graph)
    angle = np.pi / 2 - 2 * np.pi * np.arange(len(devices)) / max(1, len(devices))
    xy = {d: (math.cos(a), math.sin(a)) for d, a in zip(devices, angle)}
    fig, ax = plt.subplots(figsize=(4, 4))
    try:
        for a, b in edge_list(graph):
            ax.plot([xy[a][0], xy[b][0]], [xy[a][1], xy[b][1]], color="0.6", linewidth=0.8, zorder=1)
        ax.scatter([xy[d][0] for d in devices], [xy[d][1] for d in devices], s=120, color="tab:blue", zorder=2)
        fontsize = 8 if len(devices) <= 20 else 5
        for d in devices:
            x, y = xy[d]
            ax.annotate(d, (x, y), xytext=(x * 1.15, y * 1.15), ha="center", va="center", fontsize=fontsize)
        ax.set_title(title, fontsize=9)
        ax.set_xlim(-1.35, 1.35)
        ax.set_ylim(-1.35, 1.35)
        ax.set_aspect("equal")
        ax.axis("off")
        fig.tight_layout()
        fig.savefig(path, dpi=80)
    finally:
        plt.close(fig)
