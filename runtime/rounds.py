"""Round bookkeeping shared by the edge and the cloud: who must report, quorum, deadline.

A round opens with the set of live children expected to report. Messages for another round
are stale and dropped; a message id seen before is a duplicate and dropped; both are counted.
A round's calibration phase opens the same round again: a `done` of the other phase (a late
child's) is stale there, so it cannot close the phase it does not belong to.
A round closes when every live child has sent `done` (quorum) or its deadline passes; the
caller then gets one report per child with its messages grouped by kind.
"""

from __future__ import annotations

import collections
import time
from typing import Any, Callable

from splitedge.methods.contract import RoundReport

SEEN_IDS = 4096  # remember this many message ids for duplicate detection
DONE_PHASES = ("round", "calibrate", "evaluate")
"""A `done` body's phase: the round's training, its calibration, or its evaluation."""


def done_phase(phase: str) -> str:
    """The `done` phase of a round plan's phase ("train" -> "round", "calibrate", "evaluate")."""
    return phase if phase in DONE_PHASES else "round"


class RoundCollector:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.round: int | None = None
        self.phase = DONE_PHASES[0]
        self.deadline = 0.0
        self.expected: set[str] = set()
        self.reports: dict[str, RoundReport] = {}
        self.done: set[str] = set()
        self.counts = collections.Counter()
        self._seen: collections.deque[str] = collections.deque(maxlen=SEEN_IDS)
        self._seen_set: set[str] = set()

    @property
    def is_open(self) -> bool:
        return self.round is not None

    def open(self, round_: int, deadline_s: float, expected: set[str], phase: str = "train") -> None:
        self.round, self.deadline, self.phase = round_, self.clock() + deadline_s, done_phase(phase)
        self.expected, self.reports, self.done = set(expected), {}, set()

    def add(self, env: Any) -> bool:
        """Record a child's message; False (and counted) when stale or a duplicate."""
        if self._is_duplicate(env.msg_id):
            self.counts["duplicate"] += 1
            return False
        if self.round is None or env.round != self.round or (
                env.kind == "done" and env.body.get("phase", DONE_PHASES[0]) != self.phase):
            self.counts["stale"] += 1
            return False
        self.reports.setdefault(env.sender, RoundReport(env.sender)).messages.setdefault(env.kind, []).append(env)
        if env.kind == "done":
            self.done.add(env.sender)
        self.expected.add(env.sender)
        return True

    def _is_duplicate(self, msg_id: str) -> bool:
        if msg_id in self._seen_set:
            return True
        if len(self._seen) == self._seen.maxlen:
            self._seen_set.discard(self._seen[0])
        self._seen.append(msg_id)
        self._seen_set.add(msg_id)
        return False

    def complete(self, awaited: set[str]) -> bool:
        """Every expected child still awaited (online, or only just gone: `Presence.awaited`)
        has finished. A round in which nobody has finished and no expected child is awaited is
        not complete: its children went offline together and may be back before the deadline."""
        alive = self.expected & awaited
        if self.expected and not (self.done or alive):
            return False
        return self.is_open and not alive - self.done

    def remaining_s(self) -> float:
        """Seconds to the open round's deadline (0 when past it or when no round is open)."""
        return max(0.0, self.deadline - self.clock()) if self.is_open else 0.0

    def expired(self) -> bool:
        return self.is_open and self.clock() >= self.deadline

    def close(self) -> list[RoundReport]:
        missing = self.expected - self.done
        if missing:
            self.counts["missed"] += len(missing)
        reports = [self.reports[s] for s in sorted(self.reports)]
        self.round = None
        return reports
