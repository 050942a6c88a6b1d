"""`splitedge sim` end to end on the embedded broker, and the CLI surface."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from splitedge.cli import build_parser, main
from splitedge.sim import SimSettings, run_sim

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def sim_run(tmp_path_factory) -> tuple[dict, Path]:
    out = tmp_path_factory.mktemp("sim")
    summary = run_sim(SimSettings(rounds=3, devices=4, edges=2, out=out, overrides={"ic": 2, "ie": 2}))
    return summary, out


def test_sim_writes_metrics_summary_plot_and_checkpoint(sim_run) -> None:
    summary, out = sim_run
    for key in ("final_accuracy", "accuracy_per_round", "bytes", "round_seconds", "config"):
        assert key in summary, key
    assert len(summary["accuracy_per_round"]) == 3 and len(summary["round_seconds"]) == 3
    assert json.loads((out / "summary.json").read_text())["final_accuracy"] == summary["final_accuracy"]
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 3
    assert (out / "plot.png").stat().st_size > 1000 and (out / "model.safetensors").exists()


def test_sim_learns_better_than_chance(sim_run) -> None:
    summary, _ = sim_run
    assert summary["final_accuracy"] > 3 * summary["chance"], summary["accuracy_per_round"]


def test_sim_bytes_by_tier_are_consistent(sim_run) -> None:
    summary, _ = sim_run
    b = summary["bytes"]
    for tier in ("device", "edge", "cloud"):
        assert b[tier]["out_payload"] > 0 and b[tier]["in_payload"] > 0, tier
        assert b[tier]["out_packet"] > b[tier]["out_payload"], tier
    # moments only ever travel up: devices' (all) + edges' (to the cloud) are a lower bound of what came in
    assert summary["device_up_bytes_per_device_per_round"] > 0
    # each edge's own load: it hears its 2 devices and the cloud and relays every round down,
    # so it sends and receives at least a message per round each way, and the edges' sum is
    # the tier's messages
    per_edge = summary["edge_messages"]
    assert set(per_edge) == {"e0", "e1"} and all(m["out"] >= 3 and m["in"] >= 3 for m in per_edge.values())


def test_ablation_flags_reach_the_method_config(tmp_path: Path) -> None:
    args = build_parser().parse_args(["sim", "--mean-only", "--no-slow-averaging", "--resend-moments",
                                      "every-round", "--feature-dtype", "f2", "--set", "edge_samples=512"])
    from splitedge.methods.flags import method_overrides

    assert method_overrides(args) == {"mean_only": True, "slow_averaging": False,
                                      "resend_moments": "every-round", "feature_dtype": "f2", "edge_samples": "512"}


def test_unknown_method_setting_is_a_clear_error(tmp_path: Path, capsys) -> None:
    code = main(["sim", "--rounds", "1", "--out", str(tmp_path), "--set", "no_such_setting=1"])
    assert code == 2 and "hsfp settings: unknown setting(s) ['no_such_setting']" in capsys.readouterr().err


def test_mean_only_sim_runs(tmp_path: Path) -> None:
    summary = run_sim(SimSettings(rounds=2, devices=2, edges=1, out=tmp_path,
                                  overrides={"mean_only": True, "slow_averaging": False}))
    assert summary["config"]["settings"]["mean_only"] is True and summary["final_accuracy"] > summary["chance"]


@pytest.mark.parametrize("argv", [["--help"], ["device", "--help"], ["edge", "--help"], ["cloud", "--help"]])
def test_help_works_without_importing_torch(argv: list[str]) -> None:
    code = ("import sys; from splitedge.cli import main\n"
            f"try:\n    main({argv!r})\nexcept SystemExit as e:\n    assert e.code == 0\n"
            "print('TORCH' if 'torch' in sys.modules else 'CLEAN')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("CLEAN")


def test_restarted_cloud_with_the_same_run_id_ignores_the_old_incarnation(tmp_path: Path, mosquitto) -> None:
    # Prepare: a first run leaves retained models at W_c version 2 on the broker
    first = SimSettings(rounds=2, devices=2, edges=1, run="reused", broker=mosquitto.url, out=tmp_path / "a",
                        overrides={"ic": 1, "ie": 1})
    run_sim(first)
    # Execute: a new cloud and new nodes, same run id, same broker
    second = run_sim(SimSettings(rounds=2, devices=2, edges=1, run="reused", broker=mosquitto.url,
                                 out=tmp_path / "b", overrides={"ic": 1, "ie": 1}))
    # Assert: the new incarnation trained on its own moments (old versions would leave accuracy NaN)
    assert second["accuracy_per_round"][0] > 3 * second["chance"], second["accuracy_per_round"]


def test_the_named_subcommand_is_found_after_global_flags_only() -> None:
    from splitedge.cli import _chosen_command

    assert _chosen_command(["-vv", "device", "--id", "sim"]) == "device"
    assert _chosen_command(["--verbose", "bench", "ram"]) == "bench"
    assert _chosen_command(["--help"]) is None and _chosen_command([]) is None
    assert build_parser("edge").parse_args(["edge", "--broker", "mqtt://h", "--id", "e1"]).id == "e1"


def test_sim_settings_refuse_more_nodes_than_one_process_can_connect() -> None:
    """The limit is per process: workers each hold their share of the devices."""
    from splitedge.sim import MAX_SIM_NODES, SimSettings

    SimSettings(devices=MAX_SIM_NODES - 11, edges=10)
    with pytest.raises(ValueError, match=f"would run {MAX_SIM_NODES + 11} nodes.*--workers 2 or more"):
        SimSettings(devices=MAX_SIM_NODES, edges=10)
    SimSettings(devices=10_000, edges=100, workers=4, split="per-device")  # 2,500 a worker, 101 here
    SimSettings(devices=10_000, edges=100, worker="3/4", broker="mqtt://h", run="r")
    with pytest.raises(ValueError, match="would run 5000 nodes"):  # a remote worker's share is its own
        SimSettings(devices=10_000, edges=100, worker="1/2", broker="mqtt://h", run="r")
    with pytest.raises(ValueError, match="would run 3101 nodes.*and fewer edges"):
        SimSettings(devices=4000, edges=3100, workers=2)
    with pytest.raises(ValueError, match="at least one device"):
        SimSettings(devices=0, edges=1)


def test_sim_with_the_synthetic_feature_flags(tmp_path: Path) -> None:
    """H-SFP's issue-12 sampling flags over the embedded broker: edges train W_e on the
    federation's W_c moments from the second round of each W_c version (ic = 2: rounds 2 and 4)."""
    flags = {"ic": 2, "ie": 2, "edge_features": "global", "mixture": True, "class_balanced": True}
    summary = run_sim(SimSettings(rounds=4, devices=4, edges=2, out=tmp_path, overrides=flags))
    rounds = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["edges_global"] for r in rounds] == [0, 2, 0, 2]
    assert summary["final_accuracy"] > 3 * summary["chance"], summary["accuracy_per_round"]


def test_sim_pre_relu_with_thin_and_torch_devices(tmp_path: Path) -> None:
    """pre_relu on hsfp-cal over the embedded broker: thin devices take moments with a W_c graph
    that stops before the final ReLU and calibrate with it applied; a split that cannot do it
    (resnet18) is refused in one line before any node starts."""
    summary = run_sim(SimSettings(rounds=3, devices=4, edges=2, out=tmp_path, method="hsfp-cal",
                                  backends=("torch", "onnx"), overrides={"pre_relu": True}))
    rounds = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all(r["calibrated"] > 0 for r in rounds)
    assert summary["final_accuracy"] > 3 * summary["chance"], summary["accuracy_per_round"]
    with pytest.raises(ValueError, match="pre_relu needs W_c and W_e ending in a ReLU module"):
        run_sim(SimSettings(rounds=1, devices=2, edges=1, out=tmp_path / "r", model="resnet18",
                            overrides={"pre_relu": True}))


def test_join_timeout_grows_with_the_devices_and_is_checked() -> None:
    """Thousands of devices in worker processes need more than a minute to join; a user's
    value is taken as given, and a non-positive one refused in one line."""
    assert SimSettings(devices=4).join_timeout == pytest.approx(60.4)
    assert SimSettings(devices=3000, edges=60, virtual=1, workers=2).join_timeout == pytest.approx(360.0)
    assert SimSettings(join_timeout_s=5.0).join_timeout == 5.0
    with pytest.raises(ValueError, match="--join-timeout must be > 0"):
        SimSettings(join_timeout_s=0.0)
    args = build_parser().parse_args(["sim", "--join-timeout", "900"])
    assert args.join_timeout == 900.0
