"""Who of a node's children is online, and who went offline only a moment ago.

Children publish a retained `status` ("online"; their last will says "offline"). A child that
just went offline is often about to come back: a broker restart fires every client's will and
the clients reconnect within a second or two. A round that dropped such a child at once would
close without it (or, when the whole site blinked, with nobody). So a round waits for a child
that is online or went offline less than `grace_s` ago; after that it goes on without it.
"""

from __future__ import annotations

import time
from collections.abc import Collection
from typing import Callable

REJOIN_GRACE_S = 5.0  # how long a round still waits for a child that went offline


class Presence:
    def __init__(self, grace_s: float = REJOIN_GRACE_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.grace_s, self.clock = grace_s, clock
        self.online: set[str] = set()
        self.gone_since: dict[str, float] = {}  # child -> when its offline status arrived

    def update(self, child: str, state: str) -> bool:
        """Record a status; True when it changed whether the child is online."""
        was = child in self.online
        if state == "online":
            self.online.add(child)
            self.gone_since.pop(child, None)
        else:
            self.online.discard(child)
            if was:
                self.gone_since[child] = self.clock()
        return was != (child in self.online)

    def live(self, among: Collection[str]) -> set[str]:
        """The children in `among` whose last status is online."""
        return self.online.intersection(among)

    def next_change_in(self) -> float | None:
        """Seconds until the next child still within its grace stops being awaited (None: no
        such child): when a round waiting on presence alone can next close, with no message."""
        now = self.clock()
        ends = [t + self.grace_s - now for t in self.gone_since.values() if now - t < self.grace_s]
        return max(0.0, min(ends)) if ends else None

    def awaited(self, among: Collection[str]) -> set[str]:
        """The children in `among` a round waits for: online, or offline for less than the grace.
        (An edge asks after every event it handles: one set intersection, plus the few just gone.)"""
        now = self.clock()
        out = self.online.intersection(among)
        out.update(c for c, t in self.gone_since.items() if now - t < self.grace_s and c in among)
        return out
