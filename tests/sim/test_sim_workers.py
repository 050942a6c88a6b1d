"""`splitedge sim --workers N`: the devices in N processes of their own against the sim's
broker. The federation is the same: the same seed gives the same accuracy per round and the
devices send the same bytes as when every node is in one process."""

from __future__ import annotations

from pathlib import Path

import pytest

from splitedge.cli import main


def test_devices_in_two_worker_processes_learn_exactly_as_in_one(tmp_path: Path) -> None:
    from splitedge.sim import SimSettings, run_sim

    # Prepare / Execute: the same run in one process and with two device workers
    common = dict(rounds=3, devices=5, edges=2, alpha=0.5, seed=2)
    one = run_sim(SimSettings(**common, out=tmp_path / "one"))
    two = run_sim(SimSettings(**common, workers=2, out=tmp_path / "two"))
    # Assert
    assert two["accuracy_per_round"] == one["accuracy_per_round"]
    assert two["bytes"]["device"]["out_payload"] == one["bytes"]["device"]["out_payload"] > 0
    reports = sorted(p.name for p in (tmp_path / "two" / "workers").glob("worker-?.json"))
    assert reports == ["worker-0.json", "worker-1.json"]


@pytest.mark.parametrize("argv, needle", [
    (["--worker", "2/2", "--broker", "mqtt://127.0.0.1:1", "--run", "r"], "--worker takes I/N"),
    (["--worker", "0/2"], "same --broker URL and --run id"),
    (["--workers", "9", "--devices", "4"], "--workers must be in 0..--devices"),
])
def test_worker_mistakes_are_one_line_before_any_work(argv: list[str], needle: str, capsys) -> None:
    assert main(["sim", *argv]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1, err
