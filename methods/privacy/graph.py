"""Who masks with whom: all pairs (SecAgg, Bonawitz et al. 2017) or a k-regular graph (SecAgg+,
Bell et al. 2020).

SecAgg+ replaces the complete graph by a random k-regular one: a device agrees masks and shares
its secrets with k neighbours only, so its work and its messages grow with k, not n. The graph
is a Harary graph (each node joined to the k/2 nearest on each side of a ring) over the devices
in a pseudo-random order, SHA-256(session || id), that every party computes alike from the
roster and the session without another message. Bell et al. show k = O(log n) keeps both privacy
and dropout tolerance with high probability; ``"log"`` here is the stated choice
k = 2 * ceil(log2 n) (20 at n = 1,000), not their tight constant.
"""

from __future__ import annotations

import hashlib
import math
from typing import Sequence

from .errors import SecAggError


def degree(neighbours: int | str | None, devices: int) -> int:
    """The number of neighbours of each device: n - 1 for None (all), k rounded up to even and
    capped at n - 1 for an int k, 2 * ceil(log2 n) for "log"."""
    if neighbours is None:
        return devices - 1
    if neighbours == "log":
        k = 2 * math.ceil(math.log2(max(devices, 2)))
    elif isinstance(neighbours, int) and not isinstance(neighbours, bool) and neighbours >= 1:
        k = neighbours + (neighbours % 2)  # a ring graph has k/2 neighbours on each side
    else:
        raise SecAggError(f"neighbours must be None (all), a positive int or 'log', got {neighbours!r}")
    return min(k, devices - 1)


def default_threshold(k: int) -> int:
    """t = floor(k/2) + 1: a majority of a device's share holders, so the edge plus fewer than t
    colluding devices learn nothing, while up to k - t holders may drop out."""
    return k // 2 + 1


class Graph:
    """The neighbour sets of one aggregation, from the sorted roster, the degree and the session."""

    def __init__(self, roster: Sequence[str], k: int, session: bytes) -> None:
        self.roster = tuple(roster)
        self.k = k
        self.complete = k >= len(self.roster) - 1
        self._all = frozenset(self.roster)
        self._cache: dict[str, frozenset[str]] = {}
        if not self.complete:
            if k % 2:
                raise SecAggError(f"graph: a ring graph needs an even degree, got {k}")
            self._ring = sorted(self.roster, key=lambda d: hashlib.sha256(session + d.encode()).digest())
            self._pos = {d: i for i, d in enumerate(self._ring)}

    def of(self, device: str) -> frozenset[str]:
        """The neighbours of ``device`` (never itself)."""
        out = self._cache.get(device)
        if out is None:
            if self.complete:
                out = self._all - {device}
            else:
                n, p = len(self._ring), self._pos[device]
                out = frozenset(self._ring[(p + s * j) % n] for j in range(1, self.k // 2 + 1) for s in (1, -1))
            self._cache[device] = out
        return out
