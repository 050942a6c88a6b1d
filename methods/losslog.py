"""Loss bookkeeping without torch: per-term sample-weighted means, and their merge across tiers.

A training tier logs each loss term's mean over the round (`LossLog`); a device sends its means
and sample count in its `done` info, an edge merges its devices' (weighted by samples) and
adds its own, and the cloud's metrics get one map per tier, e.g.
``{"device": {"ce": 1.2, "feddecorr": 0.3, "total": 1.23}, "edge": {...}, "cloud": {...}}``.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Mapping, Sequence

from splitedge.protocol.done import dones


class LossLog:
    """Sample-weighted means of every term (and the weighted total) over the steps of a run."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}
        self.samples = 0

    def add(self, parts: Mapping[str, float], n: int) -> None:
        for name, value in parts.items():
            self.sums[name] = self.sums.get(name, 0.0) + float(value) * n
        self.samples += n

    def means(self) -> dict[str, float]:
        if not self.samples:
            return {}
        return {name: s / self.samples for name, s in self.sums.items() if math.isfinite(s)}


def merge_weighted(items: Iterable[tuple[Mapping[str, Any], int]]) -> tuple[dict[str, float], int]:
    """Sample-weighted mean of several loss maps; non-numeric or non-finite values are skipped."""
    log = LossLog()
    for losses, n in items:
        clean = {k: float(v) for k, v in losses.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
                 and math.isfinite(v)}
        if clean and n > 0:
            log.add(clean, int(n))
    return log.means(), log.samples


def tier_losses(reports: Sequence[Any], cloud: Mapping[str, float]) -> dict[str, dict[str, float]]:
    """The cloud's per-tier loss map for a round, from the edges' done infos (their devices'
    losses, merged by samples, and their own) and its own."""
    infos = list(dones(reports).values())
    out: dict[str, dict[str, float]] = {}
    dev, _ = merge_weighted((i.devices.loss, i.devices.samples) for i in infos if i.devices is not None and i.devices.loss)
    edge, _ = merge_weighted((i.loss, 1) for i in infos if i.loss)
    for tier, losses in (("device", dev), ("edge", edge), ("cloud", dict(cloud))):
        if losses:
            out[tier] = losses
    return out
