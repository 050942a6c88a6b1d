"""Soak: a long digits run as separate processes on a private Mosquitto, watching every
process's RSS and open descriptors per window of rounds.

A leak shows as a peak that keeps rising window after window (a cache that is never pruned,
a subscription per round, a socket per reconnect); a flat series is the pass. The run is the
deployed shape: `splitedge cloud`, `splitedge edge` and `splitedge device` processes, each
device reading its own .npz shard, the broker counted too.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import psutil

from splitedge.bench.lib.procmem import spawn_splitedge, wait_all
from splitedge.bench.lib.report import pyplot, save_figure, table

MB = 1024 * 1024


@dataclass
class SoakSettings:
    rounds: int = 500
    window: int = 50
    devices: int = 4
    edges: int = 2
    method: str = "hsfp"
    seed: int = 0
    interval_s: float = 0.5

    @classmethod
    def from_args(cls, a: argparse.Namespace) -> "SoakSettings":
        rounds = a.rounds or (40 if a.quick else cls.rounds)
        method = a.methods[0] if a.methods else cls.method
        return cls(rounds=rounds, window=max(1, rounds // 10), devices=a.devices or cls.devices,
                   edges=a.edges or cls.edges, method=method, seed=a.seed)


Settings = SoakSettings


class WindowSampler:
    """Every `interval_s`, each watched process's RSS and descriptor count, kept as the peak of
    the window of rounds the run is in (rounds done so far // window)."""

    def __init__(self, metrics: Path, window: int, interval_s: float) -> None:
        self.metrics, self.window, self.interval_s = metrics, window, interval_s
        self.procs: dict[str, psutil.Process] = {}
        self.peaks: dict[str, dict[int, dict[str, int]]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def watch(self, name: str, pid: int) -> None:
        self.procs[name] = psutil.Process(pid)
        self.peaks[name] = {}

    def rounds_done(self) -> int:
        try:
            return sum(1 for _ in self.metrics.open())
        except OSError:
            return 0

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            w = self.rounds_done() // self.window
            for name, proc in list(self.procs.items()):
                try:
                    rss, fds = proc.memory_info().rss, proc.num_fds()
                except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
                    continue
                peak = self.peaks[name].setdefault(w, {"rss": 0, "fds": 0})
                peak["rss"], peak["fds"] = max(peak["rss"], rss), max(peak["fds"], fds)

    def start(self) -> "WindowSampler":
        self._thread.start()
        return self

    def stop(self) -> dict[str, dict[int, dict[str, int]]]:
        self._stop.set()
        self._thread.join(5)
        return self.peaks


def write_digit_shards(folder: Path, devices: int, seed: int = 0) -> list[Path]:
    """digits cut IID into one .npz shard per device (d0.npz, ...), as a device reads it."""
    from splitedge.methods.data.datasets import load_dataset, save_shard
    from splitedge.methods.data.partition import iid

    (x, y), _, _ = load_dataset("digits")
    paths = []
    for d, idx in enumerate(iid(y, devices, np.random.default_rng(seed))):
        paths.append(folder / f"d{d}.npz")
        save_shard(paths[-1], x[idx], y[idx])
    return paths


def run(s: SoakSettings) -> tuple[dict[str, Any], dict[str, Any]]:
    from splitedge.protocol.broker import MosquittoBroker

    config = {"rounds": s.rounds, "window": s.window, "devices": s.devices, "edges": s.edges, "method": s.method,
              "seed": s.seed, "dataset": "digits"}
    with tempfile.TemporaryDirectory(prefix="splitedge-soak-") as tmp, MosquittoBroker() as broker:
        work = Path(tmp)
        out = work / "out"
        common = ["--broker", broker.url, "--run", "soak"]
        procs = {"cloud": spawn_splitedge(["cloud", *common, "--method", s.method, "--rounds", str(s.rounds),
                                           "--edges", str(s.edges), "--devices", str(s.devices), "--seed",
                                           str(s.seed), "--deadline", "60", "--out", str(out)], work / "cloud.log")}
        for e in range(s.edges):
            procs[f"e{e}"] = spawn_splitedge(["edge", *common, "--id", f"e{e}", "--seed", str(s.seed)],
                                             work / f"e{e}.log")
        for d, shard in enumerate(write_digit_shards(work, s.devices, s.seed)):
            procs[f"d{d}"] = spawn_splitedge(["device", *common, "--id", f"d{d}", "--edge", f"e{d % s.edges}",
                                              "--data", str(shard)], work / f"d{d}.log")
        sampler = WindowSampler(out / "metrics.jsonl", s.window, s.interval_s)
        sampler.watch("broker", broker.pid)
        for name, proc in procs.items():
            sampler.watch(name, proc.pid)
        started = time.monotonic()
        sampler.start()
        codes = wait_all(procs, "cloud", timeout=60 + s.rounds * 30)
        peaks = sampler.stop()
        seconds = time.monotonic() - started
        metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()] \
            if (out / "metrics.jsonl").exists() else []
        tail = {n: (work / f"{n}.log").read_text()[-2000:] for n, c in codes.items() if c != 0}
    results = {"exit_codes": codes, "seconds": seconds, "rounds_done": len(metrics),
               "final_accuracy": metrics[-1].get("accuracy") if metrics else None,
               "round_seconds_median": float(np.median([m["round_seconds"] for m in metrics])) if metrics else None,
               "windows": _windows(peaks, s.window, len(metrics)), "logs_of_failed": tail}
    results["growth"] = _growth(results["windows"])
    return config, results


def _tier(name: str) -> str:
    return {"c": "cloud", "e": "edge", "d": "device", "b": "broker"}[name[0]]


def _windows(peaks: dict[str, dict[int, dict[str, int]]], window: int, rounds: int) -> list[dict[str, Any]]:
    """One row per window: the largest peak RSS (MB) and descriptor count of each tier (the
    window after the last round is the processes' exit)."""
    rows = []
    for w in sorted({w for per in peaks.values() for w in per}):
        label = "exit" if w * window >= rounds else f"{w * window + 1}-{min(rounds, (w + 1) * window)}"
        row: dict[str, Any] = {"rounds": label}
        for name, per in peaks.items():
            if w in per:
                tier = _tier(name)
                row[f"{tier}_rss_mb"] = max(row.get(f"{tier}_rss_mb", 0.0), per[w]["rss"] / MB)
                row[f"{tier}_fds"] = max(row.get(f"{tier}_fds", 0), per[w]["fds"])
        rows.append(row)
    return rows


TIERS = ("cloud", "edge", "device", "broker")


def _growth(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Second window to last (the first holds start-up): RSS change in MB and descriptors."""
    full = rows[1:-1] if len(rows) > 3 else rows  # the last window may be partial (the exit)
    if len(full) < 2:
        return {}
    first, last = full[0], full[-1]
    return {t: {"rss_mb": last.get(f"{t}_rss_mb", 0) - first.get(f"{t}_rss_mb", 0),
                "fds": last.get(f"{t}_fds", 0) - first.get(f"{t}_fds", 0)} for t in TIERS}


def markdown(r: dict[str, Any]) -> str:
    head = ["rounds", *(f"{t} peak RSS (MB)" for t in TIERS), *(f"{t} fds" for t in TIERS)]
    rows = [[w["rounds"], *(w.get(f"{t}_rss_mb") for t in TIERS), *(w.get(f"{t}_fds") for t in TIERS)]
            for w in r["windows"]]
    growth = r.get("growth") or {}
    lines = [f"{r['rounds_done']} rounds in {r['seconds']:.0f} s (median round {r['round_seconds_median'] or 0:.2f} s), "
             f"final accuracy {r['final_accuracy']}; exit codes {r['exit_codes']}.", "",
             "Peak RSS and open descriptors per window of rounds (the largest process of each tier):", "",
             table(head, rows), ""]
    if growth:
        lines += ["From the second window to the last full one: " + "; ".join(
            f"{t} {g['rss_mb']:+.1f} MB, {g['fds']:+d} fds" for t, g in growth.items()) + ".", ""]
    return "\n".join(lines)


def plot(r: dict[str, Any], out_dir: Path) -> list[Path]:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for t in TIERS:
        ys = [w.get(f"{t}_rss_mb") for w in r["windows"]]
        ax.plot(range(1, len(ys) + 1), ys, marker="o", label=t)
    ax.set_xlabel("window of rounds")
    ax.set_ylabel("peak RSS (MB)")
    ax.legend()
    return save_figure(fig, out_dir / "soak-rss.png")
