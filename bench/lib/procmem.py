"""Peak memory of OS processes: psutil RSS sampling plus the kernel's own high-water mark.

Sampling every ~50 ms can miss a short spike, so each sample also reads VmHWM from
/proc/<pid>/status (the kernel's peak RSS of the process, monotonic); the larger of the two
is the number to trust. RSS counts the shared library pages a process touched (``import torch``
alone is ~500 MB of mostly file-backed libtorch pages), so the peak USS (memory only this
process holds) is sampled too, less often because reading smaps is slow.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Mapping

import psutil

REPO = Path(__file__).resolve().parents[2]


def vm_hwm_bytes(pid: int) -> int | None:
    """VmHWM of a live process (bytes), or None when it is gone or not on Linux."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return None


class PeakSampler:
    """A thread sampling RSS and VmHWM of named pids every ``interval`` seconds."""

    def __init__(self, interval: float = 0.05, uss_every: int = 10) -> None:
        self.interval = interval
        self.uss_every = uss_every
        self.peaks: dict[str, dict[str, Any]] = {}
        self._procs: dict[str, psutil.Process] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="peak-sampler", daemon=True)

    def watch(self, name: str, pid: int) -> None:
        with self._lock:
            self._procs[name] = psutil.Process(pid)
            self.peaks[name] = {"pid": pid, "peak_rss_bytes": 0, "vm_hwm_bytes": None, "peak_uss_bytes": None,
                               "samples": 0, "cpu_s": None}

    def start(self) -> PeakSampler:
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                items = list(self._procs.items())
            for name, proc in items:
                self._sample(name, proc)
            self._stop.wait(self.interval)

    def _sample(self, name: str, proc: psutil.Process) -> None:
        try:
            rss = proc.memory_info().rss
            times = proc.cpu_times()
        except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
            return
        hwm = vm_hwm_bytes(proc.pid)
        uss = None
        if self.peaks[name]["samples"] % self.uss_every == 0:
            try:
                uss = proc.memory_full_info().uss
            except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
                pass
        with self._lock:
            peak = self.peaks[name]
            if uss is not None:
                peak["peak_uss_bytes"] = max(peak["peak_uss_bytes"] or 0, uss)
            peak["peak_rss_bytes"] = max(peak["peak_rss_bytes"], rss)
            peak["cpu_s"] = times.user + times.system  # the last sample before it exits: within one interval
            if hwm is not None:
                peak["vm_hwm_bytes"] = max(peak["vm_hwm_bytes"] or 0, hwm)
            peak["samples"] += 1

    def stop(self) -> dict[str, dict[str, Any]]:
        self._stop.set()
        self._thread.join(5)
        with self._lock:
            return {k: dict(v) for k, v in self.peaks.items()}


def spawn_splitedge(args: list[str], log_path: Path, *, python: str | None = None,
                    env: Mapping[str, str] | None = None, preexec: Callable[[], None] | None = None) -> subprocess.Popen:
    """``python -m splitedge ARGS`` with one intra-op thread (as on a small device), logging to a
    file. ``python`` is the interpreter (default: this one; another venv's, e.g. with a different
    torch build, needs splitedge installed in it); ``env`` is added to the environment. Runs
    from the log's folder, so the installed package is what runs, never a bare repo folder.
    ``preexec`` runs in the child before exec (e.g. joining a memory cgroup, bench/memcap.py)."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    with open(log_path, "w") as log:
        return subprocess.Popen([python or sys.executable, "-m", "splitedge", *args], stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=full_env,
                                cwd=log_path.parent, preexec_fn=preexec)


def wait_all(procs: dict[str, subprocess.Popen], first: str, timeout: float, grace: float = 20.0) -> dict[str, int]:
    """Wait for ``first`` (the cloud) up to ``timeout``, then the rest up to ``grace``; kill
    stragglers. Returns exit codes (negative: killed by us)."""
    deadline = time.monotonic() + timeout
    codes: dict[str, int] = {}
    order = [first] + [n for n in procs if n != first]
    for name in order:
        limit = deadline if name == first else max(deadline, time.monotonic()) + grace
        try:
            codes[name] = procs[name].wait(max(0.1, limit - time.monotonic()))
        except subprocess.TimeoutExpired:
            procs[name].kill()
            procs[name].wait(5)
            codes[name] = -9
        if name == first:
            deadline = time.monotonic()
    return codes
