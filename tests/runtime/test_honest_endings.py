"""Endings that say what happened (issue 56, item 5): a sim that cannot run what it was asked
refuses before it starts; a run in which no device took part is not "complete"; the final
accuracy names its head and the served model's is given beside it; an interrupted cloud's stop
is not taken for the run's end by its edges and devices; an edge's round line never counts more
devices than the round expected."""

from __future__ import annotations

import dataclasses
import json
import logging
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from splitedge.sim import SimSettings, run_sim


def test_a_sim_whose_method_has_no_device_part_for_a_backend_refuses_before_it_starts(tmp_path: Path) -> None:
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "splitedge", "sim", "--method", "fedprox", "--backends", "onnx",
                           "--rounds", "1", "--out", str(tmp_path / "run")], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "fedprox has no device part for backend onnx" in lines[0], proc.stderr
    assert "--backends" in lines[0] and "hsfp" in lines[0]  # what to do instead
    assert not (tmp_path / "run").exists() and "round" not in proc.stdout  # nothing started, nothing written
    assert time.monotonic() - started < 120
    # a mix that holds one such backend too; a method whose device part runs on both is let through
    with pytest.raises(ValueError, match="no device part for backend onnx"):
        SimSettings(method="fedprox", backends=("torch", "onnx"), out=tmp_path / "mixed")
    SimSettings(method="hsfp", backends=("torch", "onnx"), out=tmp_path / "hsfp")


def test_a_sim_in_which_every_device_left_does_not_report_complete(tmp_path: Path) -> None:
    """The finding: fedprox with onnx devices only (then fedavg, which has thin devices now). Each
    device leaves at round 1 saying why;
    summary.json said "status": "complete", "closed_on_quorum": true (and chance accuracy). The
    up-front refusal above now stops that command, so the settings are changed after it."""
    torch.set_num_threads(1)
    s = SimSettings(method="fedprox", rounds=1, devices=2, edges=1, max_train=200, max_test=100, out=tmp_path / "run")
    s.backends = ("onnx",)  # past the check: every device leaves at round 1
    summary = run_sim(s)
    written = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert written["status"] == summary["status"] == "no_devices", written
    assert "no device part for backend 'onnx'" in written["status_reason"], written["status_reason"]
    assert written["closed_on_quorum"] is False
    record = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert record["devices_reported"] == 0, record


def test_the_final_accuracy_names_its_head_and_the_served_models_is_given(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    s = SimSettings(method="fedavg", rounds=1, devices=2, edges=1, max_train=300, max_test=200, out=tmp_path / "run",
                    overrides={"calibrate": "lda", "min_class_count": 1})
    summary = run_sim(s)
    record = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert summary.get("final_accuracy_head") == "own" and summary["final_accuracy"] == record["accuracy"], summary
    assert summary["status"] == "complete" and record["devices_reported"] == 2, summary
    # every class held: the calibrated head is what the checkpoint (and export) carries
    assert record["served_head"] == summary["served_head"] == "calibrated", record
    assert summary["served_accuracy"] == summary["final_accuracy_calibrated"] == record["accuracy_calibrated"]
    # without calibration the model serves its own head
    plain = run_sim(SimSettings(method="fedavg", rounds=1, devices=2, edges=1, max_train=300, max_test=200,
                                out=tmp_path / "plain"))
    assert plain["served_head"] == "own" and plain["served_accuracy"] == plain["final_accuracy"]


def test_the_served_head_and_its_accuracy_come_from_the_records() -> None:
    from splitedge.runtime.outputs import ending, served

    own = [{"round": 1, "accuracy": 0.5, "served_head": "own", "devices_reported": 2}]
    assert served(own) == ("own", 0.5) and ending(own) == ("complete", None)
    cal = [{"round": 1, "accuracy": 0.86, "accuracy_calibrated": 0.95, "served_head": "calibrated"},
           {"round": 2, "accuracy": 0.87, "served_head": "calibrated"}]  # calibrated at round 1 only
    assert served(cal) == ("calibrated", 0.95)
    assert served([]) == ("own", None)
    left = {"d0 (edge e0)": "gone", "d1 (edge e0)": "gone"}
    rounds = [{"round": 1, "devices_reported": 2}, {"round": 2, "devices_reported": 0}]
    status, why = ending(rounds, left, devices=2)
    assert status == "no_devices" and "none took part after round 1" in why and "d0 (edge e0) left: gone" in why
    assert ending(rounds, {"d0 (edge e0)": "gone"}, devices=2)[0] == "complete"  # d1 is still there
    assert ending([{"round": 1}])[0] == "complete"  # an older cloud's record: no count, not judged


def _federation(tmp_path: Path, caplog: pytest.LogCaptureFixture, rounds: int = 3):
    """An in-process federation (one edge, two devices) on the embedded broker, and a cloud
    that is interrupted (as Ctrl-C or SIGTERM does) once round 1 is written."""
    from splitedge.cloud.coordinator import CloudCoordinator, CloudSettings
    from splitedge.cloud.options import build_run_config
    from splitedge.methods.data.datasets import load_dataset
    from splitedge.protocol.broker import EmbeddedBroker
    from splitedge.sim import Federation, partition

    caplog.set_level(logging.INFO, logger="splitedge.status")
    torch.set_num_threads(1)
    s = SimSettings(method="fedavg", rounds=rounds, devices=2, edges=1, max_train=200, max_test=100,
                    out=tmp_path / "run")
    train, test, info = load_dataset(s.dataset, s.data, max_train=s.max_train, max_test=s.max_test, seed=s.seed)
    config = build_run_config(s.method, info, s.model, s.seed, s.overrides)

    def interrupt(record: dict) -> None:
        raise KeyboardInterrupt

    (tmp_path / "cloud").mkdir()  # the cloud's --out (its command makes it)
    broker = EmbeddedBroker()
    broker.__enter__()
    fed = Federation(broker.url, "honest", s, train, partition(train[1], s))
    fed.__enter__()
    settings = CloudSettings(method=s.method, rounds=rounds, config=config, deadline_s=60, min_edges=1,
                             min_devices=2, join_timeout_s=60, on_round=interrupt, out_dir=tmp_path / "cloud")
    cloud = CloudCoordinator(fed.connect("cloud", "cloud"), settings, run="honest", test=test, host=fed.hosts()[0])

    def restarted() -> CloudCoordinator:  # the same cloud command again: it resumes from its --out
        from splitedge.cloud import resume

        again = dataclasses.replace(settings, on_round=None, join_timeout_s=1.0)
        return CloudCoordinator(fed.connect("cloud", "cloud"), again, run="honest", test=test, host=fed.hosts()[0],
                                resume_from=resume.load(settings.out_dir))
    return broker, fed, cloud, restarted


def test_an_interrupted_clouds_stop_is_not_logged_as_the_runs_end(tmp_path: Path, caplog) -> None:
    broker, fed, cloud, restarted = _federation(tmp_path, caplog)
    try:
        with pytest.raises(KeyboardInterrupt):
            cloud.run()
        fed.wait_stopped(timeout=60)  # the edge and the devices leave on the cloud's stop
        alive = [t.name for t in fed.threads if t.is_alive()]
        interrupted = {n.node_id: n.stops.interrupted for n in fed.nodes}
        for tier in ("edge", "device"):  # their processes would exit now: offline
            for transport in fed.transports[tier]:
                transport.close(offline=True)
        # the cloud started again on its --out resumes after round 1; nobody restarted the nodes
        with pytest.raises(TimeoutError) as timeout:
            restarted().run()
    finally:
        fed.__exit__(None, None, None)
        broker.__exit__(None, None, None)
    lines = [r.getMessage() for r in caplog.records if r.name == "splitedge.status"]
    for node in ("edge e0", "device d0", "device d1"):
        said = [line for line in lines if line.startswith(node + ":")]
        assert not any("finished" in line for line in said), said
        assert any("the cloud was interrupted after round 1" in line and "exit status 75" in line for line in said), said
    assert not alive, alive
    # ... and each leaves with its own exit status (a unit with Restart=on-failure starts it again)
    from splitedge.runtime.stopping import EXIT_INTERRUPTED

    assert EXIT_INTERRUPTED == 75 and interrupted == {"e0": 1, "d0": 1, "d1": 1}, interrupted
    # the resumed cloud's join timeout says that its interrupt may have made them leave
    said = str(timeout.value)
    assert "raise --join-timeout" in said and "resumes run honest after round 1" in said, said
    assert "if it was interrupted (Ctrl-C, SIGTERM)" in said and "start them again" in said, said


def test_a_node_that_finds_an_interrupted_stop_before_any_round_waits_for_the_cloud() -> None:
    """A node restarted (by its unit) after its cloud was interrupted finds that stop retained:
    it waits for the resumed cloud's round instead of leaving."""
    from splitedge.methods.contract import RoundPlan
    from splitedge.runtime.node import Node

    node = Node(run="honest", tier="device", node_id="d0")
    stop = RoundPlan(round=4, method="fedavg", deadline_s=1.0, config={}, session="s1", stop=True,
                     directives={"interrupted": 3})
    assert node.stops.on_stop(stop, started=False, done="") == "held"
    assert not node.stopped.is_set() and node.stops.held == "resume" and node.stops.interrupted == 3
    resumed = RoundPlan(round=4, method="fedavg", deadline_s=60.0, config={}, session="s1")
    assert node.stops.on_stop(resumed, started=False, done="") is None and node.stops.interrupted is None


def test_an_edges_round_line_never_counts_more_devices_than_it_expected(tmp_path: Path, caplog) -> None:
    """The finding: `round 1 closed with 2/1 devices` (the devices that reported, over those
    live when the line was written). The every-device-left sim: each device reported (its
    `done` says it left), none trained."""
    caplog.set_level(logging.INFO, logger="splitedge.status")
    torch.set_num_threads(1)
    s = SimSettings(method="fedprox", rounds=1, devices=2, edges=1, max_train=200, max_test=100, out=tmp_path / "run")
    s.backends = ("onnx",)  # fedprox has no thin device: each leaves at round 1
    run_sim(s)
    closed = [r.getMessage() for r in caplog.records if "closed with" in r.getMessage()]
    assert closed and all("closed with 0/2 devices (2 left the run)" in line for line in closed), closed


def test_the_clouds_last_line_is_the_served_models_accuracy(tmp_path: Path, capsys, monkeypatch) -> None:
    """The finding: the cloud printed the own head's final accuracy (0.864) while it served and
    exported the calibrated model (0.953)."""
    from splitedge.cli import build_parser
    from splitedge.cloud import cli as cloud_cli

    history = [{"round": 1, "accuracy": 0.864, "accuracy_calibrated": 0.953, "served_head": "calibrated",
                "devices_reported": 2}]
    monkeypatch.setattr(cloud_cli, "_run", lambda *a, **kw: history)
    args = build_parser("cloud", ["cloud", "--broker", "mqtt://127.0.0.1:1"]).parse_args(
        ["cloud", "--broker", "mqtt://127.0.0.1:1", "--out", str(tmp_path / "out")])
    assert cloud_cli.run(args) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert "0.9530" in lines[-1] and "calibrated" in lines[-1] and "model.safetensors" in lines[-1], lines
    printed = json.loads(lines[-2])
    assert printed["final_accuracy"] == 0.864 and printed["final_accuracy_head"] == "own", printed
    assert printed["served_head"] == "calibrated" and printed["served_accuracy"] == 0.953, printed
    # a run in which no device's training reached the cloud: one line, exit 1
    history[:] = [{"round": 1, "accuracy": 0.097, "served_head": "own", "devices_reported": 0}]
    assert cloud_cli.run(args) == 1
    assert "the run did not train: no device's training reached the cloud" in capsys.readouterr().err
