"""`splitedge sim --resumable` killed in the middle of a round carries on from its last finished
round and ends as the run it would have been (issue 27: a bench row of hours must survive the
end of a session).

The sim runs as a process of its own, dies at a crash point (runtime/faults.py: exit 137 with
no cleanup, as kill -9 leaves it) and is started again with the same command: every round's
accuracy equals an undisturbed run's, the metrics hold each round once, and the byte counts
cover the whole run. Before, a sim had only the cloud's resume state: the edges and devices it
holds died with it, so a rerun could only start over (--overwrite).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from resumable_sim import DEVICES, accuracy, sim
from splitedge.protocol.accounting import ByteCounters

CONTROL_KINDS = {"hello", "status", "round"}  # what a restart or a slow round sends again


@pytest.mark.parametrize("method, args", [
    ("hsfp-cal", ("--virtual", "2")),  # parked devices, calibration, the edges' caches of their devices' moments
    pytest.param("cflhkd", ("--groups", "2"), marks=pytest.mark.slow),  # devices moved between edges, put back
])
def test_a_sim_killed_in_round_3_resumes_after_round_2_and_ends_as_an_undisturbed_run(method: str, args: tuple,
                                                                                       tmp_path: Path) -> None:
    # Arrange: the same run undisturbed
    straight = tmp_path / "straight"
    done = sim(straight, "--method", method, *args)
    assert done.returncode == 0, done.stderr[-2000:]
    # Execute: killed in round 3 after its merge, then the same command again
    resumed = tmp_path / "resumed"
    killed = sim(resumed, "--method", method, *args, crash="cloud.aggregated:3")
    assert killed.returncode == 137, killed.stderr[-2000:]
    again = sim(resumed, "--method", method, *args)
    # Assert: resumed after round 2, each round once, every accuracy the undisturbed run's
    assert again.returncode == 0, again.stderr[-2000:]
    assert "resuming run" in again.stdout + again.stderr and "after round 2" in again.stdout + again.stderr
    assert [r for r, _, _ in accuracy(resumed)] == [1, 2, 3, 4]
    assert accuracy(resumed) == accuracy(straight)
    summary, undisturbed = (json.loads((p / "summary.json").read_text()) for p in (resumed, straight))
    assert summary["resumed_after_round"] == 2 and summary["rounds_done"] == 4
    # the byte counts cover the whole run (without the saved counts they would hold half of it;
    # counted twice, half as much again). What devices send carries the method's data and is the
    # undisturbed run's to the byte. What they receive is too, but for MQTT's retained messages: a
    # round plan or a slot's latest model (W_c, the calibration parts) is delivered again to
    # whoever subscribes again, which timing decides (a CI run under load: one device took a
    # 39,570-byte weights message a second time); so each kind's count lies between the
    # undisturbed run's and that plus one delivery a device
    kinds, straight_kinds = summary["device_bytes_by_kind"], undisturbed["device_bytes_by_kind"]
    data = {k: v for k, v in straight_kinds["out"].items() if k not in CONTROL_KINDS}
    assert data and {k: kinds["out"].get(k) for k in data} == data
    received = {k: v for k, v in straight_kinds["in"].items() if k not in CONTROL_KINDS}
    assert received
    for kind, want in received.items():
        got = kinds["in"].get(kind, {"messages": 0, "payload": 0})
        assert want["messages"] <= got["messages"] <= want["messages"] + DEVICES, kind
        assert want["payload"] <= got["payload"] <= 1.25 * want["payload"], kind
    for way, kinds_of_way in (("out", data), ("in", received)):
        assert summary["bytes"]["device"][f"{way}_payload"] >= sum(v["payload"] for v in kinds_of_way.values())
    assert summary["wall_seconds"] > 0


def test_a_resume_with_other_settings_or_of_a_finished_sim_is_one_clear_error(tmp_path: Path) -> None:
    out = tmp_path / "run"
    killed = sim(out, "--method", "fedavg", crash="cloud.aggregated:2")
    assert killed.returncode == 137
    # Execute / Assert: another seed is refused, naming the flag; nothing in the folder changes
    before = (out / "sim.state").read_bytes()
    other = sim(out, "--method", "fedavg", "--seed", "1")
    assert other.returncode != 0 and "--seed 1 differs" in other.stderr and "Traceback" not in other.stderr
    assert (out / "sim.state").read_bytes() == before
    # the same command finishes it; run once more, there is nothing to resume
    assert sim(out, "--method", "fedavg").returncode == 0
    finished = sim(out, "--method", "fedavg")
    assert finished.returncode != 0 and "nothing to resume" in finished.stderr and "Traceback" not in finished.stderr


def test_resumable_refuses_devices_that_live_in_other_processes(tmp_path: Path) -> None:
    from splitedge.sim import SimSettings

    with pytest.raises(ValueError, match="--resumable keeps every node's state from this process"):
        SimSettings(resumable=True, workers=2, out=tmp_path)


def test_counters_carry_on_from_an_earlier_connection() -> None:
    earlier, now = ByteCounters(), ByteCounters()
    earlier.record("out", "weights", 100, 110)
    earlier.record_control("in", 4, "puback")
    now.record("out", "weights", 10, 12)
    now.carry_on(earlier.state())
    assert now.total("out", "messages") == 2 and now.total("out", "payload") == 110
    assert now.total("out", "packet") == 122 and now.total("in", "wire") == 4
    assert now.control_breakdown()["in"] == {"puback": 4}


def test_a_bench_killed_in_the_middle_of_a_run_resumes_it_with_resume(tmp_path: Path) -> None:
    """`bench accuracy --resume` after a kill carries the unfinished run on (its sim kept under
    --out/sims) instead of starting it again; the kept sim goes once the run is in the JSON."""
    bench = [sys.executable, "-m", "splitedge", "bench", "accuracy", "--no-plots", "--methods", "fedavg",
             "--alphas", "iid", "--rounds", "4", "--max-train", "600", "--max-test", "200"]
    env = {k: v for k, v in os.environ.items() if k != "SPLITEDGE_CRASH_AT"}
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert subprocess.run([*bench, "--out", str(straight)], env=env, capture_output=True, timeout=300).returncode == 0
    killed = subprocess.run([*bench, "--out", str(resumed)], env={**env, "SPLITEDGE_CRASH_AT": "cloud.aggregated:3"},
                            capture_output=True, text=True, timeout=300)
    assert killed.returncode == 137 and (resumed / "sims" / "fedavg-IID" / "sim.state").exists(), killed.stderr[-2000:]
    again = subprocess.run([*bench, "--out", str(resumed), "--resume"], env=env, capture_output=True, text=True,
                           timeout=300)
    assert again.returncode == 0, again.stderr[-2000:]
    rows = [json.loads((p / "accuracy.json").read_text())["results"]["runs"][0] for p in (straight, resumed)]
    assert rows[1]["accuracy_per_round"] == rows[0]["accuracy_per_round"]
    assert [r["round"] for r in rows[1]["per_round"]] == [1, 2, 3, 4]
    ups = [r["bytes"]["device"]["out_payload"] for r in rows[1]["per_round"]]
    assert ups == sorted(ups) and ups[-1] >= rows[0]["per_round"][-1]["bytes"]["device"]["out_payload"]
    assert not (resumed / "sims").exists()  # nothing left unfinished
