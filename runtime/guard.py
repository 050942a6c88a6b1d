"""A guarded round: what a round's compute may take on this node, a memory ceiling and a time budget.

A node's owner bounds its rounds (`--max-round-memory-mb`, `--round-budget-s` on `splitedge
device`, `edge` and `cloud`): a device's round (training, statistics, calibration, evaluation),
an edge's merge, the cloud's merge and evaluation. A round over either bound fails in one logged
line (RoundFailed: what was exceeded, the bound and the flag that raises it); the node stays up
and takes the next round; a device's parent gets `done {failed, reason}` and counts it
(runtime/records.py, an edge's `devices.failed`).

- Time: a deadline starts with the round's compute; the compute checks it at every batch
  boundary (methods/budget.py `checkpoint()`) and the runtime once more before it sends what the
  round made, so a round over budget fails before anything of it leaves the node or is
  committed. By default the budget is the round's deadline as the cloud announces it: a compute
  that outlives its round is wasted anyway. A single native call that never returns (one batch
  that never ends) is not interrupted: the check comes at the next boundary.
- Memory, hard: a process of its own (`splitedge device`, `edge`, `cloud`) sets the ceiling as
  its RLIMIT_DATA (Linux counts heap and private anonymous mappings, which is where numpy and
  torch put their arrays, and not the shared libraries' text, so torch's large address space
  does not count). An allocation beyond it fails inside the round (numpy's MemoryError, torch's
  "can't allocate memory" RuntimeError), which fails the round here, before the part commits
  anything; the memory is freed with the round's frames. By default the ceiling is three
  quarters of the machine's RAM (and at least twice what the process holds once started): far above what any round of the bench needs (a thin device
  under 100 MB, a torch device under 2 GB), low enough that a runaway allocation fails the round
  instead of calling the kernel's OOM killer on the whole device.
- Memory, soft: where no rlimit is set, the process's resident memory is compared with the
  ceiling at every batch boundary (at most every RSS_EVERY_S). In a simulation every node shares
  one process, so no rlimit is set and the ceiling, when given (`splitedge sim
  --max-round-memory-mb`), bounds the whole process's resident memory, checked at the
  boundaries: it cannot be one device's.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import logging
import math
import resource
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import psutil

from splitedge.methods import budget
from splitedge.methods.errors import RoundFailed

log = logging.getLogger(__name__)

MEMORY_FLAG, TIME_FLAG = "--max-round-memory-mb", "--round-budget-s"
RSS_EVERY_S = 0.25  # the soft memory check reads the process's resident memory at most this often
DEFAULT_RAM_FRACTION = 0.75  # the default ceiling: this share of the machine's RAM,
DEFAULT_HEADROOM = 2.0  # and at least twice what the process holds once started (torch on a 1 GB board)
MB = 2**20
ALLOCATION_FAILED = ("can't allocate memory", "cannot allocate memory", "bad_alloc", "bad allocation",
                     "out of memory")
"""What torch's and onnxruntime's allocators say when an allocation fails (RuntimeError, not MemoryError)."""


class OverBudget(RoundFailed):
    """A round over its node's memory ceiling ("memory") or time budget ("time")."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


def default_memory_mb() -> int:
    """Three quarters of the machine's RAM, in MB."""
    return int(psutil.virtual_memory().total * DEFAULT_RAM_FRACTION / MB)


def rss_mb() -> float:
    """The process's resident memory now, in MB."""
    return psutil.Process().memory_info().rss / MB


def data_mb() -> float | None:
    """What the process's RLIMIT_DATA counts now (Linux VmData), in MB; None elsewhere."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmData:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def allocation_failed(exc: BaseException) -> bool:
    """A failed allocation: numpy's MemoryError, or a native allocator's RuntimeError."""
    if isinstance(exc, MemoryError):
        return True
    return isinstance(exc, RuntimeError) and any(s in str(exc).lower() for s in ALLOCATION_FAILED)


@dataclass
class RoundGuard:
    """`memory_mb`: the ceiling (None: none); `budget_s`: the time budget (None: the round's
    deadline; inf: none); `who`: the node, for the messages ("device d3"); `hard`: the ceiling is the
    process's RLIMIT_DATA too (`limit_process` set it)."""

    memory_mb: float | None = None
    budget_s: float | None = None
    who: str = "node"
    hard: bool = False
    chosen: bool = True
    """The ceiling is the owner's (a flag): below what the process holds at start it is refused.
    The default is raised instead to DEFAULT_HEADROOM times that (a small machine's torch)."""
    failures: collections.Counter[str] = field(default_factory=collections.Counter, repr=False)
    """Rounds that failed over a bound, by reason ("memory", "time"), for its owner to read and clear."""
    _next_rss: float = field(default=0.0, repr=False)

    @classmethod
    def from_args(cls, args: argparse.Namespace, who: str, *, process: bool = True,
                  untimed: bool = False) -> "RoundGuard":
        """The guard of a role's command line (`add_arguments`): with `process` (a process of its
        own, not a sim's) the ceiling defaults to 3/4 of the RAM, set by `limit_process()`; with
        `untimed` there is no time budget unless the flag gives one (the cloud's evaluation)."""
        memory = args.max_round_memory_mb
        if memory is None:
            memory = default_memory_mb() if process else 0
        if memory < 0 or (args.round_budget_s is not None and args.round_budget_s <= 0):
            raise ValueError(f"{MEMORY_FLAG} must be >= 0 (0: no ceiling) and {TIME_FLAG} > 0, got "
                             f"{args.max_round_memory_mb} and {args.round_budget_s}")
        budget_s = args.round_budget_s if args.round_budget_s is not None or not untimed else math.inf
        return cls(memory_mb=float(memory) or None, budget_s=budget_s, who=who,
                   chosen=args.max_round_memory_mb is not None)

    def limit_process(self) -> None:
        """Set the ceiling as this process's RLIMIT_DATA (a process that is this node alone; after
        its heavy imports). ValueError when the process already holds more (no allocation could
        succeed). Nothing without a ceiling."""
        if not self.memory_mb:
            return
        held = data_mb()
        if held is not None and not self.chosen and held * DEFAULT_HEADROOM > self.memory_mb:
            self.memory_mb = held * DEFAULT_HEADROOM
        if held is not None and held >= self.memory_mb:
            raise ValueError(f"{MEMORY_FLAG} {self.memory_mb:.0f} is below what this {self.who.split()[0]} holds "
                             f"before any round ({held:.0f} MB of data): give at least {held * 1.5:.0f}")
        soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
        ceiling = int(self.memory_mb * MB)
        if hard != resource.RLIM_INFINITY and hard < ceiling:
            ceiling = hard
        resource.setrlimit(resource.RLIMIT_DATA, (ceiling, hard))
        self.hard = True

    def describe(self) -> str:
        """One phrase for the start-up line."""
        memory = f"memory ceiling {self.memory_mb:.0f} MB" + ("" if self.hard else " (resident, checked per batch)") \
            if self.memory_mb else "no memory ceiling"
        budget = "no time budget" if self.budget_s == math.inf else \
            f"time budget {self.budget_s:g} s" if self.budget_s else "time budget: the round's deadline"
        return f"{memory}, {budget}"

    @contextlib.contextmanager
    def round(self, what: str, deadline_s: float) -> Iterator["RoundCheck"]:
        """Guard the block's compute of `what` ("round 3", "round 3 merge"), whose deadline is
        `deadline_s`: `checkpoint()` inside it, and `check()` of what it yields, raise OverBudget
        when over; a failed allocation in it becomes OverBudget too (one line, no traceback)."""
        budget_s = self.budget_s or deadline_s
        check = RoundCheck(self, what, budget_s, time.monotonic() + budget_s)
        try:
            with budget.watching(check):
                yield check
        except OverBudget as exc:
            self.failures[exc.reason] += 1
            raise
        except (MemoryError, RuntimeError) as exc:
            if not allocation_failed(exc):
                raise
            self.failures["memory"] += 1
            said = " ".join(str(exc).split())[:200] or type(exc).__name__
            raise OverBudget(f"{what} ran out of memory under its ceiling of "
                             f"{self._ceiling()} ({said}); raise it with {MEMORY_FLAG}", "memory") from None

    def _ceiling(self) -> str:
        return f"{self.memory_mb:.0f} MB" if self.memory_mb else "none (the machine's own memory)"


@dataclass
class RoundCheck:
    """One guarded round's check (`checkpoint()` calls it)."""

    guard: RoundGuard
    what: str
    budget_s: float
    ends: float
    started: float = field(default_factory=time.monotonic)

    def __call__(self) -> None:
        now, g = time.monotonic(), self.guard
        if now > self.ends:
            raise OverBudget(f"{self.what} exceeded its time budget of {self.budget_s:g} s (ran "
                             f"{now - self.started:.1f} s); raise it with {TIME_FLAG}", "time")
        if g.memory_mb and not g.hard and now >= g._next_rss:  # with the rlimit set, allocations fail instead
            g._next_rss = now + RSS_EVERY_S
            held = rss_mb()
            if held > g.memory_mb:
                raise OverBudget(f"{self.what} holds {held:.0f} MB, over its memory ceiling of "
                                 f"{g.memory_mb:.0f} MB; raise it with {MEMORY_FLAG}", "memory")

    check = __call__


def add_arguments(p: argparse.ArgumentParser, what: str, *, process: bool = True, untimed: bool = False) -> None:
    """`--max-round-memory-mb` and `--round-budget-s` of a role's command (`what`: what a round's
    compute is there, e.g. "a round's training and statistics"; `untimed`: no time budget by
    default)."""
    where = ("the process's data memory (its RLIMIT_DATA: heap and arrays, not shared libraries); default: 3/4 "
             "of this machine's RAM; 0: no ceiling") if process else \
        ("the whole process's resident memory, checked per batch (every node of a sim shares it; no rlimit); "
         "default: none")
    p.add_argument(MEMORY_FLAG, type=float, default=None, metavar="MB",
                   help=f"memory ceiling of {what}: a round over it fails (one logged line) and the next goes on; "
                        f"{where}")
    p.add_argument(TIME_FLAG, type=float, default=None, metavar="S",
                   help=f"time budget of {what}, in seconds: a round over it fails at the next batch (one logged "
                        f"line) and the next goes on; default: " + ("none" if untimed else
                                                                    "the round's deadline as the cloud announces it"))
