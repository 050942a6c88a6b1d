"""Differentially private releases on the devices (methods/privacy/release.py): with `dp_sigma`
> 0 every statistic and weight update a device of fedavg, H-SFP, FedProto or CFLHKD sends is
clipped and noised,
each release is counted, and the cloud reports the epsilon they spend; a method without a
private form, or a clip left unset, is refused before round 1."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from splitedge.methods.config import ModelSpec
from splitedge.methods.contract import NodeContext
from splitedge.methods.moments import compute_moments
from splitedge.methods.privacy.accountant import epsilon
from splitedge.methods.privacy.release import capped_counts, fit_to_hello, private_weights
from splitedge.methods.registry import create_method, default_config
from splitedge.sim import SimSettings, run_sim

CLIPS = {"dp_clip": 20.0, "dp_head_clip": 1.0, "dp_update_clip": 20.0}


def _sim(url: str, run: str, out: Path, method: str, sigma: float, rounds: int = 3, **extra) -> list[dict]:
    torch.set_num_threads(1)
    overrides = {"dp_sigma": sigma, **CLIPS, **extra} if sigma else dict(extra)
    s = SimSettings(rounds=rounds, devices=4, edges=2, broker=url, run=run, out=out, method=method,
                    backends=("torch", "onnx") if method.startswith("hsfp") else ("torch",),
                    max_train=800, max_test=300, deadline_s=60.0, overrides=overrides)
    run_sim(s)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_releases_keep_to_what_the_hello_said() -> None:
    labels = np.array([0, 0, 0, 2, 2, 5])
    classes, counts = np.array([0, 1, 2, 5, 7]), np.array([3, 4, 1, 2, 9])
    # class 1 and 7 are not held (noise let them through): never sent; the floor sees noisy counts
    assert fit_to_hello(classes, counts, labels, 1).tolist() == [True, False, True, True, False]
    assert fit_to_hello(classes, counts, labels, 2).tolist() == [True, False, False, True, False]
    capped = capped_counts(np.array([5, 1, 3]), 6)
    assert capped.sum() <= 6 and (capped >= 1).all()
    assert capped_counts(np.array([2, 3]), 6).tolist() == [2, 3]


def test_a_private_update_is_clipped_noised_and_counted() -> None:
    m = create_method("fedavg", default_config("fedavg", ModelSpec(), dp_sigma=0.5, dp_update_clip=1.0))
    part = m.device_part(NodeContext("d0", m, np.random.default_rng(0)),
                         (np.zeros((4, 8, 8, 1), np.uint8), np.arange(4)), "torch")
    start = {"w": np.zeros(1000, np.float32), "n": np.array(3, np.int64), "bn.running_var": np.ones(4, np.float32)}
    trained = {"w": np.full(1000, 10.0, np.float32), "n": np.array(9, np.int64),
               "bn.running_var": np.full(4, 7.0, np.float32)}
    a, b = private_weights(part, trained, start), private_weights(part, trained, start)
    assert part.dp_releases == 2 and a["n"] == 3  # a count of batches is the start's
    assert (a["bn.running_var"] == 1).all()  # the device's feature statistics are not sent at all
    assert not np.array_equal(a["w"], b["w"])  # fresh noise each release, from the OS
    # the update (norm 316) is clipped to 1: the mean shift is 1/sqrt(1000) per coordinate, the
    # noise sd 2 * 0.5 * 1 = 1
    assert abs(float(a["w"].mean()) - 1 / np.sqrt(1000)) < 0.15 and 0.8 < float(a["w"].std()) < 1.2


@pytest.mark.parametrize("method, settings, message", [
    ("scaffold", {"dp_sigma": 1.0, "dp_update_clip": 1.0}, "no differentially private form"),
    ("splitfed", {"dp_sigma": 1.0, "dp_update_clip": 1.0}, "no differentially private form"),
    ("fedproto", {"dp_sigma": 1.0}, "dp_clip > 0"),
    ("cflhkd", {"dp_sigma": 1.0, "dp_clip": 1.0}, "dp_update_clip > 0"),
    ("fedavg", {"dp_sigma": 1.0}, "dp_update_clip > 0"),
    ("hsfp", {"dp_sigma": 1.0, "dp_update_clip": 1.0}, "dp_clip > 0"),
    ("hsfp-cal", {"dp_sigma": 1.0, "dp_clip": 1.0, "dp_update_clip": 1.0}, "dp_head_clip > 0"),
])
def test_a_run_dp_cannot_cover_is_refused_before_round_1(method: str, settings: dict, message: str) -> None:
    from splitedge.cloud.options import build_run_config
    from splitedge.methods.data.datasets import load_dataset

    info = load_dataset("digits", max_train=10, max_test=10)[2]
    with pytest.raises(ValueError, match=message):
        build_run_config(method, info, None, 0, settings)


def test_a_private_federation_counts_its_releases_and_reports_epsilon(mosquitto, tmp_path) -> None:
    # hsfp-cal with torch and thin devices: moments (every ic = 2 rounds), W_c updates on the
    # averaging rounds and head statistics in every calibration phase, each one release
    records = _sim(mosquitto.url, "dp-hsfp", tmp_path / "hsfp", "hsfp-cal", 1.0, rounds=4, ic=2)
    totals = [r["dp_releases_total"] for r in records]
    assert totals == sorted(totals) and totals[0] >= 2, totals  # round 1: moments and head statistics
    assert all(r.get("calibration_dp_releases") == 1 for r in records), records
    for r in records:
        assert r["dp_epsilon"] == pytest.approx(epsilon(1.0, r["dp_releases_total"], 1e-5))
        assert not any(r["rejected"].get(edge) for edge in ("e0", "e1")), r["rejected"]  # fitted to the hellos
    assert records[-1]["dp_epsilon"] > records[0]["dp_epsilon"]


@pytest.mark.parametrize("method, per_round", [("fedproto", 1), ("cflhkd", 2)])
def test_fedproto_and_cflhkd_release_privately(mosquitto, tmp_path, method: str, per_round: int) -> None:
    # FedProto: its prototypes, one release a round; CFLHKD: its mean logits and its model update
    # (the clustering signal is computed from the noised update, so it costs nothing more)
    records = _sim(mosquitto.url, f"dp-{method}", tmp_path / method, method, 1.0)
    assert [r["dp_releases_total"] for r in records] == [per_round * r["round"] for r in records], records
    for r in records:
        assert r["dp_epsilon"] == pytest.approx(epsilon(1.0, r["dp_releases_total"], 1e-5))
        assert not any(r["rejected"].get(edge) for edge in ("e0", "e1")), r["rejected"]  # fitted to the hellos
    assert np.isfinite(records[-1]["accuracy"])


def test_negligible_noise_changes_little_and_moments_stay_exact_in_their_counts(mosquitto, tmp_path) -> None:
    clean = _sim(mosquitto.url, "dp-clean", tmp_path / "clean", "hsfp-cal", 0.0)
    quiet = _sim(mosquitto.url, "dp-quiet", tmp_path / "quiet", "hsfp-cal", 1e-4)
    assert quiet[-1]["accuracy_calibrated"] > clean[-1]["accuracy_calibrated"] - 0.1, (quiet[-1], clean[-1])
    assert quiet[-1]["accuracy"] > 0.5 and quiet[-1]["calibrated"] == clean[-1]["calibrated"]
    assert "dp_epsilon" not in clean[-1]


def test_noisy_moments_with_no_noise_are_the_exact_ones() -> None:
    from splitedge.methods.privacy.release import PrivateSums, private_moments

    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(300, 16)), rng.integers(0, 3, 300)
    m = create_method("hsfp", default_config("hsfp", ModelSpec(num_classes=5), dp_sigma=1e-12, dp_clip=1e6))
    part = m.device_part(NodeContext("d0", m, rng), (np.zeros((300, 8, 8, 1), np.uint8), y), "onnx")
    acc = PrivateSums(16, part=part, clip=1e6, second="class", adapter=private_moments(part, y))
    acc.add(x, y)
    got, want = acc.result(), compute_moments(x, y)
    assert got.classes.tolist() == want.classes.tolist() and (got.counts == want.counts).all()
    np.testing.assert_allclose(got.mean, want.mean, rtol=1e-6, atol=1e-6)
    assert part.dp_releases == 1


def test_under_dp_the_owner_s_stricter_floor_applies_to_the_noisy_counts() -> None:
    from splitedge.methods.privacy.release import PrivateSums, private_moments

    rng = np.random.default_rng(1)
    y = np.array([0] * 30 + [1] * 3)
    x = rng.normal(size=(len(y), 4))
    m = create_method("hsfp", default_config("hsfp", ModelSpec(num_classes=3), dp_sigma=1e-12, dp_clip=1e6,
                                             min_class_count=1))
    for own, classes in ((1, [0, 1]), (5, [0])):
        part = m.device_part(NodeContext("d0", m, rng, min_class_count=own), (np.zeros((len(y), 8, 8, 1), np.uint8), y),
                             "onnx")
        acc = PrivateSums(4, part=part, clip=1e6, second="class", adapter=private_moments(part, y))
        acc.add(x, y)
        assert acc.result().classes.tolist() == classes
        # what the floor left out is reported as without DP, from the release's noisy counts
        assert part.withheld == ({} if own == 1 else {"classes": 1, "samples": 3}), part.withheld
