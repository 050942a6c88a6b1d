"""Client sampling: which online devices train in a round (Flower's fraction_fit / min_fit_clients).

The cloud draws the round's participants from the devices its live edges list, seeded by the
run's seed and the round, so the same seed and the same online devices give the same draw
every time. The draw travels in the round announcement (`participants`); an edge waits only for
its drawn members, a device not drawn sits the round out. What a device that was not drawn
contributes is its method's: nothing to a weight average (FedAvg, its variants, SplitFed, the
self-supervised methods), its cached statistics where the method keeps them (H-SFP's edges merge
every member's latest moments of the current W_c).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

SAMPLING_STREAM = 0x5A3  # keeps the draws apart from every other use of the run's seed


@dataclass(frozen=True)
class Sampling:
    """`count` devices per round, or (count 0) `fraction` of the online ones, at least `minimum`;
    every online device when neither asks for fewer."""

    fraction: float = 1.0
    count: int = 0
    minimum: int = 1
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0 < self.fraction <= 1:
            raise ValueError(f"--sample-fraction must be in (0, 1], got {self.fraction}")
        if self.count < 0 or self.minimum < 1:
            raise ValueError(f"--sample-count must be >= 0 and --sample-min >= 1, got {self.count} and {self.minimum}")

    @property
    def active(self) -> bool:
        return self.count > 0 or self.fraction < 1

    def size(self, online: int) -> int:
        """How many of `online` devices a round draws: int(fraction * online) like Flower, or
        `count`; at least `minimum`, at most all of them."""
        wanted = self.count or int(self.fraction * online)
        return min(online, max(wanted, self.minimum))

    def draw(self, round_: int, online: Iterable[str]) -> tuple[str, ...]:
        """Round `round_`'s participants among `online` (sorted), or () when not sampling."""
        ids = sorted(set(online))
        if not self.active or not ids:
            return ()
        rng = np.random.default_rng([self.seed, round_, SAMPLING_STREAM])
        picked = rng.choice(len(ids), size=self.size(len(ids)), replace=False)
        return tuple(ids[i] for i in sorted(picked))
