"""`splitedge bench`: each suite's --quick run writes JSON with the expected keys, positive
numbers and a markdown table; the transports' byte counts agree with Mosquitto's $SYS."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from splitedge.bench import ram
from splitedge.bench.lib.procmem import spawn_splitedge
from splitedge.bench.matrix import PLANS as MATRIX_PLANS
from splitedge.bench.lib.report import table
from splitedge.bench.lib.simrun import bytes_to_target
from parts import shipped_methods
from splitedge.cli import build_parser, main

needs_mosquitto = pytest.mark.usefixtures("mosquitto_binary")  # skipped locally, failed on CI (brokers.py)
ENV_KEYS = {"suite", "command", "config", "machine", "versions", "results", "seconds"}


def run_bench(tmp_path: Path, suite: str, *extra: str) -> dict[str, Any]:
    assert main(["bench", suite, "--quick", "--out", str(tmp_path), *extra]) == 0
    doc = json.loads((tmp_path / f"{suite}.json").read_text())
    assert ENV_KEYS <= set(doc)
    assert doc["machine"]["cpu_count"] >= 1 and doc["machine"]["ram_total_bytes"] > 0
    assert doc["versions"]["numpy"] and doc["versions"]["paho-mqtt"] and doc["versions"]["msgpack"]
    assert doc["command"].startswith(f"splitedge bench {suite} --quick")
    md = (tmp_path / f"{suite}.md").read_text()
    assert "|---|" in md and "command:" in md
    return doc


def check_bandwidth_row(row: dict[str, Any]) -> None:
    assert "error" not in row, row.get("error")
    for key in ("device_up_payload_per_device_per_round", "device_down_payload_per_device_per_round",
                "edge_up_payload_per_edge_per_round", "all_tiers_out_wire_bytes"):
        assert row[key] > 0, key
    assert 0.0 <= row["final_accuracy"] <= 1.0
    sys_check = row["sys_agreement"]
    assert sys_check["broker_received_delta"] > 0
    assert sys_check["diff_pct"] < 2.0, sys_check


@needs_mosquitto
def test_bandwidth_quick_hsfp(tmp_path: Path) -> None:
    doc = run_bench(tmp_path, "bandwidth", "--methods", "hsfp")

    res = doc["results"]
    assert [r["method"] for r in res["methods"]] == ["hsfp"]
    check_bandwidth_row(res["methods"][0])
    assert res["target_accuracy"] is not None and res["methods"][0]["bytes_to_target"]["device_payload_bytes"] > 0
    assert all(r["overhead_bytes"] > 0 and r["overhead_pct"] < 2 for r in res["moments_overhead"])
    assert (tmp_path / "bandwidth.png").exists()


@pytest.mark.slow
@needs_mosquitto
@pytest.mark.parametrize("method", shipped_methods())
def test_bandwidth_quick_every_registered_method(tmp_path: Path, method: str) -> None:
    doc = run_bench(tmp_path, "bandwidth", "--methods", method, "--no-plots")

    check_bandwidth_row(doc["results"]["methods"][0])


@needs_mosquitto
def test_throughput_quick(tmp_path: Path) -> None:
    doc = run_bench(tmp_path, "throughput", "--no-plots")

    merge = doc["results"]["merge"]
    assert {r["mode"] for r in merge} == {"in-process", "end-to-end"}
    assert {r["devices"] for r in merge} == {10, 100}
    assert all(r["messages_per_s"] > 0 and r["message_bytes"] > 40_000 for r in merge)
    assert all(r["complete"] and r["received"] == r["devices"] and not r["rejected"]
               for r in merge if r["mode"] == "end-to-end")
    grow = doc["results"]["round_time"]
    assert [r["devices"] for r in grow] == [2, 4] and all(r["mean_round_seconds"] > 0 for r in grow)


@pytest.mark.slow
@needs_mosquitto
def test_ram_quick(tmp_path: Path) -> None:
    doc = run_bench(tmp_path, "ram", "--no-plots")

    runs = doc["results"]["runs"]
    assert runs and all(r["completed"] for r in runs), [r.get("log_tails") for r in runs]
    for r in runs:
        roles = {row["role"]: row for row in r["rows"]}
        assert {"cloud", "edge", "device", "broker"} <= set(roles)
        assert all(row["peak_mb"] > 0 and row["vm_hwm_mb"] > 0 for row in roles.values())
        assert roles["device"]["goal_mb"] == {"torch": 300, "onnx": 100}[r["backend"]]  # the thin one trains
        assert roles["device"]["trains"] is True and roles["device"]["cpu_s_per_round"] > 0


def test_ram_measures_each_method_on_the_backends_it_has_device_parts_for(tmp_path: Path) -> None:
    """`--methods fedprox`: FedProx's torch device measured in a FedProx run; a thin device has no
    FedProx part, so that pair is skipped with the reason, not run as a federation waiting for a
    device that left (hsfp on both backends: test_ram_quick)."""
    doc = run_bench(tmp_path, "ram", "--no-plots", "--methods", "fedprox", "--backends", "torch,onnx")
    runs = {(r["method"], r["backend"]): r for r in doc["results"]["runs"]}
    assert set(runs) == {("fedprox", "torch")}, set(runs)
    assert runs[("fedprox", "torch")]["completed"], runs[("fedprox", "torch")].get("log_tails")
    assert "fedprox has no device part for the onnx backend" in doc["results"]["skipped"]["fedprox on onnx"]
    device = next(row for row in runs[("fedprox", "torch")]["rows"] if row["role"] == "device")
    assert device["peak_mb"] > 100 and device["exit_code"] == 0  # a torch process
    md = (tmp_path / "ram.md").read_text()
    assert "| fedprox | torch | device |" in md and "rounds of fedprox" in md and "W_c averaged" not in md, md
    assert main(["bench", "ram", "--methods", "fedavg,nope", "--out", str(tmp_path / "bad")]) == 2  # before any work
    assert not (tmp_path / "bad").exists()


def test_ram_spawns_the_device_under_the_given_interpreter_with_its_unit_environment(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Prepare: a stand-in interpreter that records how it was called; the unit's variables unset here
    for key in ("MALLOC_ARENA_MAX", "PYTHONUNBUFFERED"):
        monkeypatch.delenv(key, raising=False)
    fake = tmp_path / "bin" / "python"
    fake.parent.mkdir()
    fake.write_text(f'#!/bin/sh\necho "$@" > {tmp_path}/argv\nenv > {tmp_path}/env\n')
    fake.chmod(0o755)
    args = build_parser("bench").parse_args(["bench", "ram", "--device-python", str(fake)])
    settings = ram.Settings.from_args(args)

    # Act: spawn the device the way measure_backend does
    proc = spawn_splitedge(["device", "--id", "d0"], tmp_path / "device.log", python=settings.device_python,
                           env=ram.unit_environment())

    # Assert: the same checkout's CLI under that interpreter, with the systemd unit's variables
    assert proc.wait(30) == 0
    assert (tmp_path / "argv").read_text().split() == ["-m", "splitedge", "device", "--id", "d0"]
    env = dict(line.split("=", 1) for line in (tmp_path / "env").read_text().splitlines() if "=" in line)
    assert env["MALLOC_ARENA_MAX"] == "2" and env["OMP_NUM_THREADS"] == "1" and env["PYTHONUNBUFFERED"] == "1"
    assert env.get("PYTHONPATH") == os.environ.get("PYTHONPATH")  # the installed package runs, not a checkout
    info = {"path": settings.device_python, "python": "3.11.2", "torch": "2.13.0+cpu", "env": {"MALLOC_ARENA_MAX": "2"},
            "env_source": "deploy/splitedge-device.service"}
    md = ram.markdown({"runs": [], "skipped": {}, "goal_condition": "x", "device": info})
    assert f"`{fake}` (Python 3.11.2, torch 2.13.0+cpu)" in md and "`MALLOC_ARENA_MAX=2`" in md


def test_device_memory_accounts_each_stage_of_a_thin_trainer_without_torch(tmp_path: Path) -> None:
    doc = run_bench(tmp_path, "device-memory", "--no-plots", "--backends", "onnx", "--images", "300")
    (run_,) = doc["results"]["runs"]
    stages = [row["stage"] for row in run_["stages"]]
    assert stages[0] == "interpreter" and stages[2] == "engine (numpy layers)" and stages[-1] == "one local epoch (peak)"
    assert run_["torch_imported"] is False
    rss = [row["rss_mb"] for row in run_["stages"]]
    assert rss == sorted(rss) and rss[0] > 5  # every stage adds, the epoch's peak last
    assert run_["epoch_cpu_s"] > 0 and run_["images"] == 300


def test_memory_cap_is_enforced_by_the_kernel(tmp_path: Path) -> None:
    """bench ram --device-mem-cap: a child in the cgroup cannot hold more than the cap."""
    import subprocess
    import sys

    from splitedge.bench.memcap import MemoryCap

    if os.geteuid() != 0:
        pytest.skip("memory cgroups need root here")
    cap = MemoryCap(64)
    try:
        code = "import numpy as np; a = np.ones(200 * 2**20 // 8); print(a.sum())"
        proc = subprocess.run([sys.executable, "-c", code], preexec_fn=cap.join, capture_output=True, timeout=120)
        small = subprocess.run([sys.executable, "-c", "print(1)"], preexec_fn=cap.join, capture_output=True, timeout=60)
    finally:
        events = cap.events()
        cap.close()
    assert proc.returncode != 0  # killed (or MemoryError) at 64 MB
    assert small.returncode == 0
    assert events["oom_kill"] + events.get("failcnt", 0) + events.get("memsw_failcnt", 0) + events.get("max", 0) > 0, events
    assert events["peak_mb"] <= 64.5


def test_ram_device_environment_without_deploy_folder_is_the_units(monkeypatch: pytest.MonkeyPatch,
                                                                     tmp_path: Path) -> None:
    # a wheel install has no deploy/: the bench uses its copy, which must equal the unit's
    assert ram.DEVICE_UNIT_ENV == ram.unit_environment(ram.DEVICE_UNIT)
    monkeypatch.setattr(ram, "DEVICE_UNIT", tmp_path / "missing.service")
    env, source = ram.device_environment()
    assert env == ram.DEVICE_UNIT_ENV and "not installed" in source


@pytest.mark.slow
@needs_mosquitto
def test_accuracy_quick(tmp_path: Path) -> None:
    doc = run_bench(tmp_path, "accuracy", "--methods", "hsfp", "--no-plots")

    runs = doc["results"]["runs"]
    assert [r["split"] for r in runs] == ["IID", "Dirichlet(0.3)"]
    assert all("error" not in r and r["device_payload_per_device_per_round"] > 0 for r in runs)


@needs_mosquitto
def test_accuracy_runs_in_parallel_and_resumes_keeping_the_runs_it_finished(tmp_path: Path) -> None:
    """--jobs 2 runs two federations at once, each in its own process; --resume then keeps them
    (same numbers, same wall time) and runs only the new variant; other settings are refused."""
    # Prepare / Execute: two variants, two at a time, with calibration and the plateau summary
    common = ["--rounds", "1", "--alphas", "iid", "--no-plots", "--variant", "a=fedavg:calibrate=lda"]
    first = run_bench(tmp_path, "accuracy", *common, "--variant", "b=fedprox", "--jobs", "2")
    rows = {r["method"]: r for r in first["results"]["runs"]}
    assert set(rows) == {"a", "b"} and all("error" not in r for r in rows.values())
    assert rows["a"]["calibrated"]["final"] > 0.3 and rows["b"]["calibrated"] is None  # b did not calibrate
    # Execute: the same bench with one more variant, resumed
    again = run_bench(tmp_path, "accuracy", *common, "--variant", "b=fedprox", "--variant", "c=fedavgm",
                      "--resume")
    # Assert
    rows_again = {r["method"]: r for r in again["results"]["runs"]}
    assert list(rows_again) == ["a", "b", "c"]
    for name in ("a", "b"):
        assert rows_again[name]["wall_seconds"] == rows[name]["wall_seconds"]  # kept, not run again
    assert main(["bench", "accuracy", "--quick", "--out", str(tmp_path), "--rounds", "2", "--alphas", "iid",
                 "--variant", "a=fedavg", "--resume"]) == 2  # a one-line error: other settings
    assert json.loads((tmp_path / "accuracy.json").read_text())["results"]["runs"] == again["results"]["runs"]


def test_the_central_upper_bound_trains_the_same_network_on_every_training_image() -> None:
    from splitedge.bench.accuracy import AccuracySettings
    from splitedge.bench.lib.central import central_run

    s = AccuracySettings(rounds=3, devices=4, max_train=400, max_test=200, seed=1)
    row = central_run(s, "upper", {"device_lr": "0.05"}, None, "IID")
    assert row["train_images"] == 400 and len(row["accuracy_per_round"]) == 3  # one epoch per round
    assert row["final_accuracy"] > 0.5 and row["device_up_per_device_per_round"] == 0  # chance 0.1, no wire
    again = central_run(s, "upper", {"device_lr": "0.05"}, None, "IID")
    assert again["accuracy_per_round"] == row["accuracy_per_round"]  # seeded


def test_bytes_to_target_is_cumulative_until_the_first_round_reaching_it() -> None:
    rounds = [{"round": r, "accuracy": a, "bytes": {"device": {"out_payload": 10 * r, "in_payload": r,
                                                               "out_wire": 11 * r}}}
              for r, a in ((1, 0.2), (2, 0.6), (3, 0.9))]

    assert bytes_to_target(rounds, 0.5) == {"round": 2, "device_payload_bytes": 22, "all_tiers_out_wire_bytes": 22}
    assert bytes_to_target(rounds, 0.95) is None


def test_streaming_merge_equals_one_merge() -> None:
    from splitedge.bench.throughput import CHUNK, StreamingMerge
    from splitedge.methods.moments import compute_moments, merge_moments

    rng = np.random.default_rng(0)
    parts = [compute_moments(rng.normal(size=(30, 4)), rng.integers(0, 3, 30)) for _ in range(CHUNK + 7)]
    merger = StreamingMerge()
    for p in parts:
        merger.add(p)

    got, want = merger.flush(), merge_moments(parts)
    np.testing.assert_array_equal(got.counts, want.counts)
    np.testing.assert_allclose(got.mean, want.mean, rtol=1e-12)
    np.testing.assert_allclose(got.var, want.var, rtol=1e-10)


def test_markdown_table_formats_floats_and_missing_values() -> None:
    assert table(["a", "b"], [(0.123456, None)]) == "| a | b |\n|---|---|\n| 0.1235 | - |"


def test_variant_parses_name_method_and_settings() -> None:
    from splitedge.bench.lib.simrun import parse_variant

    assert parse_variant("hsfp-ic2=hsfp:ic=2, ie=2") == ("hsfp-ic2", "hsfp", {"ic": "2", "ie": "2"})
    assert parse_variant("plain=fedavg") == ("plain", "fedavg", {})
    assert parse_variant("l=fedavg:calib_layer=wc_8,we,classifier,ic=2") == (
        "l", "fedavg", {"calib_layer": "wc_8,we,classifier", "ic": "2"})  # a comma list as a value
    for bad in ("hsfp", "=hsfp:ic=2", "x=hsfp:ic"):
        with pytest.raises(ValueError):
            parse_variant(bad)


def test_every_row_gets_rounds_and_bytes_to_fedavg_final_accuracy_of_its_split() -> None:
    from splitedge.bench.accuracy import add_bytes_to_reference

    def per_round(*acc: float) -> list[dict[str, Any]]:
        return [{"round": r, "accuracy": a, "bytes": {"device": {"out_payload": 100 * r, "in_payload": 0}}}
                for r, a in enumerate(acc, 1)]

    rows = [{"method": "fedavg", "split": "IID", "final_accuracy": 0.5, "per_round": per_round(0.3, 0.5)},
            {"method": "hsfp", "split": "IID", "final_accuracy": 0.6, "per_round": per_round(0.55, 0.6)},
            {"method": "hsfp", "split": "Dirichlet(0.3)", "final_accuracy": 0.2, "per_round": per_round(0.2)},
            {"method": "slow", "base_method": "hsfp", "split": "IID", "final_accuracy": 0.4,
             "per_round": per_round(0.3, 0.4)},
            {"method": "fedproto", "split": "IID", "final_accuracy": 0.9, "per_round": per_round(0.9, 0.9)}]

    targets = add_bytes_to_reference(rows)

    assert targets == {"IID": 0.5, "Dirichlet(0.3)": None}
    assert rows[0]["to_reference"]["round"] == 2 and rows[1]["to_reference"]["device_payload_bytes"] == 100
    assert rows[2]["to_reference"] is None and rows[3]["to_reference"] is None
    assert rows[4]["to_reference"] is None  # personalised accuracy is not held against a global model's


def test_rerender_rewrites_markdown_from_the_json_without_running(tmp_path: Path) -> None:
    from splitedge.bench.lib import report

    rows = [{"method": "fedavg", "base_method": "fedavg", "split": "IID", "final_accuracy": 0.5, "best_accuracy": 0.5,
             "accuracy_per_round": [0.5], "device_payload_per_device_per_round": 10.0, "wall_seconds": 1.0,
             "per_round": [{"round": 1, "accuracy": 0.5, "bytes": {"device": {"out_payload": 7, "in_payload": 3}}}]}]
    doc = report.document("accuracy", ["bench", "accuracy"], {}, {"runs": rows}, 1.0)
    report.write(tmp_path, doc, "stale")

    assert main(["bench", "accuracy", "--rerender", "--no-plots", "--out", str(tmp_path)]) == 0

    md = (tmp_path / "accuracy.md").read_text()
    assert "stale" not in md and "| fedavg | IID | 0.5 |" in md and "fedavg final accuracy 0.5" in md


def test_recorded_command_repeats_append_options_and_joins_lists() -> None:
    from splitedge.bench.cli import add_arguments, command_line
    import argparse

    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["accuracy", "--methods", "fedavg,hsfp", "--variant", "a=hsfp:ic=2,ie=2",
                         "--variant", "b=splitfed", "--set", "device_batch=32"])

    line = command_line(args)
    assert line[:2] == ["bench", "accuracy"]
    text = " ".join(line)
    for part in ("--methods fedavg,hsfp", "--variant a=hsfp:ic=2,ie=2 --variant b=splitfed", "--set device_batch=32"):
        assert part in text, text
    assert p.parse_args(line[1:]).variant == args.variant  # the record replays

    zero = command_line(p.parse_args(["device-memory", "--train-chunk", "0"]))  # 0 is a value, not "unset"
    assert "--train-chunk 0" in " ".join(zero) and p.parse_args(zero[1:]).train_chunk == 0

    matrix = command_line(p.parse_args(["matrix", "--plan", "smoke", "--out", "m"]))  # its plan holds the rest
    assert matrix == ["bench", "matrix", "--out", "m", "--plan", "smoke"], matrix
    some = command_line(p.parse_args(["matrix", "--plan", "smoke", "--out", "m", "--cells", "iid-s0"]))
    assert some[-2:] == ["--cells", "iid-s0"], some


def test_a_matrix_runs_the_cells_named_and_refuses_one_its_plan_lacks() -> None:
    """`--cells` picks cells (in the plan's order) so a plan's cells can run in two processes; a
    name the plan lacks is one line listing the plan's cells, before anything runs."""
    import argparse

    from splitedge.bench.cli import add_arguments
    from splitedge.bench.matrix import MatrixSettings

    p = argparse.ArgumentParser()
    add_arguments(p)
    chosen = MatrixSettings.from_args(p.parse_args(["matrix", "--plan", "fedcnn-10dev", "--out", "m",
                                                    "--cells", "dir0.1-s1,iid-s0"]))
    assert chosen.cells == [("iid", 0), ("0.1", 1)], chosen.cells
    every = MatrixSettings.from_args(p.parse_args(["matrix", "--plan", "fedcnn-10dev", "--out", "m"]))
    assert len(every.cells) == 6
    with pytest.raises(ValueError, match=r"--cells: dir0.5-s0 not in this plan; its cells are iid-s0, iid-s1"):
        MatrixSettings.from_args(p.parse_args(["matrix", "--plan", "fedcnn-10dev", "--out", "m", "--cells", "dir0.5-s0"]))


@pytest.mark.slow  # seven processes each importing torch: a minute on two cores
def test_soak_samples_every_tier_per_window_of_rounds(tmp_path: Path) -> None:
    doc = run_bench(tmp_path, "soak", "--rounds", "8", "--no-plots")

    r = doc["results"]
    assert r["rounds_done"] == 8 and set(r["exit_codes"].values()) == {0}, r["logs_of_failed"]
    windows = [w for w in r["windows"] if w["rounds"] != "exit"]
    assert len(windows) >= 4
    for tier in ("cloud", "edge", "device", "broker"):
        assert all(w[f"{tier}_rss_mb"] > 1 and w[f"{tier}_fds"] > 0 for w in windows), (tier, windows)
    assert set(r["growth"]) == {"cloud", "edge", "device", "broker"}


@pytest.mark.slow  # two sims with device workers, each a process tree
def test_scale_reports_every_process_of_each_size(tmp_path: Path) -> None:
    doc = run_bench(tmp_path, "scale", "--no-plots")

    rows = doc["results"]["rows"]
    assert [r["devices"] for r in rows] == [20, 40] and all(r["exit_code"] == 0 for r in rows), rows
    for r in rows:
        assert r["rounds_done"] == 2 and r["final_accuracy"] > 0.3
        assert all(v > 1 for v in r["peak_rss_mb"].values()), r["peak_rss_mb"]
        assert r["sum_of_peaks_mb"] >= r["peak_total_mb"] > 0 and r["broker_messages_received"] > 0
        # the broker relays each message at least to its sender's parent: as many bytes out as in, or more
        assert r["broker"]["bytes/sent"] >= r["broker"]["bytes/received"] > r["bytes_by_tier"]["device"]["out_payload"]
        # each edge relays every message of its devices' rounds: busy, never busier than the broker
        rate = r["edge_messages_per_s"]
        assert 0 < rate["median"] <= rate["max"] <= 2 * r["broker_messages_per_s"], (rate, r["broker_messages_per_s"])


def test_scale_writes_each_size_before_the_next(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from splitedge.bench import scale

    sizes: list[int] = []

    def fake_size(s, devices, work):  # the process tree is not under test here
        sizes.append(devices)
        if len(sizes) == 2:
            raise KeyboardInterrupt
        return {"devices": devices, "edges": 1, "rounds_done": 1, "round_seconds": [1.0], "final_accuracy": 0.5,
                "peak_rss_mb": {"sim (cloud + edges)": 1.0, "device worker (largest)": 1.0, "broker": 1.0},
                "sum_of_peaks_mb": 3.0, "cpu_seconds": {"sim": 1.0, "workers": 1.0, "broker": 1.0},
                "broker_messages_per_s": 1.0, "edge_messages_per_s": None}

    monkeypatch.setattr(scale, "run_one", fake_size)
    code = main(["bench", "scale", "--counts", "10,20", "--out", str(tmp_path), "--no-plots"])
    doc = json.loads((tmp_path / "scale.json").read_text())
    assert code != 0 and doc["partial"] is True and [r["devices"] for r in doc["results"]["rows"]] == [10]


def test_accuracy_variants_alone_run_only_the_variants() -> None:
    from splitedge.bench.accuracy import AccuracySettings
    from splitedge.bench.cli import add_arguments
    import argparse

    p = argparse.ArgumentParser()
    add_arguments(p)
    alone = AccuracySettings.from_args(p.parse_args(["accuracy", "--variant", "a=hsfp:ic=2"]))
    both = AccuracySettings.from_args(p.parse_args(["accuracy", "--methods", "fedavg", "--variant", "a=hsfp:ic=2"]))
    plain = AccuracySettings.from_args(p.parse_args(["accuracy"]))
    assert [e[0] for e in alone.entries()] == ["a"]
    assert [e[0] for e in both.entries()] == ["fedavg", "a"]
    assert "hsfp" in [e[0] for e in plain.entries()] and "a" not in [e[0] for e in plain.entries()]


def test_a_shared_set_reaches_every_row_and_its_record_and_a_variant_overrides_it() -> None:
    # bench accuracy / cluster used to ignore --set silently (a CFLHKD run with --set signal=layout
    # clustered by the default signal)
    from splitedge.bench.cluster import ClusterSettings
    from splitedge.bench.cli import add_arguments
    import argparse

    p = argparse.ArgumentParser()
    add_arguments(p)
    s = ClusterSettings.from_args(p.parse_args(["cluster", "--set", "signal=layout", "--variant",
                                                "upd=cflhkd:signal=updates"]))
    rows = {label: overrides for label, _, overrides in s.entries()}
    assert rows["cflhkd"] == {"signal": "layout"} and rows["clustered-fl"] == {"signal": "layout", "kd": "false"}
    assert rows["upd"] == {"signal": "updates"}
    assert s.sim("cflhkd", None, "r", rows["cflhkd"]).overrides == {"signal": "layout"}
    with pytest.raises(ValueError, match="--set expects KEY=VALUE, got 'signal'"):
        ClusterSettings.from_args(p.parse_args(["cluster", "--set", "signal"]))


def test_accuracy_virtual_devices_reach_the_sim() -> None:
    from splitedge.bench.accuracy import AccuracySettings
    from splitedge.bench.cli import add_arguments
    import argparse

    p = argparse.ArgumentParser()
    add_arguments(p)
    virtual = AccuracySettings.from_args(p.parse_args(["accuracy", "--virtual", "2"]))
    plain = AccuracySettings.from_args(p.parse_args(["accuracy"]))
    assert virtual.sim("fedavg", 0.3, "r").virtual == 2
    assert plain.sim("fedavg", 0.3, "r").virtual == 0  # every device keeps its model, as before
    with pytest.raises(ValueError, match="--virtual must be >= 0"):  # before any run starts
        AccuracySettings.from_args(p.parse_args(["accuracy", "--virtual", "-1"]))


@pytest.mark.parametrize("suite", ["accuracy", "ssl", "cluster"])
def test_long_suites_write_each_finished_run_before_the_next(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            suite: str) -> None:
    """A bench stopped after its first run keeps that run on disk (marked partial); the suites
    built on the accuracy runs (ssl, cluster) too."""
    import json

    from splitedge.bench import accuracy
    from splitedge.cli import main

    seen_on_disk: list[int] = []

    def fake_run(s, label, method, overrides, alpha):  # the federation is not under test here
        path = tmp_path / f"{suite}.json"
        seen_on_disk.append(len(json.loads(path.read_text())["results"]["runs"]) if path.exists() else 0)
        if len(seen_on_disk) == 2:
            raise KeyboardInterrupt  # the user stops the bench during the second run
        return {"method": label, "base_method": method, "overrides": overrides, "split": "IID", "alpha": alpha,
                "final_accuracy": 0.5, "best_accuracy": 0.5, "accuracy_per_round": [0.5], "effective_rank": None,
                "device_payload_per_device_per_round": 1.0, "total_device_payload_bytes": 1,
                "all_tiers_out_payload_bytes": 1, "train_images": 10, "images_per_device": None,
                "planted_groups": None, "per_round": [], "round_seconds": [1.0], "wall_seconds": 1.0}

    monkeypatch.setattr(accuracy, "one_run", fake_run)
    code = main(["bench", suite, "--methods", "fedavg,hsfp", "--alphas", "iid", "--out", str(tmp_path),
                 "--no-plots"])
    doc = json.loads((tmp_path / f"{suite}.json").read_text())
    assert code != 0 and seen_on_disk == [0, 1]
    assert doc["partial"] is True and [r["method"] for r in doc["results"]["runs"]] == ["fedavg"]
    assert "**partial**" in (tmp_path / f"{suite}.md").read_text()


def test_bandwidth_writes_each_method_before_the_next(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import json

    from splitedge.bench import bandwidth
    from splitedge.cli import main

    calls: list[str] = []

    def fake_row(method, summary, s):  # the federation is not under test here
        calls.append(method)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return {"method": method, "final_accuracy": 0.5, "accuracy_per_round": [0.5], "per_round": [],
                "device_up_payload_per_device_per_round": 1, "device_down_payload_per_device_per_round": 1,
                "edge_up_payload_per_edge_per_round": 1, "sys_agreement": None}

    monkeypatch.setattr(bandwidth, "run_on_mosquitto", lambda settings: {})
    monkeypatch.setattr(bandwidth, "method_row", fake_row)
    code = main(["bench", "bandwidth", "--methods", "fedavg,hsfp", "--out", str(tmp_path), "--no-plots"])
    doc = json.loads((tmp_path / "bandwidth.json").read_text())
    assert code != 0 and doc["partial"] is True and [r["method"] for r in doc["results"]["methods"]] == ["fedavg"]


def test_compare_puts_seeds_of_one_row_side_by_side(tmp_path: Path) -> None:
    """Two seed folders of an accuracy bench become one row per method and split, with each
    seed's final accuracy, own head and calibrated, their plateau status and bytes to a target."""
    def doc(seed: int, finals: list[float]) -> dict[str, Any]:
        per_round = [{"round": i + 1, "bytes": {"device": {"out_payload": 100 * (i + 1), "in_payload": 50 * (i + 1)}}}
                     for i in range(len(finals))]
        run = {"method": "fedavg", "split": "IID", "accuracy_per_round": [f - 0.1 for f in finals],
               "accuracy_calibrated_per_round": finals, "per_round": per_round, "wall_seconds": 3.0,
               "device_up_per_device_per_round": 50.0, "device_down_per_device_per_round": 25.0}
        return {"suite": "accuracy", "config": {"seed": seed, "devices": 2}, "results": {"runs": [run]}}

    for seed, finals in ((0, [0.2, 0.5, 0.6]), (1, [0.3, 0.4, 0.62])):
        (tmp_path / f"s{seed}").mkdir()
        (tmp_path / f"s{seed}" / "accuracy.json").write_text(json.dumps(doc(seed, finals)))
    out = tmp_path / "out"
    assert main(["bench", "compare", "--inputs", f"{tmp_path / 's0'},{tmp_path / 's1'}", "--out", str(out),
                 "--target", "0.55", "--no-plots"]) == 0
    row = json.loads((out / "compare.json").read_text())["results"]["rows"][0]
    assert row["seeds"] == [0, 1] and row["calibrated_final"] == [0.6, 0.62]
    assert [h["round"] for h in row["to_target"]] == [3, 3] and row["to_target"][0]["up"] == 150.0  # 300 B / 2
    assert "60.0 / 62.0 (mean 61.0)" in (out / "compare.md").read_text()


def test_compare_sizes_each_row_by_its_methods_device_ram(tmp_path: Path) -> None:
    """--ram: each row gets the device peak of its base method on its backend from `bench ram`
    runs (a column and the marker size); a row whose method was not measured says '-'."""
    def run(label: str, method: str, overrides: dict[str, str]) -> dict[str, Any]:
        return {"method": label, "base_method": method, "overrides": overrides, "split": "IID",
                "accuracy_per_round": [0.3, 0.4], "per_round": [{"round": 1}, {"round": 2}],
                "device_up_per_device_per_round": 10.0, "device_down_per_device_per_round": 10.0}

    runs = [run("fedavg", "fedavg", {"calibrate": "lda"}), run("thin", "hsfp-cal", {"backends": "onnx"}),
            run("mixed", "hsfp-cal", {"backends": "onnx+torch"}), run("proto", "fedproto", {})]
    runs[3]["accuracy_per_round"] = [0.5, 0.9]  # personalised: higher, and no target for the others
    (tmp_path / "acc").mkdir()
    (tmp_path / "acc" / "accuracy.json").write_text(json.dumps(
        {"suite": "accuracy", "config": {"seed": 0, "devices": 2}, "results": {"runs": runs}}))

    def ram_run(method: str, backend: str, mb: float) -> dict[str, Any]:
        return {"method": method, "backend": backend, "completed": True,
                "rows": [{"role": "cloud", "peak_mb": 900.0}, {"role": "device", "peak_mb": mb}]}

    (tmp_path / "ram").mkdir()
    (tmp_path / "ram" / "ram.json").write_text(json.dumps({"results": {"runs": [
        ram_run("fedavg", "torch", 430.0), ram_run("hsfp-cal", "onnx", 80.0), ram_run("hsfp-cal", "torch", 440.0)]}}))
    out = tmp_path / "out"
    assert main(["bench", "compare", "--inputs", str(tmp_path / "acc"), "--ram", str(tmp_path / "ram"),
                 "--out", str(out)]) == 0
    rows = {r["method"]: r for r in json.loads((out / "compare.json").read_text())["results"]["rows"]}
    assert {k: r["device_ram_mb"] for k, r in rows.items()} == {"fedavg": 430.0, "thin": 80.0, "mixed": 440.0,
                                                                 "proto": None}
    # FedProto's figure is each device's own model on its own data: it sets no target, reaches none
    assert rows["proto"]["personalised"] and rows["proto"]["to_target"] == [None] and rows["thin"]["to_target"][0]
    md = (out / "compare.md").read_text()
    assert "| proto (personalised) |" in md and "IID 36.0 %" in md  # 90 % of the best non-personalised 40 %
    assert "device peak RSS MB" in md and "| 430 |" in md and "| 80 |" in md and md.count("| - |") >= 1
    assert (out / "accuracy-vs-bytes.png").stat().st_size > 0
    from splitedge.bench.compare import marker_size

    assert marker_size(80.0) < marker_size(430.0)  # type: ignore[operator]
    assert main(["bench", "compare", "--inputs", str(tmp_path / "acc"), "--ram", str(tmp_path / "acc"),
                 "--out", str(out)]) == 2  # a folder without ram.json: one line, no run


@needs_mosquitto
def test_the_matrix_runs_its_cells_resumes_them_and_rerenders(tmp_path: Path) -> None:
    """`bench matrix --plan smoke`: one cell (IID, seed 0) with its bounds and FedAvg, then the
    comparison; run again, every run is kept; --rerender rewrites without running."""
    assert main(["bench", "matrix", "--plan", "smoke", "--out", str(tmp_path), "--no-plots"]) == 0
    cell = json.loads((tmp_path / "iid-s0" / "accuracy.json").read_text())
    rows = {r["method"]: r for r in cell["results"]["runs"]}
    assert set(rows) == {"upper", "lower", "fedavg"} and rows["upper"]["central"]
    assert rows["lower"]["final_accuracy"] < 0.3 < rows["lower"]["calibrated"]["final"]  # random net, calibrated head
    report = (tmp_path / "iid-s0" / "accuracy.md").read_text()
    assert main(["bench", "matrix", "--plan", "smoke", "--out", str(tmp_path), "--no-plots"]) == 0
    again = json.loads((tmp_path / "iid-s0" / "accuracy.json").read_text())
    assert [r["wall_seconds"] for r in again["results"]["runs"]] == [r["wall_seconds"] for r in cell["results"]["runs"]]
    # a cell with nothing left to run keeps its files: when it ran, how long, under what load
    assert again == cell and (tmp_path / "iid-s0" / "accuracy.md").read_text() == report
    (tmp_path / "matrix.md").unlink()
    assert main(["bench", "matrix", "--plan", "smoke", "--out", str(tmp_path), "--rerender", "--no-plots"]) == 0
    assert "| fedavg | IID |" in (tmp_path / "matrix.md").read_text()


def test_a_bench_keeps_only_what_its_reports_read_of_each_round() -> None:
    """A 150-round bench's JSON held every round's spectrum and per-device costs: 5.7 MB. Only the
    newest spectrum stays, and the per-device costs are summed onto the row."""
    from splitedge.bench.accuracy import refresh

    rounds = [{"round": i, "accuracy": 0.1 * i, "spectrum": [1.0, 0.5], "bytes": {"device": {}},
               "device_costs": {"d0": {"cpu_s": 1.0, "bytes_up": 10, "bytes_down": 5, "rss_peak_mb": 50.0 + i}}}
              for i in (1, 2, 3)]
    rounds[2].pop("spectrum")  # the last round measured none: round 2's is the final representation
    results = {"runs": [{"method": "fedavg", "split": "IID", "accuracy_per_round": [0.1, 0.2, 0.3],
                         "per_round": rounds}]}
    refresh(results, {"devices": 1})
    row = results["runs"][0]
    assert ["spectrum" in r for r in row["per_round"]] == [False, True, False]
    assert not any("device_costs" in r for r in row["per_round"])
    assert row["device_costs"] == {"d0": {"cpu_s": 3.0, "bytes_up": 30, "bytes_down": 15, "rss_peak_mb": 53.0,
                                          "rounds": 3}}


@needs_mosquitto
def test_a_run_that_evaluated_no_round_is_an_error_row_not_a_result() -> None:
    """A fedproto run whose edges failed every round used to be kept with accuracy nan after its
    whole budget; now it is an error row, which --resume runs again."""
    import ring_method  # noqa: F401 - registers "ring-test", a method that reports no accuracy
    from splitedge.bench.accuracy import AccuracySettings, guarded_run

    s = AccuracySettings(devices=2, edges=1, rounds=1, max_train=40, max_test=20)
    row = guarded_run(s, "ring", "ring-test", {}, None)
    assert "no round of 1 was evaluated" in row["error"], row


@pytest.mark.parametrize("plan", sorted(MATRIX_PLANS))
def test_every_variant_of_a_matrix_plan_is_a_valid_run(plan: str) -> None:
    """A typo in a plan's settings would surface hours into a matrix: each variant's method and
    settings build a run config now."""
    from splitedge.bench.matrix import PLANS
    from splitedge.bench.lib.simrun import SIM_KEYS, parse_variant
    from splitedge.cloud.options import build_run_config
    from splitedge.methods.data.datasets import load_dataset

    from splitedge.methods.data.datasets import DatasetInfo

    common = PLANS[plan].common
    model = common[common.index("--model") + 1] if "--model" in common else None
    info = load_dataset("digits", max_train=10, max_test=10)[2]
    if "cifar10" in common:  # the plan's images (a head layer's pooling must fit its maps), not loaded
        info = DatasetInfo("cifar10", 10, 3, 32, (0.5,) * 3, (0.25,) * 3, tuple(map(str, range(10))))
    for text in PLANS[plan].variants:
        _, method, overrides = parse_variant(text)
        for key in set(overrides) & set(SIM_KEYS):  # the run's settings (backends=onnx), not the method's
            SIM_KEYS[key](overrides.pop(key))
        if method != "central":
            build_run_config(method, info, model, 0, overrides)


def test_bench_cluster_reports_the_global_model_on_the_groups_where_devices_hold_it() -> None:
    """The two-way hierarchy's devices score the global model on their groups' held-out data; the
    global-model row's devices train nothing else; a one-way CFLHKD row has no such figure."""
    from splitedge.bench import cluster

    def row(method: str, overrides: dict, last: dict) -> dict:
        return {"method": method, "split": "IID", "overrides": overrides, "final_accuracy": 0.8,
                "device_payload_per_device_per_round": 1.0, "planted_groups": {"d0": 0, "d1": 1},
                "per_round": [{"personalised_accuracy": 0.5}, {"personalised_accuracy": 0.7, **last}]}

    results = {"runs": [row("cflhkd", {}, {}), row("global-model", {"clustering": "false", "kd": "false"}, {}),
                        row("two-way", {"global_teacher": "model"}, {"global_personal_accuracy": 0.6})]}
    cluster.refresh(results)
    assert [r["global_on_groups_final"] for r in results["runs"]] == [None, 0.7, 0.6]
    text = cluster.markdown(results)
    assert "| global model on groups (final) |" in text and "| two-way | IID | 2 | no / - | 0.7 | 0.7 | 0.6 | 0.8 |" in text


def test_feddecorr_units_effective_rank_counts_the_directions_features_spread_over() -> None:
    import torch

    from splitedge.bench.feddecorr_units import effective_rank

    g = torch.Generator().manual_seed(0)
    spread = torch.randn(4000, 8, generator=g, dtype=torch.float64)
    assert 7.5 < effective_rank(spread) <= 8.0
    collapsed = torch.randn(4000, 1, generator=g, dtype=torch.float64) @ torch.randn(1, 8, generator=g, dtype=torch.float64)
    assert effective_rank(collapsed) < 1.01


def test_scale_passes_client_sampling_as_the_sims_flags() -> None:
    from splitedge.bench.scale import sim_arguments

    assert sim_arguments(["sample_fraction=0.1", "local_epochs=0", "sample_min=5"]) == [
        "--sample-fraction", "0.1", "--set", "local_epochs=0", "--sample-min", "5"]
