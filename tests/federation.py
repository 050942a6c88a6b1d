"""The roles as separate OS processes against one broker: each holds only its own data
(devices read an .npz shard), nothing is shared but the broker. A process can be killed
(SIGKILL, no clean exit) and started again with its arguments (`restart`).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest

from splitedge.bench.soak import write_digit_shards

def _spawn(args: list[str], log: Path, env_extra: Mapping[str, str] | None = None) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env_extra or {})}
    fh = open(log, "a")
    return subprocess.Popen([sys.executable, "-m", "splitedge", *args], stdout=fh, stderr=subprocess.STDOUT,
                            env=env, cwd=log.parent)


class Federation:
    """Cloud + edges + devices as processes; `kill()` one, `wait()` for the cloud."""

    def __init__(self, tmp: Path, url: str, *, edges: int, devices: int, rounds: int, extra: list[str],
                 edge_extra: tuple[str, ...] = (), node_extra: Mapping[str, Sequence[str]] | None = None,
                 node_env: Mapping[str, Mapping[str, str]] | None = None) -> None:
        self.tmp, self.out = tmp, tmp / "out"
        self.node_extra = dict(node_extra or {})  # flags for one node alone, by name ("cloud", "e0", "d1")
        self.node_env = dict(node_env or {})  # environment for one node's first start (e.g. a crash point)
        shards = write_digit_shards(tmp, devices)
        common = ["--broker", url, "--run", "itest"]  # same run id on purpose: leftovers of earlier tests must not leak in
        self.procs: dict[str, subprocess.Popen] = {}
        self.argv: dict[str, list[str]] = {}
        self.start("cloud", ["cloud", *common, "--edges", str(edges), "--devices", str(devices),
                                      "--rounds", str(rounds), "--out", str(self.out), "--join-timeout", "90",
                                      *extra])
        self._wait_for_line("cloud", "waiting for", timeout=180)
        for e in range(edges):
            self.start(f"e{e}", ["edge", *common, "--id", f"e{e}", "--out", str(self.out), *edge_extra])
        for d, shard in enumerate(shards):
            self.start(f"d{d}", ["device", *common, "--id", f"d{d}", "--edge", f"e{d % edges}",
                                 "--data", str(shard), "--out", str(self.out)])

    def start(self, name: str, argv: list[str]) -> None:
        argv = [*argv, *self.node_extra.get(name, ())]
        self.argv[name] = argv
        self.procs[name] = _spawn(argv, self.tmp / f"{name}.log", self.node_env.get(name))

    def _wait_for_line(self, name: str, text: str, timeout: float) -> None:
        """Until `name`'s log says `text` (the cloud's "waiting for": the module's broker may still
        hold the stop of an earlier test's run of the same id, which the new cloud clears)."""
        deadline = time.monotonic() + timeout
        while text not in self.log(name) and time.monotonic() < deadline:
            self._check_alive(name)
            time.sleep(0.2)

    def restart(self, name: str, *extra: str) -> None:
        """Start `name` again with the arguments it had (plus `extra`, e.g. --takeover)."""
        self.procs[name] = _spawn([*self.argv[name], *extra], self.tmp / f"{name}.log")

    def metrics(self) -> list[dict]:
        path = self.out / "metrics.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def wait_for_round(self, r: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and len(self.metrics()) < r:
            self._check_alive("cloud")
            time.sleep(0.2)
        assert len(self.metrics()) >= r, f"round {r} not reached\n{self.logs()}"

    def kill(self, name: str) -> None:
        self.procs[name].send_signal(signal.SIGKILL)
        self.procs[name].wait(10)

    def kill_after_round_1(self, victim: str, survivors: tuple[str, ...]) -> tuple[list[dict], float]:
        """SIGKILL `victim` once round 1 is done; returns the metrics and how long the rest took."""
        try:
            self.wait_for_round(1, timeout=120)
            self.kill(victim)
            started = time.monotonic()
            for name in survivors:
                self.procs[name].wait(120)
            return self.metrics(), time.monotonic() - started
        finally:
            self.close()

    def wait(self, timeout: float) -> None:
        """Every process exits by itself once the cloud announces the end of the run."""
        deadline = time.monotonic() + timeout
        for name, proc in self.procs.items():
            try:
                proc.wait(max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pytest.fail(f"{name} did not exit\n{self.log(name)}")

    def _check_alive(self, name: str) -> None:
        if self.procs[name].poll() is not None:
            pytest.fail(f"{name} exited with {self.procs[name].returncode}\n{self.log(name)}")

    def log(self, name: str) -> str:
        return (self.tmp / f"{name}.log").read_text()[-3000:]

    def logs(self) -> str:
        """Every process's state and the end of its log: why a round was not reached."""
        return "\n".join(f"--- {name} ({'running' if p.poll() is None else f'exit {p.returncode}'})\n"
                         f"{self.log(name)[-800:]}" for name, p in self.procs.items())

    def counters(self, node: str) -> list[dict]:
        return json.loads((self.out / f"counters-{node}.json").read_text())["transports"]

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)




CRASH_ROUNDS = 4
CRASH_METHOD = ["--method", "hsfp-cal", "--deadline", "30", "--set", "ic=2", "--set", "ie=2"]
"""The federation the crash-point tests run: H-SFP with head calibration, W_c and W_e averaged
every 2 rounds, so round 2 (where a node dies) commits both."""


def undisturbed_run(tmp: Path) -> list[dict]:
    """The crash-point tests' federation with nobody killed: its metrics, for comparison."""
    from splitedge.protocol.broker import MosquittoBroker

    with MosquittoBroker() as broker:
        fed = Federation(tmp, broker.url, edges=2, devices=4, rounds=CRASH_ROUNDS, extra=CRASH_METHOD)
        try:
            fed.wait(timeout=300)
            return fed.metrics()
        finally:
            fed.close()


def run_with_crash(tmp: Path, node: str, point: str) -> tuple[Federation, list[dict]]:
    """The same federation on a persistent Mosquitto, `node` dying at crash point `point` in
    round 2 (runtime/faults.py) and started again with its arguments (and --takeover); the
    federation and its metrics once every process has exited."""
    from splitedge.protocol.broker import MosquittoBroker
    from splitedge.runtime.faults import ENV

    persist = tmp / "mosquitto"
    persist.mkdir()
    with MosquittoBroker(extra_conf=f"persistence true\npersistence_location {persist}/\n") as broker:
        fed = Federation(tmp, broker.url, edges=2, devices=4, rounds=CRASH_ROUNDS, extra=CRASH_METHOD,
                         node_env={node: {ENV: f"{point}:2"}})
        try:
            assert fed.procs[node].wait(240) == 137, fed.log(node)
            assert f"crash point {point} at round 2" in fed.log(node)
            fed.restart(node, "--takeover")
            fed.wait(timeout=300)
            return fed, fed.metrics()
        finally:
            fed.close()


def assert_undisturbed(fed: Federation, metrics: list[dict], undisturbed: list[dict]) -> None:
    """Every round once, every process exited by itself, the models' versions advanced as
    without the crash, nothing refused, and the accuracy an undisturbed run's."""
    assert [m["round"] for m in metrics] == list(range(1, CRASH_ROUNDS + 1)), fed.logs()
    assert all(proc.returncode == 0 for proc in fed.procs.values()), {n: p.returncode for n, p in fed.procs.items()}
    assert [m["versions"] for m in metrics] == [m["versions"] for m in undisturbed]
    assert not any(n for m in metrics for node in m["rejected"].values() for n in node.values()), \
        [m["rejected"] for m in metrics]
    assert metrics[-1]["accuracy_calibrated"] > undisturbed[-1]["accuracy_calibrated"] - 0.05, \
        (metrics[-1], undisturbed[-1])
