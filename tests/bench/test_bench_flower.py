"""`splitedge bench flower` without Flower: its settings parse, both arms take their config, split
and training from one place (the sim's own command line builds the plan's config, and the Flower
side's trainer reads the plan), and a missing Flower venv is one line naming the command that
makes it, before any arm runs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from splitedge.bench import flower
from splitedge.bench.flower_side import common
from splitedge.cli import build_parser, main


def settings(*extra: str) -> flower.FlowerSettings:
    return flower.FlowerSettings.from_args(build_parser().parse_args(["bench", "flower", *extra]))


def test_quick_settings_are_digits_with_fedcnn_and_the_shared_fedavg_settings() -> None:
    s = settings("--quick", "--set", "local_epochs=2", "--flower-venv", "/x/venv")

    assert (s.dataset, s.model, s.devices, s.rounds, s.alpha, s.edges) == ("digits", "fedcnn", 4, 3, 0.3, 1)
    assert s.overrides == {"device_lr": "0.01", "robust": "none", "local_epochs": "2"}
    assert s.arms == ("floor", "splitedge", "flower") and s.flower_venv == "/x/venv"
    full = settings("--dataset", "cifar10", "--data", "/d/cifar.tar.gz")
    assert (full.dataset, full.devices, full.rounds, full.alpha, full.seed) == ("cifar10", 10, 5, 0.3, 0)
    with pytest.raises(ValueError, match="--arms"):
        settings("--arms", "floor,ray")


def test_the_sim_command_builds_the_config_and_split_the_flower_side_reads() -> None:
    from splitedge.cloud.options import build_run_config
    from splitedge.methods.data.datasets import load_dataset
    from splitedge.methods.flags import method_overrides
    from splitedge.sim.federation import SimSettings, partition

    s = settings("--quick", "--set", "momentum=0.5")
    planned = flower.plan(s)
    argv = flower.sim_command(s, "mqtt://127.0.0.1:1", Path("out"))
    assert argv[:3] == [sys.executable, "-m", "splitedge"]
    args = build_parser().parse_args(argv[3:])
    train, _, info = load_dataset(args.dataset, args.data, max_train=args.max_train, max_test=args.max_test,
                                  seed=args.seed)
    sim_config = build_run_config(args.method, info, args.model, args.seed, method_overrides(args))

    assert json.loads(json.dumps(sim_config.to_wire())) == planned["config"]
    plan = common.Plan.from_wire(planned)
    trainer = common.LocalTrainer(plan, 0, (train[0][:40], train[1][:40]))
    cfg = plan.config.method
    assert (cfg.device_lr, cfg.momentum, cfg.weight_decay, cfg.device_batch, cfg.local_epochs) == (0.01, 0.5, 5e-4, 32, 1)
    assert trainer.cfg == sim_config.method and plan.config.model == sim_config.model
    sim = SimSettings(devices=args.devices, alpha=args.alpha, seed=args.seed, split=args.split, dataset=args.dataset)
    assert all(np.array_equal(a, b) for a, b in zip(partition(train[1], sim), common.shards(plan, train[1])))
    # the summary of a sim that ran the plan passes the check; one with another learning rate does not
    summary = {"config": {"model": planned["config"]["model"], "settings": planned["config"]["method"]}}
    flower.check_same_config(summary, planned)
    summary["config"]["settings"] = {**planned["config"]["method"], "device_lr": 0.05}
    with pytest.raises(RuntimeError, match="device_lr"):
        flower.check_same_config(summary, planned)


def test_settings_the_flower_side_does_not_implement_are_refused() -> None:
    with pytest.raises(ValueError, match="dp_sigma"):
        flower.plan(settings("--quick", "--set", "dp_sigma=1.0", "--set", "dp_update_clip=1.0"))


def test_a_missing_flower_venv_is_one_line_with_its_command(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    venv = tmp_path / "no-venv"

    code = main(["bench", "flower", "--quick", "--flower-venv", str(venv), "--out", str(tmp_path / "out")])

    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert f"python3 -m venv {venv} && {venv}/bin/pip install flwr==1.42.0 torch==2.14.1" in err
    assert "--no-deps -e" in err and "--setup" in err
    assert not (tmp_path / "out" / "flower.json").exists()  # refused before any arm ran


def test_the_report_reads_a_run_without_flower() -> None:
    row = {"arm": "floor", "processes": 1, "exit_codes": [0], "rounds_done": 2, "accuracy_per_round": [0.5, 0.6],
           "final_accuracy": 0.6, "peak_rss_mb": {"server": 500.0, "client_max": 0, "client_median": None,
                                                  "broker": None},
           "cpu_s_per_round": {"all": 2.0, "server": 2.0}, "wall_s_per_round": 2.5}
    other = {**row, "arm": "splitedge", "cpu_s_per_round": {"all": 3.0, "server": 1.0, "clients": 2.0},
             "bytes": {"up": 10.0, "down": 12.0, "source": "MQTT"}, "model_payload": {"up": 9.0, "down": 9.0}}

    md = flower.markdown({"rows": [row, other]})

    assert "| splitedge | 1 | 3 | 1.50x |" in md and "| floor | 1 | 2 | 1.00x |" in md and "MQTT" in md
