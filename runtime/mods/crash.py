"""Crash points as a mod: the node names its steps, and the chaos tests' SPLITEDGE_CRASH_AT ends
the process at one of them (runtime/faults.py)."""

from __future__ import annotations

from splitedge.runtime.faults import crash_point
from splitedge.runtime.mods import Mod


class CrashPoints(Mod):
    def __init__(self, tier: str) -> None:
        self.tier = tier

    def step(self, point: str, round_: int) -> None:
        crash_point(f"{self.tier}.{point}", round_)
