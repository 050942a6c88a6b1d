"""The minimum count per class: a device sends no statistic of a class it holds too few images of.

A class mean over one image is that image's feature vector, and a shallow W_c is easy to invert
(bench/leak.py measures how easy). So every per-class statistic a device sends (feature moments,
head statistics, prototypes, mean logits) is taken only over the classes it holds at least
`min_class_count` images of; the other classes' images are left out of every sum, the shared
covariance included, so the merge of what is sent stays exact for the rest. What was held back
is counted and reported in the device's `done` info. numpy only: thin devices apply it too.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class ClassFloor:
    """Which of a device's samples may enter its statistics under a minimum count per class.

    keep: bool [N], True for the samples of classes held at least `min_count` times.
    withheld_classes / withheld_samples: the classes (and their images) left out.
    """

    min_count: int
    keep: np.ndarray
    withheld_classes: int
    withheld_samples: int

    @classmethod
    def of(cls, labels: np.ndarray, min_count: int) -> ClassFloor:
        """The floor over a device's integer `labels` [N]."""
        if min_count < 1:
            raise ValueError(f"min_count must be >= 1, got {min_count}")
        y = np.asarray(labels).reshape(-1)
        if len(y) == 0 or min_count == 1:
            return cls(min_count, np.ones(len(y), dtype=bool), 0, 0)
        classes, inverse, counts = np.unique(y, return_inverse=True, return_counts=True)
        rare = counts < min_count
        return cls(min_count, ~rare[inverse], int(rare.sum()), int(counts[rare].sum()))

    @property
    def info(self) -> dict[str, int]:
        """What the device's `done` info reports (empty when nothing was held back)."""
        if not self.withheld_classes:
            return {}
        return {"classes": self.withheld_classes, "samples": self.withheld_samples}


def _count(value: Any, bound: int) -> bool:
    """A peer's count: an int (not a bool) in [0, bound)."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < bound


def summed_withheld(infos: Sequence[Any]) -> dict[str, int]:
    """The `withheld` entries of several done infos (devices', or edges' `devices.withheld`),
    summed: what a round held back below the floor, for the tier above. A peer's info is only
    reported, never acted on, so an entry that is no map of counts >= 0 is skipped, not fatal."""
    total = {"classes": 0, "samples": 0}
    for info in infos:
        if not isinstance(info, Mapping):
            continue
        values = [info.get(key, 0) for key in total]
        if all(_count(v, 2**53) for v in values):
            for key, v in zip(total, values):
                total[key] += v
    return total if total["classes"] else {}


def most_releases(counts: Sequence[Any]) -> int:
    """The largest count of differentially private releases in several done infos (a device's
    `dp_releases`, an edge's `devices.dp_releases`); entries that are no count >= 0 are skipped."""
    valid = [c for c in counts if _count(c, 2**31)]
    return max(valid, default=0)


class ReleaseLedger:
    """Each device's differentially private releases so far, as its dones say (on time or after
    its phase closed), for an edge to report only what the most of one device grew by: summed
    over an edge's dones this is the most any one of its devices released, not the sum of each
    phase's most (which counts a device twice when its done of one phase comes late and another
    device led that phase). Each device's privacy loss is its own releases (accountant.py)."""

    def __init__(self) -> None:
        self.made: dict[str, int] = {}  # device -> releases its dones reported, all phases
        self.reported = 0  # the most of one device, as far as this edge's dones have said it

    def add(self, device: str, count: Any) -> None:
        """`count` (a done info's `dp_releases`) more releases of `device`; no valid count, none."""
        made = most_releases([count])
        if made:
            self.made[device] = self.made.get(device, 0) + made

    def take(self) -> int:
        """What the most of one device grew by since the last take (0: nothing new to count)."""
        most = max(self.made.values(), default=0)
        grew, self.reported = max(most - self.reported, 0), max(most, self.reported)
        return grew

    def state(self) -> dict[str, Any]:
        return {"made": dict(self.made), "reported": self.reported}

    def restore(self, state: Any) -> None:
        """The ledger a restarted edge saved (runtime/statefile.py); none saved: a fresh one."""
        if isinstance(state, Mapping):
            self.made = {str(d): int(n) for d, n in dict(state.get("made") or {}).items()}
            self.reported = int(state.get("reported", 0))
