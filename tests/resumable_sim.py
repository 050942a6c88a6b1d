"""`splitedge sim --resumable` as a process of its own, killed at a crash point or not, and
the accuracies it wrote: shared by the resume and the downlink tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

DEVICES = 4
SIM = [sys.executable, "-m", "splitedge", "sim", "--resumable", "--rounds", "4", "--devices", str(DEVICES), "--edges", "2"]


def sim(out: Path, *args: str, crash: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("SPLITEDGE_CRASH_AT", None)
    if crash:
        env["SPLITEDGE_CRASH_AT"] = crash
    return subprocess.run([*SIM, "--out", str(out), *args], env=env, capture_output=True, text=True, timeout=300)


def accuracy(out: Path) -> list[tuple[int, float | None, float | None]]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [(r["round"], r.get("accuracy"), r.get("accuracy_calibrated")) for r in rows]
