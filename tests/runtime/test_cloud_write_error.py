"""A cloud that cannot write its round (a full disk, a file in the way) stops with the path in
its error and announces no stop: edges and devices wait, and the cloud restarted with the same
arguments resumes after its last committed round. It used to announce the end of the run, so
every node left and a restarted cloud waited for edges that were gone."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

from brokers import mosquitto  # noqa: F401 - the module's private broker
from federation import Federation


def test_a_write_error_keeps_the_federation_for_the_restarted_cloud(tmp_path: Path, mosquitto) -> None:  # noqa: F811
    # Prepare: 1 edge, 2 devices as processes; metrics.jsonl replaced by a folder after round 1
    fed = Federation(tmp_path, mosquitto.url, edges=1, devices=2, rounds=4, extra=["--deadline", "120"])
    try:
        fed.wait_for_round(1, timeout=180)
        metrics = fed.out / "metrics.jsonl"
        kept = tmp_path / "metrics.kept"
        shutil.move(metrics, kept)
        metrics.mkdir()
        # Execute: the cloud's next write fails
        assert fed.procs["cloud"].wait(120) != 0
        time.sleep(3)  # had a stop been announced, the edge and devices would be leaving now
        alive = {name: fed.procs[name].poll() is None for name in ("e0", "d0", "d1")}
        metrics.rmdir()
        shutil.move(kept, metrics)
        fed.restart("cloud")
        fed.wait(timeout=240)
        rounds = [m["round"] for m in fed.metrics()]
    finally:
        fed.close()
    # Assert: the error named the file's folder, nobody left, and every round is logged once
    log = fed.log("cloud")
    assert "cannot write round" in log and str(fed.out) in log and "restart the cloud" in log, log
    assert alive == {"e0": True, "d0": True, "d1": True}
    assert rounds == [1, 2, 3, 4], (rounds, log)
    assert all(fed.procs[name].returncode == 0 for name in ("cloud", "e0", "d0", "d1"))
