"""How many device `moments` messages one edge can validate and merge per second.

Three views: in-process (protocol.codec.decode with schema validation, moments_from_body,
merge_moments: the edge's CPU cost alone), end to end (a publisher process floods a real
Mosquitto and one MqttTransport receives, validates and merges: what an edge on a broker
sustains) and round wall time as devices grow (run_sim on digits).
"""

from __future__ import annotations

import argparse
import logging
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from splitedge.bench.lib.mqtt_load import moments_payloads

from splitedge.bench.lib.report import pyplot, table, save_figure

log = logging.getLogger(__name__)

CHUNK = 100  # parts merged at once; the edge's result is the same as one merge of all parts


@dataclass
class ThroughputSettings:
    counts: tuple[int, ...] = (10, 100, 1000)
    dims: tuple[int, ...] = (512, 8192)  # cnn W_c: digits, CIFAR-10
    classes: int = 10
    dtype: str = "f4"
    min_seconds: float = 1.0  # repeat small in-process cases until this much time passed
    grow: tuple[int, ...] = (4, 8, 16)
    grow_rounds: int = 3
    grow_max_train: int | None = None
    seed: int = 0

    @classmethod
    def from_args(cls, a: argparse.Namespace) -> ThroughputSettings:
        quick = a.quick
        ints = lambda v, d: tuple(int(x) for x in v) if v else d  # noqa: E731
        return cls(counts=ints(a.counts, (10, 100) if quick else (10, 100, 1000)),
                   dims=ints(a.dims, (512,) if quick else (512, 8192)), min_seconds=0.2 if quick else 1.0,
                   grow=ints(a.grow, (2, 4) if quick else (4, 8, 16)),
                   grow_rounds=a.rounds or (1 if quick else 3),
                   grow_max_train=a.max_train or (300 if quick else None), seed=a.seed)


class StreamingMerge:
    """Decoded parts merged in chunks, so 1,000 CIFAR-sized parts never sit in memory at once."""

    def __init__(self) -> None:
        self.total: Any = None
        self.pending: list[Any] = []
        self.count = 0

    def add(self, part: Any) -> None:
        self.pending.append(part)
        self.count += 1
        if len(self.pending) >= CHUNK:
            self.flush()

    def flush(self) -> Any:
        from splitedge.methods.moments import merge_moments

        if self.pending:
            self.total = merge_moments(([self.total] if self.total is not None else []) + self.pending)
            self.pending = []
        return self.total


def in_process(count: int, dim: int, s: ThroughputSettings) -> dict[str, Any]:
    """decode (with validation) + moments_from_body + merge, repeated for at least min_seconds."""
    from splitedge.methods.moments import moments_from_body
    from splitedge.protocol.codec import decode

    payloads = [p for _, p in moments_payloads(count, dim, s.classes, s.dtype, seed=s.seed)]
    nbytes, reps = sum(map(len, payloads)), 0
    start = time.perf_counter()
    while True:
        merger = StreamingMerge()
        for payload in payloads:
            merger.add(moments_from_body(decode(payload).body))
        merger.flush()
        reps += 1
        elapsed = time.perf_counter() - start
        if elapsed >= s.min_seconds:
            break
    return {"mode": "in-process", "devices": count, "dim": dim, "message_bytes": nbytes // count, "repeats": reps,
            "seconds": elapsed, "messages_per_s": count * reps / elapsed, "mb_per_s": nbytes * reps / elapsed / 1e6}


def end_to_end(count: int, dim: int, s: ThroughputSettings, url: str) -> dict[str, Any]:
    """A publisher process sends ``count`` messages; one MqttTransport receives + merges them."""
    from splitedge.methods.moments import moments_from_body
    from splitedge.protocol.mqtt import MqttTransport
    from splitedge.protocol.topics import pattern

    run, merger, done, last = f"tp{count}x{dim}", StreamingMerge(), threading.Event(), [0.0]

    def on_moments(topic_: str, env: Any) -> None:
        merger.add(moments_from_body(env.body))
        if merger.count >= count:
            merger.flush()
            last[0] = time.perf_counter()
            done.set()

    with MqttTransport(url, client_id=f"bench-edge-{run}", role="edge") as edge:
        edge.subscribe(pattern(run, "device", "+", "up", "moments"), on_moments)
        pub = subprocess.Popen([sys.executable, "-m", "splitedge.bench.lib.mqtt_load", "--url", url, "--run", run, "--count",
                                str(count), "--dim", str(dim), "--classes", str(s.classes), "--dtype", s.dtype],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        ok = False  # an interrupt before the wait ends kills the publisher
        try:
            if pub.stdout is None or pub.stdin is None or pub.stdout.readline().strip() != "ready":
                raise RuntimeError("publisher did not start")
            start = time.perf_counter()
            pub.stdin.write("go\n")
            pub.stdin.flush()
            ok = done.wait(max(60.0, count * dim / 2e4))
        finally:
            if pub.poll() is None:
                pub.wait(30) if ok else pub.kill()
        nbytes = edge.counters.total("in", "payload")
        rejected, handler_errors = dict(edge.rejected), edge.handler_errors
    seconds = (last[0] - start) if ok else float("nan")
    return {"mode": "end-to-end", "devices": count, "dim": dim, "received": merger.count, "seconds": seconds,
            "messages_per_s": count / seconds if ok else 0.0, "mb_per_s": nbytes / seconds / 1e6 if ok else 0.0,
            "message_bytes": nbytes // max(1, merger.count), "rejected": rejected, "handler_errors": handler_errors,
            "complete": ok}


def round_time(devices: int, s: ThroughputSettings) -> dict[str, Any]:
    """run_sim on digits through Mosquitto with ``devices`` devices behind 2 edges."""
    from splitedge.bench.lib.simrun import run_on_mosquitto
    from splitedge.sim import SimSettings

    settings = SimSettings(rounds=s.grow_rounds, devices=devices, edges=2, dataset="digits", seed=s.seed,
                           max_train=s.grow_max_train, max_test=200, run=f"bench-grow-{devices}")
    summary = run_on_mosquitto(settings, check_sys=False)["summary"]
    secs = summary["round_seconds"]
    return {"devices": devices, "rounds": len(secs), "round_seconds": secs,
            "mean_round_seconds": sum(secs) / max(1, len(secs)), "wall_seconds": summary["wall_seconds"],
            "final_accuracy": summary["final_accuracy"]}


def run(s: ThroughputSettings) -> tuple[dict[str, Any], dict[str, Any]]:
    from splitedge.protocol.broker import MosquittoBroker

    merge = [in_process(n, d, s) for d in s.dims for n in s.counts]
    # an edge that falls behind must not lose messages to Mosquitto's default 1,000-message queue
    with MosquittoBroker(extra_conf="max_queued_messages 0") as broker:
        e2e = [end_to_end(n, d, s, broker.url) for d in s.dims for n in s.counts]
    grow = [round_time(n, s) for n in s.grow]
    config = {k: list(v) if isinstance(v, tuple) else v for k, v in vars(s).items()}
    return config, {"merge": merge + e2e, "round_time": grow}


def markdown(results: dict[str, Any]) -> str:
    rows = [(r["mode"], r["dim"], r["devices"], r["message_bytes"], r["messages_per_s"], r["mb_per_s"])
            for r in results["merge"]]
    grow = [(r["devices"], r["rounds"], r["mean_round_seconds"], r["wall_seconds"], r["final_accuracy"])
            for r in results["round_time"]]
    return "\n".join(["## Moments messages one edge validates and merges per second\n",
                      table(["mode", "dim", "devices", "bytes/msg", "msgs/s", "MB/s"], rows),
                      "\n## Round wall time as devices grow (digits, H-SFP, Mosquitto)\n",
                      table(["devices", "rounds", "mean round s", "wall s", "final acc"], grow)])


def plot(results: dict[str, Any], out_dir: Path) -> list[Path]:
    plt = pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for mode in ("in-process", "end-to-end"):
        for dim in sorted({r["dim"] for r in results["merge"]}):
            pts = [(r["devices"], r["messages_per_s"]) for r in results["merge"] if r["mode"] == mode and r["dim"] == dim]
            ax1.plot(*zip(*pts), marker="o", label=f"{mode}, dim {dim}")
    ax1.set(xscale="log", yscale="log", xlabel="devices (messages)", ylabel="messages/s")
    ax1.legend(fontsize=7)
    grow = results["round_time"]
    ax2.plot([r["devices"] for r in grow], [r["mean_round_seconds"] for r in grow], marker="o")
    ax2.set(xlabel="devices", ylabel="mean round wall time (s)")
    return save_figure(fig, out_dir / "throughput.png")


Settings = ThroughputSettings
