"""Flower side by side (issue 58, item 6): splitedge's FedAvg against Flower's on the same task,
each arm a set of processes watched from outside (CPU and peak RSS of every process, psutil).

- `floor`: the rounds' own work in one process, no framework (bench/flower_side/floor.py).
- `splitedge`: `splitedge sim --method fedavg` on a private Mosquitto, one edge, each device in a
  worker process of its own (or `--workers N` processes sharing them): the sim process holds the
  cloud and the edge.
- `flower`: Flower 1.42's gRPC server (its FedAvg strategy) and one client process per device
  (bench/flower_side/server.py, client.py), in a venv of their own (--flower-venv; --setup makes it).

One place fixes what the arms share (`write_plan`): splitedge's cloud builds the run's config
(`build_run_config`: the model spec with its seed, FedAvg's settings with this suite's
overrides), the plan file carries it whole to the floor and to Flower, and the sim gets the same
overrides as `--set` flags; after the sim the bench checks that the config it announced is the
plan's. The split is the sim's own partition function, the batches' order each device's own rng,
the evaluation the cloud's, so the arms differ in the framework and the wire, not in the learning.

Per arm: CPU seconds and wall seconds per round (from round 1's start to the last round's end,
every process of the arm, the broker included), peak RSS of the server process and of the
largest client, bytes per client per round up and down, accuracy per round on the same test split.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from splitedge.bench.flower_side.venv import DEFAULT_VENV, FlowerMissing, flower_python, flower_version, make_venv
from splitedge.bench.lib.report import Progress, pyplot, save_figure, table
from splitedge.bench.scale import MB, MOSQUITTO_CONF, TreeSampler

METHOD = "fedavg"
ARMS = ("floor", "splitedge", "flower")
SPLIT = "niid"  # the sim's default Dirichlet split (NIID-Bench's per-class draw)
FEDAVG_SETTINGS = {"device_lr": "0.01", "robust": "none"}
"""What both arms change of FedAvg's defaults: fedcnn's learning rate (bench/results/fedcnn-cifar10:
0.05 diverges) and the exact sample-weighted merge that Flower's FedAvg computes (splitedge's
default, robust=auto, clips each update)."""
JOIN_TIMEOUT_S = 900  # each worker imports torch and loads the data set first: a minute was not enough at load 200


@dataclass
class FlowerSettings:
    dataset: str = "cifar10"
    data: str | None = None
    model: str = "fedcnn"
    devices: int = 10
    edges: int = 1
    alpha: float | None = 0.3
    rounds: int = 5
    seed: int = 0
    max_train: int | None = None
    max_test: int | None = None
    overrides: dict[str, str] = field(default_factory=lambda: dict(FEDAVG_SETTINGS))
    deadline: float = 1800.0
    arms: tuple[str, ...] = ARMS
    workers: int | None = None  # the splitedge arm's device processes (None: one per device)
    flower_venv: str = str(DEFAULT_VENV)
    setup: bool = False

    @classmethod
    def from_args(cls, a: argparse.Namespace) -> "FlowerSettings":
        from splitedge.bench.lib.simrun import parse_sets

        arms = tuple(getattr(a, "arms", ()) or ARMS)
        if set(arms) - set(ARMS):
            raise ValueError(f"--arms: unknown {sorted(set(arms) - set(ARMS))}; choose from {', '.join(ARMS)}")
        common = dict(model=a.model or cls.model, seed=a.seed, overrides={**FEDAVG_SETTINGS, **parse_sets(a.set)},
                      arms=arms, flower_venv=str(Path(getattr(a, "flower_venv", None) or DEFAULT_VENV).expanduser()),
                      setup=bool(getattr(a, "setup", False)), edges=a.edges or cls.edges,
                      deadline=a.deadline or cls.deadline, workers=getattr(a, "workers", None))
        if a.quick:  # about a minute: scikit-learn's digits, a few devices
            return cls(dataset="digits", devices=a.devices or 4, rounds=a.rounds or 3, alpha=a.alpha or 0.3,
                       **common)
        return cls(dataset=a.dataset, data=a.data, devices=a.devices or cls.devices, rounds=a.rounds or cls.rounds,
                   alpha=cls.alpha if a.alpha is None else a.alpha, max_train=a.max_train, max_test=a.max_test,
                   **common)


Settings = FlowerSettings


# -- the plan: what every arm runs, from one place ------------------------------------------------

def run_config(s: FlowerSettings) -> Any:
    """The RunConfig splitedge's cloud builds for these settings (and announces to its devices)."""
    from splitedge.bench.flower_side.common import check_plain
    from splitedge.cloud.options import build_run_config
    from splitedge.methods.data.datasets import load_dataset

    _, _, info = load_dataset(s.dataset, s.data, max_train=s.max_train, max_test=s.max_test, seed=s.seed)
    config = build_run_config(METHOD, info, s.model, s.seed, s.overrides)
    check_plain(config.method)
    return config


def plan(s: FlowerSettings) -> dict[str, Any]:
    """The plan file's content: the data, the split, the rounds and the run's config (wire form)."""
    return {"dataset": s.dataset, "data": s.data, "max_train": s.max_train, "max_test": s.max_test, "seed": s.seed,
            "devices": s.devices, "alpha": s.alpha, "split": SPLIT, "rounds": s.rounds,
            "config": json.loads(json.dumps(run_config(s).to_wire()))}


def sim_command(s: FlowerSettings, broker: str, out: Path) -> list[str]:
    """`splitedge sim` for the splitedge arm: the plan's settings as flags, each device a process."""
    sets = [x for k, v in s.overrides.items() for x in ("--set", f"{k}={v}")]
    return [sys.executable, "-m", "splitedge", "sim", "--method", METHOD, "--model", s.model, "--dataset", s.dataset,
            *(["--data", s.data] if s.data else []), "--devices", str(s.devices), "--edges", str(s.edges),
            *(["--alpha", str(s.alpha), "--split", SPLIT] if s.alpha is not None else []),
            "--rounds", str(s.rounds), "--seed", str(s.seed),
            *(["--max-train", str(s.max_train)] if s.max_train else []),
            *(["--max-test", str(s.max_test)] if s.max_test else []),
            "--broker", broker, "--workers", str(s.workers or s.devices), "--deadline", str(s.deadline), "--out", str(out),
            "--join-timeout", str(JOIN_TIMEOUT_S), *sets]


def check_same_config(summary: dict[str, Any], planned: dict[str, Any]) -> None:
    """The config the sim announced is the plan's (else the arms did not train alike)."""
    ran = json.loads(json.dumps({"model": summary["config"]["model"], "method": summary["config"]["settings"]}))
    if ran != planned["config"]:
        diff = {k: (v, ran["method"].get(k)) for k, v in planned["config"]["method"].items()
                if ran["method"].get(k) != v}
        raise RuntimeError(f"the sim ran another config than the plan's: {diff or ran['model']}")


# -- measuring ----------------------------------------------------------------------------------

class ArmSampler(TreeSampler):
    """TreeSampler (peak RSS and CPU of every process under its roots) that also keeps each
    sample's CPU seconds per process, and the time each new line of `watch` was first seen."""

    def __init__(self, roots: dict[str, int], watch: Path | None = None, interval_s: float = 0.25) -> None:
        super().__init__(roots, interval_s)
        self.series: list[tuple[float, dict[str, float]]] = []
        self.watch, self.seen = watch, []
        self.labels: dict[int, str] = {}

    def _label(self, name: str, pid: int) -> str:
        """One name per process: a child seen between fork and exec ("child-PID") is renamed,
        its samples with it, once it shows what it runs ("worker-PID")."""
        old = self.labels.get(pid)
        if old is None or (old != name and old.startswith("child-")):
            self.labels[pid] = name
            for held in (self.peak, self.cpu, *(cpus for _, cpus in self.series)):
                if old in held:
                    held[name] = max(held.pop(old), held.get(name, 0))
        return self.labels[pid]

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def sample(self) -> None:
        import psutil

        now, cpus, total = time.time(), {}, 0
        for name, proc in self._processes().items():
            try:
                rss, cpu = proc.memory_info().rss, sum(proc.cpu_times()[:2])
            except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
                continue
            name = self._label(name, proc.pid)
            total += rss
            self.peak[name] = max(self.peak.get(name, 0), rss)
            self.cpu[name] = cpus[name] = max(self.cpu.get(name, 0.0), cpu)
        self.peak_total = max(self.peak_total, total)
        self.series.append((now, cpus))
        if self.watch is not None and self.watch.exists():
            lines = self.watch.read_text().count("\n")
            self.seen += [now] * (lines - len(self.seen))

    def cpu_between(self, t0: float, t1: float, which: Callable[[str], bool] = lambda name: True) -> float:
        """CPU seconds the processes `which` names used between t0 and t1 (interpolated)."""
        names = {n for _, cpus in self.series for n in cpus if which(n)}
        used = 0.0
        for name in names:
            ts = [t for t, cpus in self.series if name in cpus]
            vs = [cpus[name] for _, cpus in self.series if name in cpus]
            used += float(np.interp(t1, ts, vs) - np.interp(t0, ts, vs))
        return used


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_listening(port: int, proc: subprocess.Popen, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise RuntimeError(f"the Flower server did not listen on port {port} (exit code {proc.poll()})")


def env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "FLWR_TELEMETRY_ENABLED": "0"}


def spawn(cmd: list[str], log: Path) -> subprocess.Popen:
    with open(log, "w") as fh:
        return subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env())


def finish(procs: list[subprocess.Popen], timeout: float) -> list[int | None]:
    """Each process's exit code, waiting up to `timeout` in all; one still running is killed (None)."""
    deadline, codes = time.monotonic() + timeout, []
    for proc in procs:
        try:
            codes.append(proc.wait(max(0.1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
            codes.append(None)
    return codes


def read_lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


# -- the arms -----------------------------------------------------------------------------------

def run_floor(s: FlowerSettings, work: Path, plan_file: Path) -> dict[str, Any]:
    rounds_file = work / "floor-rounds.jsonl"
    proc = spawn([sys.executable, "-m", "splitedge.bench.flower_side.floor", "--plan", str(plan_file),
                  "--rounds-file", str(rounds_file)], work / "floor.log")
    sampler = ArmSampler({"server": proc.pid}).start()
    codes = finish([proc], s.rounds * s.deadline)
    sampler.stop()
    return measured("floor", sampler, read_lines(rounds_file), codes, work / "floor.log", s)


def run_splitedge(s: FlowerSettings, work: Path, planned: dict[str, Any]) -> dict[str, Any]:
    from splitedge.protocol.broker import MosquittoBroker

    out = work / "sim"
    with MosquittoBroker(extra_conf=MOSQUITTO_CONF) as broker:
        proc = spawn(sim_command(s, broker.url, out), work / "sim.log")
        sampler = ArmSampler({"server": proc.pid, "broker": broker.pid}, watch=out / "metrics.jsonl").start()
        codes = finish([proc], s.rounds * s.deadline + 600)
        sampler.stop()
    summary = json.loads((out / "summary.json").read_text()) if (out / "summary.json").exists() else {}
    rounds = [{"round": i + 1, "end": end, "accuracy": acc}
              for i, (end, acc) in enumerate(zip(sampler.seen, summary.get("accuracy_per_round", [])))]
    if rounds:  # the round's record is written at its end; its start is its length before
        rounds[0]["start"] = rounds[0]["end"] - summary["round_seconds"][0]
    row = measured("splitedge", sampler, rounds, codes, work / "sim.log", s)
    if summary:
        check_same_config(summary, planned)
        dev, kinds, n = summary["bytes"]["device"], summary["device_bytes_by_kind"], s.devices * s.rounds
        row["bytes"] = {"up": dev["out_packet"] / n, "down": dev["in_packet"] / n,
                        "source": "MQTT PUBLISH packets (fixed header, topic, packet id, payload) each device's "
                                  "transport sent / received (control packets not included)"}
        row["model_payload"] = {"up": kinds["out"].get("weights", {}).get("payload", 0) / n,
                                "down": kinds["in"].get("weights", {}).get("payload", 0) / n}
    return row


def run_flower(s: FlowerSettings, work: Path, plan_file: Path, python: Path) -> dict[str, Any]:
    port, rounds_file = free_port(), work / "flower-rounds.jsonl"
    side = "splitedge.bench.flower_side"
    server = spawn([str(python), "-m", f"{side}.server", "--plan", str(plan_file), "--port", str(port),
                    "--rounds-file", str(rounds_file)], work / "flower-server.log")
    clients = [spawn([str(python), "-m", f"{side}.client", "--plan", str(plan_file), "--server", f"127.0.0.1:{port}",
                      "--device", str(d)], work / f"flower-client-{d}.log") for d in range(s.devices)]
    sampler = ArmSampler({"server": server.pid, **{f"client-{d}": c.pid for d, c in enumerate(clients)}}).start()
    try:
        wait_listening(port, server)
        codes = finish([server], s.rounds * s.deadline + 600) + finish(clients, 60)
    finally:
        finish([server, *clients], 0)
        sampler.stop()
    lines = read_lines(rounds_file)
    row = measured("flower", sampler, lines, codes, work / "flower-server.log", s)
    if lines:
        sockets, n = lines[-1]["sockets"], s.rounds
        row["bytes"] = {"up": float(np.mean([c["received"] for c in sockets.values()])) / n,
                        "down": float(np.mean([c["sent"] for c in sockets.values()])) / n,
                        "connections": len(sockets),
                        "source": "TCP bytes of each client's gRPC connection (HTTP/2 and protobuf framing included), "
                                  "from the server's sockets (TCP_INFO bytes_received / bytes_acked)"}
        row["model_payload"] = {"up": float(np.mean([np.mean(r["params_up"]) for r in lines])),
                                "down": float(np.mean([r["params_down_per_client"] for r in lines]))}
    return row


def measured(arm: str, sampler: ArmSampler, rounds: list[dict[str, Any]], codes: list[int | None], log: Path,
             s: FlowerSettings) -> dict[str, Any]:
    """An arm's row: per-round CPU and wall time over its rounds, peaks by role, accuracy."""
    clients = [v for k, v in sampler.peak.items() if k.startswith(("client-", "worker-"))]
    row: dict[str, Any] = {
        "arm": arm, "exit_codes": codes, "rounds_done": len(rounds), "processes": len(sampler.peak),
        "accuracy_per_round": [r.get("accuracy") for r in rounds],
        "final_accuracy": rounds[-1].get("accuracy") if rounds else None,
        "peak_rss_mb": {"server": sampler.peak.get("server", 0) / MB,
                        "client_max": max(clients, default=0) / MB,
                        "client_median": float(np.median(clients)) / MB if clients else None,
                        "broker": sampler.peak.get("broker", 0) / MB if "broker" in sampler.peak else None},
        "cpu_s_whole_run": sum(sampler.cpu.values()),
        "by_process": {k: {"peak_rss_mb": v / MB, "cpu_s": sampler.cpu.get(k)} for k, v in sampler.peak.items()},
    }
    if len(rounds) < s.rounds or any(c != 0 for c in codes):
        row["log_tail"] = log.read_text()[-3000:] if log.exists() else None
    if not rounds or "start" not in rounds[0]:
        return row
    t0, t1, n = rounds[0]["start"], rounds[-1]["end"], len(rounds)
    role = {"server": lambda k: k == "server", "clients": lambda k: k.startswith(("client-", "worker-")),
            "broker": lambda k: k == "broker"}
    row["wall_s_per_round"] = (t1 - t0) / n
    row["cpu_s_per_round"] = {"all": sampler.cpu_between(t0, t1) / n,
                              **{r: sampler.cpu_between(t0, t1, f) / n for r, f in role.items()
                                 if any(f(k) for k in sampler.peak)}}
    if n > 1:  # rounds 2..n: no first model download, no client joining late
        t0 = rounds[0]["end"]
        row["steady"] = {"wall_s_per_round": (t1 - t0) / (n - 1), "cpu_s_per_round": sampler.cpu_between(t0, t1) / (n - 1)}
    return row


def run(s: FlowerSettings, progress: Progress | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """The arms in turn (the Flower venv checked first, so a missing one costs nothing)."""
    python = None
    if "flower" in s.arms:
        try:
            python = flower_python(s.flower_venv)
        except FlowerMissing:
            if not s.setup:
                raise
            python = make_venv(s.flower_venv)
    planned = plan(s)
    config = {**asdict(s), "plan": planned, "flower_version": flower_version(python) if python else None}
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="splitedge-flower-") as tmp:
        work = Path(tmp)
        plan_file = work / "plan.json"
        plan_file.write_text(json.dumps(planned))
        for arm in s.arms:
            print(f"bench flower: {arm} arm ({s.devices} devices, {s.rounds} rounds on {s.dataset})", flush=True)
            if arm == "floor":
                rows.append(run_floor(s, work, plan_file))
            elif arm == "splitedge":
                rows.append(run_splitedge(s, work, planned))
            else:
                rows.append(run_flower(s, work, plan_file, python))
            if progress is not None:
                progress(config, {"rows": rows})
    return config, {"rows": rows}


# -- reporting ----------------------------------------------------------------------------------

def ratio(row: dict[str, Any], floor: dict[str, Any] | None) -> str | None:
    try:
        return f"{row['cpu_s_per_round']['all'] / floor['cpu_s_per_round']['all']:.2f}x"
    except (KeyError, TypeError, ZeroDivisionError):
        return None


def markdown(results: dict[str, Any]) -> str:
    rows = results["rows"]
    floor = next((r for r in rows if r["arm"] == "floor"), None)
    head = ["arm", "processes", "CPU s/round (all)", "x floor", "server CPU s/round", "client CPU s/round (sum)",
            "broker CPU s/round", "wall s/round", "server peak MB", "client peak MB (max)", "broker peak MB",
            "up B/client/round", "down B/client/round", "accuracy per round", "final accuracy"]
    cells = []
    for r in rows:
        cpu, rss, b = r.get("cpu_s_per_round", {}), r["peak_rss_mb"], r.get("bytes", {})
        cells.append([r["arm"], r["processes"], cpu.get("all"), ratio(r, floor), cpu.get("server"), cpu.get("clients"),
                      cpu.get("broker"), r.get("wall_s_per_round"),
                      rss["server"], rss["client_max"] or None, rss["broker"], b.get("up"), b.get("down"),
                      ", ".join(f"{a:.4f}" for a in r["accuracy_per_round"] if a is not None), r["final_accuracy"]])
    payload = [[r["arm"], r["model_payload"]["up"], r["model_payload"]["down"], r["bytes"]["source"]]
               for r in rows if "bytes" in r]
    failed = [f"- {r['arm']}: exit codes {r['exit_codes']}, {r['rounds_done']} rounds" for r in rows if r.get("log_tail")]
    return "\n".join([
        "Per round: from round 1's start to the last round's end, divided by the rounds; CPU is every process of "
        "the arm (user + system, sampled every 0.25 s and interpolated at the round boundaries). floor: one process "
        "(its peak is under server). splitedge: the sim process (cloud and edge) is the server, each device a worker "
        "process, plus Mosquitto. flower: the gRPC server process and one process per client.", "",
        table(head, cells), "",
        "Bytes per client per round, and where they come from (model payload: the serialised weights alone, "
        "splitedge's `weights` messages and Flower's `Parameters.tensors`):", "",
        table(["arm", "model payload up", "model payload down", "bytes counted"], payload), "",
        *(["Arms that did not finish:", "", *failed, ""] if failed else []),
    ])


def plot(results: dict[str, Any], out_dir: Path) -> list[Path]:
    plt = pyplot()
    rows = [r for r in results["rows"] if "cpu_s_per_round" in r]
    if not rows:
        return []
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    names = [r["arm"] for r in rows]
    bottom = np.zeros(len(rows))
    for role in ("server", "clients", "broker"):
        values = np.array([r["cpu_s_per_round"].get(role) or 0.0 for r in rows])
        a.bar(names, values, bottom=bottom, label=role)
        bottom += values
    a.set_ylabel("CPU s per round")
    a.legend()
    for r, style in zip(results["rows"], (("o", "-"), ("s", "--"), ("^", ":"))):  # arms that agree overlap
        acc = [x for x in r["accuracy_per_round"] if x is not None]
        b.plot(range(1, len(acc) + 1), acc, marker=style[0], linestyle=style[1], label=r["arm"])
    b.set_xlabel("round")
    b.set_ylabel("test accuracy")
    b.legend()
    return save_figure(fig, out_dir / "flower.png")
