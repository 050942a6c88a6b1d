"""The minimum count per class (methods/privacy/floor.py): a device leaves the classes it holds
fewer than `min_class_count` images of out of every per-class statistic it sends, reports what
it held back, and the statistics of the other classes stay exactly what they were."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from splitedge.methods.calibration.records import calibration_round, head_stats
from splitedge.methods.calibration.stats import HeadStatsAccumulator
from splitedge.methods.config import ModelSpec
from splitedge.methods.contract import DONE, Message, DeviceContext, RoundPlan
from splitedge.methods.data.preprocess import accumulate
from splitedge.methods.moments import MomentAccumulator, compute_moments
from splitedge.methods.privacy.floor import ClassFloor, summed_withheld
from splitedge.methods.registry import create_method, default_config
from splitedge.runtime.phases import device_info
from splitedge.sim import SimSettings, run_sim

SPEC = {"model": "cnn", "num_classes": 10, "channels": 1, "image_size": 8, "mean": [0.5], "std": [0.25]}


def test_the_floor_keeps_only_classes_held_often_enough() -> None:
    y = np.array([0, 0, 0, 1, 2, 2, 3, 3, 3, 3])
    floor = ClassFloor.of(y, 3)
    assert floor.keep.tolist() == [True] * 3 + [False] * 3 + [True] * 4
    assert floor.info == {"classes": 2, "samples": 3}  # class 1 (one image) and class 2 (two)
    assert ClassFloor.of(y, 1).keep.all() and ClassFloor.of(y, 1).info == {}
    assert not ClassFloor.of(y, 5).keep.any() and ClassFloor.of(y, 5).info == {"classes": 4, "samples": 10}
    with pytest.raises(ValueError, match="min_count"):
        ClassFloor.of(y, 0)


def test_reported_counts_from_peers_are_summed_and_garbage_is_skipped() -> None:
    infos = [{"classes": 2, "samples": 3}, None, {"classes": "x"}, {"classes": -1, "samples": 1},
             {"classes": True, "samples": 1}, {"classes": 1, "samples": 4}, [1, 2]]
    assert summed_withheld(infos) == {"classes": 3, "samples": 7}
    assert summed_withheld([{}, None]) == {}


def _images(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (n, 8, 8, 1), dtype=np.uint8), rng.integers(0, 4, n)


def test_statistics_of_the_kept_classes_equal_those_of_the_kept_images_alone() -> None:
    x, y = _images(300)
    y[:3] = 9  # class 9: three images, held back below a floor of 5
    floor = ClassFloor.of(y, 5)
    feats = lambda a: a.reshape(len(a), -1) * 2.0 + 1.0  # noqa: E731
    kept = (x[floor.keep], y[floor.keep])
    for acc in (MomentAccumulator, HeadStatsAccumulator):
        got = accumulate(feats, (x, y), [0.5], [0.25], acc, batch=7, keep=floor.keep)
        want = accumulate(feats, kept, [0.5], [0.25], acc, batch=7)
        assert got.classes.tolist() == [0, 1, 2, 3] and (got.counts == want.counts).all()
        np.testing.assert_allclose(got.mean, want.mean, rtol=1e-12)
        np.testing.assert_allclose(getattr(got, "var", getattr(got, "cov", None)),
                                   getattr(want, "var", getattr(want, "cov", None)), rtol=1e-9, atol=1e-12)
    direct = compute_moments(feats(x[floor.keep].astype(np.float32)), y[floor.keep])
    assert direct.classes.tolist() == [0, 1, 2, 3]


def _part(method: str, data: tuple[np.ndarray, np.ndarray], floor: int, backend: str = "torch"):
    m = create_method(method, default_config(method, ModelSpec(**{**SPEC, "mean": (0.5,), "std": (0.25,)}),
                                             min_class_count=floor, calibrate="lda"))
    assert m.config.min_class_count == floor
    return m.device_part(DeviceContext("d0", m, np.random.default_rng(0)), data, backend=backend)


def test_a_device_whose_classes_are_all_rare_sends_no_head_statistics() -> None:
    x, y = _images(12)
    part = _part("fedavg", (x, y), floor=50)
    plan = RoundPlan(round=1, method="fedavg", deadline_s=10.0, config={}, directives={"calibrate": {"layers": {"classifier": 64}}},
                     phase="calibrate")
    out = list(calibration_round(part, plan))
    assert out == [DONE]
    assert device_info(part, plan).to_info() == {"withheld": {"classes": len(np.unique(y)), "samples": 12}}
    part = _part("fedavg", (x, y), floor=1)
    records = [m for m in calibration_round(part, plan) if isinstance(m, Message)]
    assert len(records) == 1 and records[0].body["arrays"]["counts"].sum() == 12
    assert device_info(part, plan).to_info() == {}


def test_head_statistics_skip_the_rare_classes_in_the_shared_covariance_too() -> None:
    x, y = _images(200, seed=1)
    y[:2] = 7
    floor = ClassFloor.of(y, 3)
    feats = lambda a: a.reshape(len(a), -1)  # noqa: E731
    got = head_stats(feats, (x, y), [0.5], [0.25], keep=floor.keep)
    want = head_stats(feats, (x[2:], y[2:]), [0.5], [0.25])
    assert 7 not in got.classes.tolist()
    np.testing.assert_allclose(got.cov, want.cov, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("method", ["fedproto", "cflhkd"])
def test_prototypes_and_mean_logits_leave_out_the_rare_classes(method: str) -> None:
    torch.set_num_threads(1)
    x, y = _images(120, seed=2)
    y[:2] = 8
    part = _part(method, (x, y), floor=3)
    if method == "fedproto":
        classes, counts, means = part.local_protos()
        n_train = len(part.y)
    else:
        body = part.mean_logits()
        classes, counts = body["classes"], body["counts"]
        n_train = len(part.y)
    labels = part.y.numpy()
    held = {c for c, n in zip(*np.unique(labels, return_counts=True)) if n < 3}
    assert set(classes.tolist()) == set(np.unique(labels).tolist()) - held
    assert int(counts.sum()) == n_train - sum(int((labels == c).sum()) for c in held)
    assert part.withheld == ({"classes": len(held), "samples": n_train - int(counts.sum())} if held else {})


def _run(url: str, run: str, out: Path, method: str, floor: int, **overrides) -> list[dict]:
    torch.set_num_threads(1)
    s = SimSettings(rounds=2, devices=4, edges=2, broker=url, run=run, out=out, method=method, alpha=0.1,
                    backends=("torch", "onnx") if method.startswith("hsfp") else ("torch",),
                    max_train=400, max_test=200, deadline_s=60.0,
                    overrides={"min_class_count": floor, **overrides})
    run_sim(s)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_a_federation_reports_what_its_devices_held_back(mosquitto, tmp_path) -> None:
    # Dir(0.1) over 4 devices: each device holds a few classes in bulk and others with a handful
    # of images. torch and thin devices apply the same floor; the calibration counts every image
    # not held back, so what is reported and what is merged add up to the training set.
    records = _run(mosquitto.url, "floor-hsfp", tmp_path / "hsfp", "hsfp-cal", 20,
                   ic=1, ie=1, edge_samples=256, cloud_samples=256)
    for r in records:
        withheld = r.get("calibration_withheld", {})
        assert withheld.get("classes", 0) > 0, r
        assert r["calibrated"] + withheld["samples"] == 400, r
        assert r["withheld"] == withheld  # the moments of the training phase hold back the same classes
    assert np.isfinite(records[-1]["accuracy"])


def test_a_device_owner_may_be_stricter_than_the_run_never_laxer() -> None:
    x, y = _images(60, seed=3)
    y[:2] = 9
    m = create_method("hsfp", default_config("hsfp", ModelSpec(), min_class_count=1))
    for own, withheld in ((1, {}), (3, {"classes": 1, "samples": 2})):
        part = m.device_part(DeviceContext("d0", m, np.random.default_rng(0), min_class_count=own), (x, y), "torch")
        assert part.stats_floor(y).info == withheld
    strict = create_method("hsfp", default_config("hsfp", ModelSpec(), min_class_count=3))
    part = strict.device_part(DeviceContext("d0", strict, np.random.default_rng(0), min_class_count=1), (x, y), "torch")
    assert part.stats_floor(y).info == {"classes": 1, "samples": 2}


def test_a_floor_below_one_is_one_line_before_the_data_is_read(tmp_path: Path, capsys) -> None:
    from splitedge.cli import main

    code = main(["device", "--broker", "mqtt://127.0.0.1:1", "--id", "d0", "--edge", "e0", "--min-class-count", "0",
                 "--data", str(tmp_path / "missing.npz")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "--min-class-count must be >= 1" in err and len(err.splitlines()) == 1, err
    with pytest.raises(ValueError, match="min_class_count must be >= 1"):
        default_config("hsfp", ModelSpec(), min_class_count=0)
