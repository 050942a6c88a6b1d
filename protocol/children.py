"""Child processes that end with the process that started them, however it ends.

A bench or a sim starts Mosquitto and worker processes. When it is stopped with kill -9, runs
out of memory or is crashed on purpose (SPLITEDGE_CRASH_AT), no ``finally`` runs, and its
brokers used to stay behind as orphans holding ports and memory. On Linux a child can ask the
kernel for a signal when its parent goes (``PR_SET_PDEATHSIG``). The kernel's "parent" is the
*thread* that forked the child, not the process: a broker restarted from a short-lived thread
(a sim's round callback) would be terminated as soon as that thread returned. So every child
is forked by one spawner thread that lives as long as the process does.

Elsewhere (macOS, Windows) children are started as before and can still be left behind.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

PR_SET_PDEATHSIG = 1
"""prctl(2) option: the signal this process gets when the thread that forked it exits."""


def _prctl() -> Callable[..., int] | None:
    """libc's prctl, resolved before any fork (a forked child must not load libraries)."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # a libc without prctl (exotic): children as before
        return None


_PRCTL = _prctl()


def _die_with(parent: int, sig: int) -> None:
    """Runs in the child between fork and exec: ask for `sig` when the spawner thread goes,
    and end now if the parent already went (the request would then never fire)."""
    if _PRCTL is not None:
        _PRCTL(PR_SET_PDEATHSIG, sig, 0, 0, 0)
    if os.getppid() != parent:
        os._exit(1)


@dataclass
class _Request:
    argv: list[str]
    kwargs: dict[str, Any]
    sig: int
    done: threading.Event = field(default_factory=threading.Event)
    proc: subprocess.Popen | None = None
    error: BaseException | None = None


class _Spawner:
    """The process-lifetime thread that forks every child (so the kernel's parent never exits early)."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.requests: queue.SimpleQueue[_Request] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._serve, name="splitedge-spawner", daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            req = self.requests.get()
            try:
                req.proc = subprocess.Popen(req.argv, preexec_fn=lambda: _die_with(self.pid, req.sig),
                                            **req.kwargs)
            except BaseException as exc:  # noqa: BLE001 - handed back to the caller's thread
                req.error = exc
            req.done.set()


_lock = threading.Lock()
_spawner: _Spawner | None = None


def _the_spawner() -> _Spawner:
    global _spawner
    with _lock:
        if _spawner is None or _spawner.pid != os.getpid():  # none yet, or inherited through fork
            _spawner = _Spawner()
        return _spawner


def spawn_tied(argv: list[str], *, sig: int = signal.SIGTERM, **popen_kwargs: Any) -> subprocess.Popen:
    """``subprocess.Popen(argv, **popen_kwargs)`` for a child that gets `sig` when this process
    ends, on Linux; a plain Popen elsewhere. Raises what Popen raises (e.g. FileNotFoundError)."""
    if _PRCTL is None:
        return subprocess.Popen(argv, **popen_kwargs)
    if "preexec_fn" in popen_kwargs:
        raise ValueError("spawn_tied sets preexec_fn itself")
    req = _Request(list(argv), popen_kwargs, int(sig))
    _the_spawner().requests.put(req)
    req.done.wait()
    if req.error is not None:
        raise req.error
    assert req.proc is not None
    return req.proc
