"""A hard memory cap for one measured process: a memory cgroup it joins before it starts.

`bench ram --device-mem-cap MB` runs the device inside it, so "completes its rounds under
100 MB" is tested by the kernel (the process is killed or fails to allocate past the cap), not
read off a peak. cgroup v2 (`memory.max`) or v1 (`memory.limit_in_bytes`, swap capped too where
`memory.memsw.limit_in_bytes` exists); one line saying why when neither can be created here.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

ROOT = Path("/sys/fs/cgroup")


class MemoryCap:
    """A fresh memory cgroup of `limit_mb` MB; `join()` (a preexec_fn) moves the caller in."""

    def __init__(self, limit_mb: float, root: Path = ROOT) -> None:
        self.limit = int(limit_mb * 1024 * 1024)
        name = f"splitedge-bench-{uuid.uuid4().hex[:8]}"
        v2, v1 = root / "cgroup.controllers", root / "memory"
        try:
            if v2.is_file() and "memory" in v2.read_text().split():
                self.path = root / name
                self.path.mkdir()
                (self.path / "memory.max").write_text(str(self.limit))
                if (self.path / "memory.swap.max").exists():
                    (self.path / "memory.swap.max").write_text("0")
            elif v1.is_dir():
                self.path = v1 / name
                self.path.mkdir()
                (self.path / "memory.limit_in_bytes").write_text(str(self.limit))
                if (self.path / "memory.memsw.limit_in_bytes").exists():
                    (self.path / "memory.memsw.limit_in_bytes").write_text(str(self.limit))
            else:
                raise OSError("no memory cgroup controller under /sys/fs/cgroup")
        except OSError as exc:
            raise ValueError(f"--device-mem-cap needs a writable memory cgroup (run as root, or drop the cap): {exc}") from None

    def join(self) -> None:
        """Called in the child between fork and exec: everything it allocates counts."""
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def events(self) -> dict[str, float]:
        """How often the cap was hit and what it held at most: v2's memory.events (max, oom_kill)
        and memory.peak; v1's failcnt (memory, and memory+swap), oom_control's oom_kill and
        max_usage_in_bytes."""
        def read(name: str) -> str | None:
            path = self.path / name
            return path.read_text() if path.exists() else None

        if read("memory.events") is not None:
            out: dict[str, float] = {k: int(v) for k, v in (line.split() for line in read("memory.events").splitlines())}
            if read("memory.peak") is not None:
                out["peak_mb"] = int(read("memory.peak")) / 2**20
            return out
        out = {"failcnt": int(read("memory.failcnt") or 0), "memsw_failcnt": int(read("memory.memsw.failcnt") or 0)}
        oom = dict(line.split() for line in (read("memory.oom_control") or "").splitlines() if " " in line)
        out["oom_kill"] = int(oom.get("oom_kill", 0))
        out["peak_mb"] = int(read("memory.max_usage_in_bytes") or 0) / 2**20
        return out

    def close(self) -> None:
        try:
            self.path.rmdir()
        except OSError:
            pass
