"""Scale: `splitedge sim` at growing device counts, each run a process tree on a private
Mosquitto, watched from outside: peak RSS of every process (the sim, its device workers, the
broker), the peak of their sum, CPU seconds of each, round time, the broker's message rate and
each edge's (messages it sent and received per second of the run, from its transports' counters).

Each size runs with virtual devices (`--virtual`: models exist only while training) and
device workers (`--workers`), so memory grows with the training slots, not with the devices;
where a size saturates shows in which process burns the CPU (the sim's edges and cloud, the
device workers, or the broker).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from splitedge.bench.lib.report import Progress, pyplot, save_figure, table

MB = 1024 * 1024
MOSQUITTO_CONF = "max_connections -1\nmax_packet_size 68157440\nmax_inflight_messages 0\nmax_queued_messages 100000\n"
"""A bench's private Mosquitto: any number of sessions, model-sized messages, no cap on what is
in flight or queued for a slow subscriber (bench scale, bench flower)."""


@dataclass
class ScaleSettings:
    counts: tuple[int, ...] = (100, 300, 1000)
    edges_per: int = 50  # one edge per this many devices
    dataset: str = "cifar10"
    data: str | None = None
    alpha: float | None = 0.3
    rounds: int = 3
    workers: int = 2
    virtual: int = 1  # training slots per worker
    method: str = "hsfp"
    seed: int = 0
    split: str = "per-device"  # NIID-Bench's per-class draw cannot split 1,000 devices at alpha 0.3
    extra: list[str] = field(default_factory=list)

    @classmethod
    def from_args(cls, a: argparse.Namespace) -> "ScaleSettings":
        if a.quick:
            # 36 to 72 digits a device, fewer than the privacy floor's 10 of every class: without
            # min_class_count=1 no device would send a class's statistics and nothing would train
            return cls(counts=(20, 40), edges_per=10, dataset="digits", alpha=None, rounds=2, workers=2,
                       extra=["--set", "min_class_count=1"])
        counts = tuple(int(c) for c in a.counts) if a.counts else cls.counts
        return cls(counts=counts, dataset=a.dataset, data=a.data, alpha=a.alpha if a.alpha is not None else cls.alpha,
                   rounds=a.rounds or cls.rounds, method=a.methods[0] if a.methods else cls.method, seed=a.seed,
                   edges_per=a.edges_per or cls.edges_per, split=a.split or cls.split,
                   virtual=cls.virtual if a.virtual is None else a.virtual,
                   workers=cls.workers if a.workers is None else a.workers,
                   extra=sim_arguments(a.set or []))


Settings = ScaleSettings


def sim_arguments(settings: list[str]) -> list[str]:
    """`--set KEY=VALUE`s as the sim's arguments: the run's own keys (client sampling,
    simrun.SIM_KEYS) as its flags (sample_fraction=0.1 -> --sample-fraction 0.1), the rest as
    method settings."""
    from splitedge.bench.lib.simrun import SIM_KEYS

    out: list[str] = []
    for kv in settings:
        key, _, value = kv.partition("=")
        if key in SIM_KEYS and key != "backends":
            out += [f"--{key.replace('_', '-')}", value]
        else:
            out += ["--set", kv]
    return out


class TreeSampler:
    """Every `interval_s`: RSS and CPU time of each process under `roots` (children found as
    they appear), the peak of each and the peak of their sum."""

    def __init__(self, roots: dict[str, int], interval_s: float = 0.5) -> None:
        self.roots = {name: psutil.Process(pid) for name, pid in roots.items()}
        self.interval_s = interval_s
        self.peak: dict[str, int] = {}
        self.cpu: dict[str, float] = {}
        self.peak_total = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _processes(self) -> dict[str, psutil.Process]:
        """Named by pid; a child still running its parent's command (forked, not yet exec'd:
        its pages are the parent's) is not counted."""
        found = {}
        for name, root in self.roots.items():
            try:
                found[name] = root
                parent_cmd = root.cmdline()
                for child in root.children(recursive=True):
                    cmd = child.cmdline()
                    if cmd == parent_cmd:
                        continue
                    found[f"{'worker' if 'splitedge.sim.worker' in cmd else 'child'}-{child.pid}"] = child
            except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
                continue
        return found

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            total = 0
            for name, proc in self._processes().items():
                try:
                    rss = proc.memory_info().rss
                    cpu = sum(proc.cpu_times()[:2])
                except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
                    continue
                total += rss
                self.peak[name] = max(self.peak.get(name, 0), rss)
                self.cpu[name] = max(self.cpu.get(name, 0.0), cpu)
            self.peak_total = max(self.peak_total, total)

    def start(self) -> "TreeSampler":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


BROKER_COUNTERS = ("messages/received", "messages/sent", "bytes/received", "bytes/sent")


def broker_counters(url: str) -> dict[str, float]:
    """The broker's own totals so far ($SYS): messages and bytes it received and sent."""
    from splitedge.protocol.broker import read_sys

    topics = [f"$SYS/broker/{c}" for c in BROKER_COUNTERS]
    values = read_sys(url, "$SYS/broker/#", timeout=5.0, done=lambda v: all(t in v for t in topics))
    return {c: float(values.get(t, 0)) for c, t in zip(BROKER_COUNTERS, topics)}


def run_one(s: ScaleSettings, devices: int, work: Path) -> dict[str, Any]:
    from splitedge.protocol.broker import MosquittoBroker

    edges = max(1, devices // s.edges_per)
    out = work / f"sim-{devices}"
    with MosquittoBroker(extra_conf=MOSQUITTO_CONF) as broker:
        cmd = [sys.executable, "-m", "splitedge", "sim", "--method", s.method, "--dataset", s.dataset,
               "--devices", str(devices), "--edges", str(edges), "--rounds", str(s.rounds), "--seed", str(s.seed),
               "--broker", broker.url, "--workers", str(s.workers), "--virtual", str(s.virtual), "--out", str(out),
               "--deadline", "3600", "--split", s.split, *(["--data", s.data] if s.data else []),
               *(["--alpha", str(s.alpha)] if s.alpha is not None else []), *s.extra]
        before = broker_counters(broker.url)
        with open(work / f"sim-{devices}.log", "w") as log:
            started = time.monotonic()
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env={"OMP_NUM_THREADS": "1", **__import__("os").environ})
            sampler = TreeSampler({"sim": proc.pid, "broker": broker.pid}).start()
            code = proc.wait()
            seconds = time.monotonic() - started
            sampler.stop()
        time.sleep(1.5)  # $SYS is republished every sys_interval (1 s)
        after = broker_counters(broker.url)
    summary = json.loads((out / "summary.json").read_text()) if (out / "summary.json").exists() else {}
    workers = {k: v for k, v in sampler.peak.items() if k.startswith("worker")}
    through = {c: after[c] - before[c] for c in BROKER_COUNTERS}
    received = through["messages/received"]
    wall = summary.get("wall_seconds") or seconds
    per_edge = sorted((m["in"] + m["out"]) / wall for m in (summary.get("edge_messages") or {}).values())
    return {
        "devices": devices, "edges": edges, "exit_code": code, "seconds": seconds,
        "rounds_done": summary.get("rounds_done"), "final_accuracy": summary.get("final_accuracy"),
        "round_seconds": summary.get("round_seconds"),
        "peak_rss_mb": {"sim (cloud + edges)": sampler.peak.get("sim", 0) / MB,
                        "device worker (largest)": max(workers.values(), default=0) / MB,
                        "broker": sampler.peak.get("broker", 0) / MB},
        "sum_of_peaks_mb": sum(sampler.peak.values()) / MB, "peak_total_mb": sampler.peak_total / MB,
        "cpu_seconds": {"sim": sampler.cpu.get("sim"), "workers": sum(v for k, v in sampler.cpu.items()
                                                                      if k.startswith("worker")),
                        "broker": sampler.cpu.get("broker")},
        "broker_messages_received": received, "broker_messages_per_s": received / seconds if seconds else None,
        "broker": through,  # messages and bytes into and out of the broker over the whole run
        "bytes_by_tier": summary.get("bytes"),  # payload and packet bytes each tier sent and received
        "edge_messages_per_s": {"median": per_edge[len(per_edge) // 2], "max": per_edge[-1]} if per_edge else None,
        "log_tail": None if code == 0 else (work / f"sim-{devices}.log").read_text()[-2000:],
    }


def run(s: ScaleSettings, progress: Progress | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """Each device count in turn; `progress` after each, so a stopped bench keeps the sizes it ran."""
    config = {k: v for k, v in vars(s).items()}
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="splitedge-scale-") as tmp:
        for n in s.counts:
            rows.append(run_one(s, n, Path(tmp)))
            if progress is not None:
                progress(config, {"rows": rows})
    return config, {"rows": rows}


def markdown(r: dict[str, Any]) -> str:
    head = ["devices", "edges", "rounds", "median round (s)", "sim peak (MB)", "worker peak (MB)", "broker peak (MB)",
            "sum of peaks (MB)", "CPU s sim / workers / broker", "broker msg/s", "broker MB in / out",
            "edge msg/s median / max", "final accuracy"]
    rows = []
    for row in r["rows"]:
        rs = sorted(row["round_seconds"] or [])
        cpu = row["cpu_seconds"]
        rows.append([row["devices"], row["edges"], row["rounds_done"], rs[len(rs) // 2] if rs else None,
                     row["peak_rss_mb"]["sim (cloud + edges)"], row["peak_rss_mb"]["device worker (largest)"],
                     row["peak_rss_mb"]["broker"], row["sum_of_peaks_mb"],
                     f"{cpu['sim'] or 0:.0f} / {cpu['workers'] or 0:.0f} / {cpu['broker'] or 0:.0f}",
                     row["broker_messages_per_s"], broker_mb(row.get("broker")),
                     edge_rate(row.get("edge_messages_per_s")), row["final_accuracy"]])
    return "\n".join(["Each size: one `splitedge sim` process (cloud and edges) with its device workers and a "
                      "private Mosquitto; peaks are per process, sampled every 0.5 s.", "", table(head, rows), ""])


def broker_mb(through: dict[str, float] | None) -> str | None:
    """'in / out' megabytes through the broker over the run, or None (older runs)."""
    return None if not through else f"{through['bytes/received'] / MB:,.0f} / {through['bytes/sent'] / MB:,.0f}"


def edge_rate(rate: dict[str, float] | None) -> str | None:
    """'median / max' messages per second over the edges (sent + received), or None (older runs)."""
    return None if not rate else f"{rate['median']:.1f} / {rate['max']:.1f}"


def plot(r: dict[str, Any], out_dir: Path) -> list[Path]:
    plt = pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    xs = [row["devices"] for row in r["rows"]]
    a.plot(xs, [row["sum_of_peaks_mb"] for row in r["rows"]], marker="o")
    a.set_xlabel("devices")
    a.set_ylabel("sum of peak RSS (MB)")
    b.plot(xs, [sorted(row["round_seconds"] or [0])[len(row["round_seconds"] or [0]) // 2] for row in r["rows"]],
           marker="o")
    b.set_xlabel("devices")
    b.set_ylabel("median round (s)")
    return save_figure(fig, out_dir / "scale.png")
