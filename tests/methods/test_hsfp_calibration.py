"""`hsfp-cal`: the head refitted on real statistics in each round's calibration phase, over
Mosquitto, with thin devices beside torch ones and a rogue that sends head statistics which do
not fit (or outside a calibration phase)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from splitedge.methods.config import ModelSpec
from splitedge.methods.calibration import calibrates
from splitedge.methods.calibration.stats import HeadStats, head_stats_arrays
from splitedge.methods.registry import default_config
from splitedge.protocol.codec import Envelope
from splitedge.sim import SimSettings, run_sim

from splitedge.bench.lib.rogues import RogueDevice

ROUNDS = 3
HEAD_DIM = 64  # the digits cnn's classifier input


class RogueCalibrator(RogueDevice):
    """Device d9 of edge e0 (100 samples announced): in each round, head statistics where no
    calibration phase is open; in each calibration phase, head statistics of another round, of
    another dimension, counting more than its hello, and with a negative variance; each time
    its `done`."""

    @staticmethod
    def stats(dim: int, counts: list[int]) -> dict:
        k = len(counts)
        return head_stats_arrays(HeadStats(np.arange(k), np.array(counts), np.ones((k, dim)), np.eye(dim)), "f4")

    def on_round(self, env: Envelope) -> None:
        r = env.round
        if env.body.get("phase") != "calibrate":  # a record in the training phase
            self.say("arrays", {"name": "head_stats", "version": r, "arrays": self.stats(HEAD_DIM, [10, 10])}, r)
            self.say("done", {"phase": "round", "info": {}}, r)
            return
        negative = self.stats(HEAD_DIM, [10, 10])
        negative["cov"][0] = -1.0
        for version, arrays in ((r + 5, self.stats(HEAD_DIM, [10, 10])),  # another round's
                                (r, self.stats(HEAD_DIM + 1, [10, 10])),  # another head dimension
                                (r, self.stats(HEAD_DIM, [90, 90])),  # 180 samples of 100 announced
                                (r, negative)):
            self.say("arrays", {"name": "head_stats", "version": version, "arrays": arrays}, r)
        self.say("done", {"phase": "calibrate", "info": {}}, r)


def _sim(url: str, run: str, out: Path) -> list[dict]:
    torch.set_num_threads(1)
    s = SimSettings(rounds=ROUNDS, devices=4, edges=2, broker=url, run=run, out=out, method="hsfp-cal",
                    backends=("torch", "onnx"), max_train=600, max_test=300, deadline_s=60.0,
                    overrides={"ic": 2, "ie": 2, "edge_samples": 512, "cloud_samples": 512,
                               "min_class_count": 1})  # every image counts
    run_sim(s)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def clean(mosquitto, tmp_path_factory) -> list[dict]:
    return _sim(mosquitto.url, "calib-clean", tmp_path_factory.mktemp("clean"))


def test_torch_and_thin_devices_calibrate_every_round(clean) -> None:
    # d0 and d2 (torch) and d1 and d3 (onnx, a second graph for W_e and W_g's trunk) each count
    # all their images: the 600 training images, every round, through both edges
    assert [r["calibrated"] for r in clean] == [600] * ROUNDS, clean
    assert all(r["calibrated_edges"] == 2 for r in clean)
    assert all(r["merged"] == 4 for r in clean), [r["merged"] for r in clean]
    # W_e and the trunk go down again only when they changed: W_e is averaged in round 2 (ie=2),
    # so round 2's calibration already uses the new one; W_c is averaged in round 2 (ic=2) too
    assert [r["calibration_versions"]["calib"] for r in clean] == [0, 1, 1], clean
    assert [r["calibration_versions"]["wc"] for r in clean] == [0, 1, 1], clean
    assert min(r["accuracy_calibrated"] for r in clean) > 0.5, clean  # chance is 0.1


def test_head_statistics_that_do_not_fit_are_refused_and_change_nothing(mosquitto, clean, tmp_path) -> None:
    rogue = RogueCalibrator(mosquitto.url, "calib-rogue")
    try:
        poisoned = _sim(mosquitto.url, "calib-rogue", tmp_path / "rogue")
    finally:
        rogue.close()
    for key in ("accuracy", "accuracy_calibrated", "calibrated"):
        assert [r[key] for r in poisoned] == [r[key] for r in clean], key
    refused = poisoned[-1]["rejected"]["e0"]
    for rule in ("state.phase", "state.stale", "state.dim", "state.samples", "state.range"):
        assert refused.get(rule) == ROUNDS, (rule, refused)


def test_calibrated_rounds_follow_the_setting() -> None:
    def rounds(calibrate: str, every: int, last: int = 7) -> list[int]:
        cfg = default_config("hsfp", ModelSpec(), calibrate=calibrate, calibrate_every=every).method
        return [r for r in range(1, last + 1) if calibrates(cfg, r, last)]

    assert rounds("none", 1) == [] and rounds("lda", 1) == list(range(1, 8))
    assert rounds("lda", 3) == [3, 6, 7] and rounds("lda", 0) == [7]
