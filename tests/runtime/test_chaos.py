"""Chaos: one run survives a kill -9 of its cloud, of an edge, of two devices, and a graceful
broker restart, as separate processes against Mosquitto (with persistence, as deploy/ runs it).

The run must complete every round exactly once, every process must exit by itself, the
checkpoint must hold the last round and the accuracy must be that of a clean run.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from federation import Federation

ROUNDS = 7


def _checkpoint_round(path: Path) -> int:
    from safetensors import safe_open

    with safe_open(str(path), framework="numpy") as fh:
        return int(fh.metadata()["round"])


@pytest.mark.usefixtures("mosquitto_binary")
def test_a_run_survives_kill_9_of_every_tier_and_a_broker_restart(tmp_path: Path) -> None:
    from splitedge.protocol.broker import MosquittoBroker
    from splitedge.sim import SimSettings, run_sim

    # Prepare: the same federation once undisturbed (in one process) for the reference accuracy
    clean = run_sim(SimSettings(rounds=ROUNDS, devices=4, edges=2, broker=None, out=tmp_path / "clean",
                                deadline_s=30))
    clean_acc = clean["final_accuracy"]
    persist = tmp_path / "mosquitto"
    persist.mkdir()
    with MosquittoBroker(extra_conf=f"persistence true\npersistence_location {persist}/\n") as broker:
        fed = Federation(tmp_path, broker.url, edges=2, devices=4, rounds=ROUNDS, extra=["--deadline", "30"],
                         edge_extra=("--state-dir", str(tmp_path / "edge-state")))
        try:
            # Execute: each tier dies without a clean exit and is started again with its arguments
            fed.wait_for_round(2, timeout=180)
            fed.kill("cloud")
            fed.restart("cloud", "--takeover")  # its status says online until the broker's keepalive
            fed.wait_for_round(3, timeout=180)
            fed.kill("e1")
            fed.restart("e1", "--takeover")
            fed.wait_for_round(4, timeout=180)
            for d in ("d0", "d3"):
                fed.kill(d)
                fed.restart(d, "--takeover")
            fed.wait_for_round(5, timeout=180)
            broker.restart()  # SIGTERM: every client's will fires, then the broker is back
            fed.wait(timeout=300)
            metrics = fed.metrics()
        finally:
            fed.close()
    # Assert: every round once, in order, with an evaluation; the checkpoint is the last round's
    assert [m["round"] for m in metrics] == list(range(1, ROUNDS + 1)), fed.log("cloud")
    assert all(m["accuracy"] is not None for m in metrics)
    assert _checkpoint_round(fed.out / "model.safetensors") == ROUNDS
    # the restarted cloud said it resumed, and the restarted edge took its saved state back
    assert "resuming run itest" in fed.log("cloud")
    assert "resuming session" in fed.log("e1")
    assert all(proc.returncode == 0 for proc in fed.procs.values()), {n: p.returncode for n, p in fed.procs.items()}
    # the accuracy is a clean run's (digits, seed noise is a few points)
    assert metrics[-1]["accuracy"] > clean_acc - 0.1, (metrics[-1]["accuracy"], clean_acc)
    lines = (fed.out / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == ROUNDS and all(json.loads(line)["round"] for line in lines)
