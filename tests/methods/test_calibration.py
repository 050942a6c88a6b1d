"""Head calibration for any labelled method (methods/calibration), through real brokers: the
calibration phase after a round, its schedule, the head it serves (equal to the one fitted
centrally on every training image), self-supervised methods' federated probe, SplitFed's
devices that hold W_c only, virtual devices, and the methods that refuse it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from splitedge.methods.calibration.lda import lda_classifier
from splitedge.methods.calibration.stats import HeadStatsAccumulator
from splitedge.sim import SimSettings, run_sim

from splitedge.bench.lib.rogues import RogueDevice

ROUNDS = 3


def _sim(tmp: Path, method: str = "fedavg", **kw) -> tuple[dict, list[dict]]:
    torch.set_num_threads(1)
    # every image counts (min_class_count 1): these runs check the head fitted on all of them
    overrides = {"calibrate": "lda", "min_class_count": 1, **kw.pop("overrides", {})}
    s = SimSettings(rounds=kw.pop("rounds", ROUNDS), devices=4, edges=2, method=method, out=tmp, max_train=600,
                    max_test=300, alpha=0.5, overrides=overrides, **kw)
    summary = run_sim(s)
    return summary, [json.loads(line) for line in (tmp / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def fedavg(tmp_path_factory) -> tuple[dict, list[dict], Path]:
    out = tmp_path_factory.mktemp("fedavg")
    summary, rounds = _sim(out, overrides={"calib_dtype": "f8"})
    return summary, rounds, out


def test_every_round_reports_its_own_head_and_the_calibrated_one(fedavg) -> None:
    summary, rounds, _ = fedavg
    assert [r["calibrated"] for r in rounds] == [600] * ROUNDS  # every training image, every round
    assert all(r["calibrated_edges"] == 2 for r in rounds)
    # the phase calibrates the model the round just merged: the version devices train from next
    assert [r["calibration_versions"]["model"] for r in rounds] == [r["model_version"] for r in rounds]
    assert all(0.5 < r["accuracy_calibrated"] <= 1 and 0 < r["accuracy"] <= 1 for r in rounds), rounds
    assert summary["accuracy_calibrated_per_round"] == [r["accuracy_calibrated"] for r in rounds]
    assert summary["final_accuracy_calibrated"] == rounds[-1]["accuracy_calibrated"]


def test_the_served_head_is_the_one_fitted_on_all_training_images(fedavg) -> None:
    """The edges' and the cloud's merges are exact: the served classifier equals the LDA head
    fitted centrally on the served model's features of every training image."""
    from safetensors.numpy import load_file

    from splitedge.methods.data.datasets import load_dataset
    from splitedge.methods.data.preprocess import to_input
    from splitedge.methods.torch_utils import build_split
    from splitedge.models import load_numpy_state

    summary, _, out = fedavg
    served = load_file(str(out / "model.safetensors"))
    spec_wire = summary["config"]["model"]
    from splitedge.methods.config import ModelSpec, from_wire

    spec = from_wire(ModelSpec, spec_wire)
    model = build_split(spec).eval()
    load_numpy_state(model, served)
    (x, y), _, _ = load_dataset("digits", None, max_train=600, max_test=300, seed=0)
    with torch.no_grad():
        feats = model.features_and_logits(torch.from_numpy(to_input(x, spec.mean, spec.std)))[0].numpy()
    acc = HeadStatsAccumulator(feats.shape[1])
    acc.add(feats, y)
    weight, bias = lda_classifier(acc.result(), spec.num_classes, shrink=0.1)
    np.testing.assert_allclose(served["wg.fc.weight"], weight.astype(np.float32), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(served["wg.fc.bias"], bias.astype(np.float32), rtol=1e-4, atol=1e-3)


def test_a_head_lacking_classes_is_scored_not_served_and_said_once(tmp_path, caplog) -> None:
    """Devices that hold fewer than min_class_count images of most classes withhold them: the
    head fitted on the rest can never predict those classes, so the model keeps its own head."""
    from safetensors.numpy import load_file

    with caplog.at_level("WARNING", logger="splitedge.cloud.coordinator"):
        _, rounds = _sim(tmp_path, rounds=2, overrides={"min_class_count": 40})
    assert all(0 < r["calibrated_classes"] < 10 and r["calibration_withheld"]["samples"] > 0 for r in rounds), rounds
    assert all(r["accuracy_calibrated"] is not None for r in rounds)  # still measured
    served = load_file(str(tmp_path / "model.safetensors"))
    assert served["wg.fc.bias"].min() > -100  # not the fitted head (its absent classes' bias is -1e4)
    said = [r.getMessage() for r in caplog.records if "calibrated head has" in r.getMessage()]
    assert len(said) == 1 and f"has {rounds[0]['calibrated_classes']} of 10 classes" in said[0], said
    assert "min_class_count=40" in said[0]
    caplog.clear()
    with caplog.at_level("WARNING", logger="splitedge.cloud.coordinator"):  # every image under the floor
        _, rounds = _sim(tmp_path / "none", rounds=2, overrides={"min_class_count": 10_000})
    assert all(r["calibrated_edges"] == 0 and r["calibration_withheld"]["samples"] == 600 for r in rounds), rounds
    said = [r.getMessage() for r in caplog.records if "head statistics" in r.getMessage()]
    assert len(said) == 1 and "withheld 600 of their images" in said[0] and "min_class_count=10000" in said[0], said


def test_calibration_every_second_round_and_at_the_end(tmp_path) -> None:
    _, rounds = _sim(tmp_path, overrides={"calibrate_every": 2})
    assert [r.get("accuracy_calibrated") is not None for r in rounds] == [False, True, True]
    _, rounds = _sim(tmp_path / "end", overrides={"calibrate_every": 0})
    assert [r.get("accuracy_calibrated") is not None for r in rounds] == [False, False, True]
    assert [r["accuracy"] for r in rounds] == [r["accuracy"] for r in _sim(tmp_path / "off", overrides={
        "calibrate": "none"})[1]]  # calibrating changes nothing the devices train


def test_splitfed_devices_get_the_layers_above_w_c_and_calibrate(tmp_path, fedavg) -> None:
    # SFLv1 with per-device server copies is FedAvg step for step: the same calibrated heads
    _, rounds = _sim(tmp_path, method="splitfed", overrides={"calib_dtype": "f8"})
    assert [r["calibrated"] for r in rounds] == [600] * ROUNDS
    assert [r["calibration_versions"]["calib"] for r in rounds] == [0, 1, 2]  # W_e changes every round
    assert [r["accuracy_calibrated"] for r in rounds] == [r["accuracy_calibrated"] for r in fedavg[1]]


def test_a_self_supervised_method_gets_the_federated_probe(tmp_path) -> None:
    summary, rounds = _sim(tmp_path, method="simsiam", rounds=2, overrides={"report_every": 2})
    assert [r["calibrated"] for r in rounds] == [600, 600]
    assert all(r["accuracy_calibrated"] > 0.5 for r in rounds), rounds  # chance is 0.1
    assert "probe_accuracy" in rounds[-1]  # the central probe stays beside it


def test_virtual_devices_calibrate_the_same(tmp_path, fedavg) -> None:
    _, rounds = _sim(tmp_path, virtual=1, overrides={"calib_dtype": "f8"})
    assert [r["accuracy_calibrated"] for r in rounds] == [r["accuracy_calibrated"] for r in fedavg[1]]


def test_decmar_refuses_calibration_before_round_one(tmp_path) -> None:
    with pytest.raises(ValueError, match="cannot calibrate its head"):
        _sim(tmp_path, method="decmar", rounds=1)


def test_fedproto_devices_score_the_federation_s_head_on_their_held_out_share(tmp_path) -> None:
    """No global model: the head fitted on every device's training share goes back to every
    device, which scores it with its own model on its held-out 20 % (an evaluation phase)."""
    summary, rounds = _sim(tmp_path, method="fedproto", rounds=2)
    held_out = [r["eval_samples"] for r in rounds]
    assert all(r["calibrated"] + n == 600 for r, n in zip(rounds, held_out))  # statistics of the training shares
    assert all(0.5 < r["accuracy_calibrated"] <= 1 for r in rounds)
    assert [r["accuracy_calibrated"] for r in rounds] == [r["personalised_accuracy_calibrated"] for r in rounds]
    assert summary["final_accuracy_calibrated"] == rounds[-1]["accuracy_calibrated"]


def test_cflhkd_clusters_score_their_own_heads(tmp_path) -> None:
    """After clustering each edge holds one cluster: a head per edge, sent to each of its
    devices, scored on their held-out shares; each cluster's score is reported."""
    _, rounds = _sim(tmp_path, method="cflhkd", rounds=3, groups=2, group_skew="labels")
    assert [r["phase"] for r in rounds] == ["warmup", "clustered", "clustered"]
    last = rounds[-1]
    assert last["calibrated_heads"] == 2 and set(last["cluster_accuracy_calibrated"]) == {"e0", "e1"}
    assert all(0.3 < a <= 1 for a in last["cluster_accuracy_calibrated"].values()), last
    assert last["personalised_accuracy_calibrated"] > last["personalised_accuracy"] - 0.3


class ScaledCalibrator(RogueDevice):
    """Device d9 of edge e0, announcing 150 samples: in every calibration phase a well-formed
    record within every bound (its counts, dtype, dimension, finite values) whose class means are
    50 and covariance 1000 x the identity, far from any honest device's; `done` in every phase."""

    def __init__(self, url: str, run: str) -> None:
        super().__init__(url, run, samples=150)

    def on_round(self, env) -> None:
        from splitedge.methods.calibration.stats import HeadStats, head_stats_arrays

        if env.body.get("phase") == "calibrate":
            dim = env.body["directives"]["calibrate"]["layers"]["classifier"]
            s = HeadStats(np.arange(10), np.full(10, 15), np.full((10, dim), 50.0), 1e3 * np.eye(dim))
            self.say("arrays", {"name": "head_stats", "version": env.round, "arrays": head_stats_arrays(s, "f4")},
                     env.round)
        self.say("done", {"phase": "calibrate" if env.body.get("phase") == "calibrate" else "round", "info": {}},
                 env.round)


def test_the_robust_rules_hold_the_calibrated_head_against_a_scaled_device(mosquitto, tmp_path) -> None:
    def run(name: str, robust: str, rogue: bool) -> list[float]:
        s = SimSettings(rounds=2, devices=4, edges=2, method="fedavg", out=tmp_path / name, max_train=600,
                        max_test=300, broker=mosquitto.url, run=f"cal-{name}", deadline_s=60.0,
                        overrides={"calibrate": "lda", "robust": robust, "min_class_count": 1})
        attacker = ScaledCalibrator(mosquitto.url, f"cal-{name}") if rogue else None
        try:
            return run_sim(s)["accuracy_calibrated_per_round"]
        finally:
            if attacker is not None:
                attacker.close()

    torch.set_num_threads(1)
    clean = run("clean", "none", rogue=False)
    exact = run("exact", "none", rogue=True)
    median = run("median", "median", rogue=True)
    clip = run("clip", "clip", rogue=True)
    assert exact[-1] < clean[-1] - 0.2, (exact, clean)  # the attack works on the exact merge
    assert median[-1] > clean[-1] - 0.03 and clip[-1] > clean[-1] - 0.03, (median, clip, clean)


def test_a_head_lacking_classes_because_an_edge_is_down_says_so_first(caplog) -> None:
    """With an edge down its devices' classes are missing from the calibration: the line names
    the silent edge, not the devices' minimum count (issue 56, 'Messages that mislead')."""
    from types import SimpleNamespace

    from splitedge.cloud.calibration_phase import CloudCalibration

    driver = SimpleNamespace(method=SimpleNamespace(spec=SimpleNamespace(num_classes=10),
                                                    config=SimpleNamespace(min_class_count=10)))
    with caplog.at_level("WARNING", logger="splitedge.cloud.calibration_phase"):
        CloudCalibration(driver).warn_partial_head({"calibrated_classes": 6}, ["e1"])
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "edge e1 sent no head statistics" in said[0], said
    assert "min_class_count" not in said[0] and "Check the silent edges" in said[0], said


def test_hsfp_cal_calibrates_again_only_when_its_inputs_change(tmp_path) -> None:
    """hsfp-cal's head statistics follow from W_c, W_e and the trunk the phase names and from
    the devices: while none changed (W_c is averaged every ic rounds) the head stands and no
    phase runs, so no device recomputes or resends the same statistics (issue 58, item 5); the
    round W_c is averaged calibrates again."""
    _, rounds = _sim(tmp_path, method="hsfp-cal", rounds=3, overrides={"ic": 3})
    assert [r.get("calibration_reused", False) for r in rounds] == [False, True, False], rounds
    assert rounds[1]["accuracy_calibrated"] == rounds[0]["accuracy_calibrated"]
    assert rounds[2]["calibration_versions"]["wc"] > rounds[1]["calibration_versions"]["wc"]
    head_stats = [r["bytes"]["in"]["arrays"]["messages"] for r in rounds]  # cumulative at the cloud
    assert head_stats[1] == head_stats[0] and head_stats[2] > head_stats[1], head_stats
