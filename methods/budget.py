"""The round's budget as a part's compute sees it: `checkpoint()` at batch boundaries.

A node's runtime bounds what a round's compute may take (runtime/guard.py: a time budget and a
memory ceiling). It cannot stop a computation from outside without leaving the part half
updated, so the compute looks in itself: the shared batch loops (methods/training.py
`train_epochs`, every torch part's training; methods/data/preprocess.py `accumulate`, every
device's statistics: moments, head statistics, private releases; `to_input`, every batch of images loaded, the thin trainer's
too) call
`checkpoint()` once a batch, which raises RoundFailed when the round is over its budget and does
nothing otherwise (nothing at all outside a guarded round: one thread-local lookup). The check
is per thread, so the virtual devices of a simulation, each on its own thread, keep their own.
numpy only, no import of the contract, like methods/errors.py.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import ContextManager

_local = threading.local()


def checkpoint() -> None:
    """At a batch boundary: RoundFailed when this thread's round is over its budget."""
    check = getattr(_local, "check", None)
    if check is not None:
        check()


@contextlib.contextmanager
def watching(check: Callable[[], None]) -> Iterator[None]:
    """`checkpoint()` calls `check` on this thread while the block runs (a guarded round)."""
    before = getattr(_local, "check", None)
    _local.check = check
    try:
        yield
    finally:
        _local.check = before


@contextlib.contextmanager
def evaluations(guard: Callable[[], ContextManager[object]]) -> Iterator[None]:
    """Evaluations of a served model in the block (methods/metrics/evaluate.py) run under `guard()`
    (the cloud's round guard): one over it is skipped with one logged line, and the merge around
    it goes on."""
    before = getattr(_local, "evaluation", None)
    _local.evaluation = guard
    try:
        yield
    finally:
        _local.evaluation = before


def evaluation_guard() -> ContextManager[object] | None:
    """The guard an evaluation runs under on this thread now (`evaluations`), or None."""
    guard = getattr(_local, "evaluation", None)
    return guard() if guard is not None else None
