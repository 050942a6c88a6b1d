"""Run ids are reused (the broker's ACL names them) and shards get corrected (issue 56, item 4),
as processes on a real Mosquitto:

- nodes of a new run under a finished run's id start before its cloud, find the old run's
  retained stop, wait for the new cloud however long it takes (on 52b8928 they left after 15 s
  with exit 0, and their units never started them again), and take part in its rounds;
- a device restarted with a corrected shard (more samples than its first hello said) is
  re-admitted by its new hello (on 52b8928 its edge kept the first allowance and refused its
  weights every round, `state.samples`, while counting it done);
- a device whose message of a round its edge refuses does not count as done in that round: the
  edge says why, and the cloud records the round's failure as "refused".
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

import numpy as np
import pytest

from federation import Federation, _spawn

OLD_GRACE_S = 15.0
"""How long a node waited for a new cloud on 52b8928 before leaving a finished run's stop."""


def _wait_for(fed_log: Callable[[], str], text: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while text not in fed_log() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert text in fed_log(), fed_log()


def test_nodes_started_before_a_new_cloud_of_a_reused_run_id_wait_for_it(tmp_path: Path) -> None:
    from splitedge.protocol.broker import MosquittoBroker

    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir(), second.mkdir()
    with MosquittoBroker() as broker:
        # Prepare: a run "itest" that finished (its stop stays retained on the broker)
        done = Federation(first, broker.url, edges=1, devices=2, rounds=1, extra=[])
        try:
            done.wait(timeout=240)
        finally:
            done.close()
        assert all(p.returncode == 0 for p in done.procs.values()), done.logs()
        # Execute: the next run under the same id, its edge and devices started first
        argv = {name: [a.replace(str(first), str(second)) for a in args] for name, args in done.argv.items()}
        for shard in first.glob("d*.npz"):
            (second / shard.name).write_bytes(shard.read_bytes())
        procs = {name: _spawn(argv[name], second / f"{name}.log") for name in ("e0", "d0", "d1")}
        log = lambda name: (second / f"{name}.log").read_text()  # noqa: E731
        try:
            # the edge finds the old stop; a device finds it too when it connects before its edge
            # clears its own downlink, else it waits for its edge's round: either way it stays
            _wait_for(lambda: log("e0"), "waiting for a new run with this id", timeout=120)
            for name in ("d0", "d1"):
                _wait_for(lambda n=name: log(n), "waiting for", timeout=120)
            time.sleep(OLD_GRACE_S + 1.0)  # the cloud comes late (its unit, an operator)
            assert all(p.poll() is None for p in procs.values()), {n: log(n)[-2000:] for n in procs}
            procs["cloud"] = _spawn(argv["cloud"], second / "cloud.log")
            # Assert: all of them take part in the new run's round and end with it
            for name, proc in procs.items():
                assert proc.wait(240) == 0, log(name)[-3000:]
        finally:
            for proc in procs.values():
                if proc.poll() is None:
                    proc.kill()
    assert "round 1 closed with 2/2 devices" in log("e0"), log("e0")[-3000:]
    assert len((second / "out" / "metrics.jsonl").read_text().splitlines()) == 1, log("cloud")[-3000:]


def _bigger_shard(path: Path, times: int = 2) -> None:
    """The device's shard corrected: the same images and more (a transfer that had been cut)."""
    with np.load(path) as shard:
        x, y = shard["x"], shard["y"]
    from splitedge.methods.data.datasets import save_shard

    save_shard(path, np.concatenate([x] * times), np.concatenate([y] * times))


def test_a_device_restarted_with_a_corrected_shard_is_readmitted(tmp_path: Path, mosquitto) -> None:
    """The federation's only device is stopped after round 1 and started again with its shard
    corrected; the cloud waits for a device (wait_for_a_device), so the run cannot end before it
    is back, whatever the load."""
    fed = Federation(tmp_path, mosquitto.url, edges=1, devices=1, rounds=3, extra=["--method", "fedavg"])
    try:
        fed.wait_for_round(1, timeout=180)
        fed.kill("d0")
        _bigger_shard(tmp_path / "d0.npz")
        fed.restart("d0", "--takeover")
        fed.wait(timeout=240)
    finally:
        fed.close()
    edge_log = (tmp_path / "e0.log").read_text()
    assert "device d0 came back with another shard" in edge_log, edge_log[-3000:]
    assert "state.samples" not in edge_log, edge_log[-3000:]
    metrics = fed.metrics()
    assert len(metrics) == 3 and not any(m.get("failures") for m in metrics), fed.logs()
    # the rounds after it came back took it, weighed by its corrected shard
    assert "closed with 1/1 devices" in edge_log.split("came back with another shard")[1], edge_log[-3000:]


def test_a_device_whose_message_its_edge_refuses_does_not_count_as_done(tmp_path: Path, mosquitto) -> None:
    """The operator's manifest allows d1 half its shard: every weight map it sends is refused
    (`state.samples`), and each round records it as failed ("refused"), not as a device that
    took part."""
    import json

    from splitedge.bench.soak import write_digit_shards

    shards = write_digit_shards(tmp_path, 2)  # what Federation writes too
    entries = []
    for d, path in enumerate(shards):
        with np.load(path) as shard:
            counts = np.bincount(shard["y"], minlength=10)
        entries.append({"id": f"d{d}", "samples": int(counts.sum()) // (1 + d),
                        "class_counts": (counts // (1 + d)).tolist()})
    (tmp_path / "shards.json").write_text(json.dumps({"devices": entries}))
    fed = Federation(tmp_path, mosquitto.url, edges=1, devices=2, rounds=2, extra=["--method", "fedavg"],
                     edge_extra=("--manifest", str(tmp_path / "shards.json")))
    try:
        fed.wait(timeout=300)
    finally:
        fed.close()
    edge_log = (tmp_path / "e0.log").read_text()
    assert "device d1's round 1 does not count: its message was refused [state.samples]" in edge_log, edge_log[-3000:]
    assert "(1 failed: refused 1)" in edge_log, edge_log[-3000:]
    assert [m.get("failures") for m in fed.metrics()] == [{"refused": 1}] * 2, fed.logs()
