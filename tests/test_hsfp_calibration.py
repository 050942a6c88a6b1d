"""`hsfp-cal`: the head refitted on real statistics, over Mosquitto, with thin devices beside
torch ones and a rogue that sends head statistics which do not fit."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from splitedge.methods.config import ModelSpec
from splitedge.methods.hsfp.headstats import HeadStats, head_stats_arrays
from splitedge.methods.registry import create_method, default_config
from splitedge.protocol.codec import Envelope
from splitedge.runtime.session import connect
from splitedge.protocol.topics import pattern, topic
from splitedge.sim import SimSettings, run_sim

ROUNDS = 3
HEAD_DIM = 64  # the digits cnn's classifier input


class RogueCalibrator:
    """Device d9 of edge e0 (100 samples announced): each round, head statistics of a stale
    calibration version, of another dimension, counting more than its hello, and with a
    negative variance, then its `done`."""

    def __init__(self, url: str, run: str) -> None:
        self.run, self.t = run, connect(url, run=run, tier="device", node_id="d9")
        self.say("hello", {"role": "device", "parent": "e0", "samples": 100, "backend": "torch",
                           "classes": np.arange(10, dtype=np.int64)}, 0, retain=True)
        self.say("status", {"state": "online", "role": "device"}, 0, retain=True)
        self.t.subscribe(pattern(run, "edge", "e0", "down", "round"), self.on_round)

    def say(self, kind: str, body: dict, round_: int, retain: bool = False) -> None:
        env = Envelope(kind=kind, run=self.run, round=round_, sender="d9", body=body)
        to = "e0" if kind == "hello" else None  # a device's hello is addressed to its edge
        self.t.publish(topic(self.run, "device", "d9", "up", kind, to), env, retain=retain)

    @staticmethod
    def stats(dim: int, counts: list[int]) -> dict:
        k = len(counts)
        return head_stats_arrays(HeadStats(np.arange(k), np.array(counts), np.ones((k, dim)), np.eye(dim)), "f4")

    def on_round(self, _topic: str, env: Envelope) -> None:
        if env.body.get("stop"):
            return
        r, versions = env.round, env.body["versions"]
        calib, wc = int(versions.get("calib", 0)), int(versions["wc"])
        negative = self.stats(HEAD_DIM, [10, 10])
        negative["cov"][0] = -1.0
        for version, arrays in ((calib + 5, self.stats(HEAD_DIM, [10, 10])),  # a version not yet sent
                                (calib, self.stats(HEAD_DIM + 1, [10, 10])),  # another head dimension
                                (calib, self.stats(HEAD_DIM, [90, 90])),  # 180 samples of 100 announced
                                (calib, negative)):
            self.say("arrays", {"name": "head_stats", "version": version, "arrays": arrays,
                                "scalars": {"wc": wc}}, r)
        self.say("done", {"phase": "round", "info": {}}, r)

    def close(self) -> None:
        self.t.close()


def _sim(url: str, run: str, out: Path) -> list[dict]:
    torch.set_num_threads(1)
    s = SimSettings(rounds=ROUNDS, devices=4, edges=2, broker=url, run=run, out=out, method="hsfp-cal",
                    backends=("torch", "onnx"), max_train=600, max_test=300, deadline_s=60.0,
                    overrides={"ic": 2, "ie": 2, "edge_samples": 512, "cloud_samples": 512})
    run_sim(s)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def clean(mosquitto, tmp_path_factory) -> list[dict]:
    return _sim(mosquitto.url, "calib-clean", tmp_path_factory.mktemp("clean"))


def test_torch_and_thin_devices_calibrate_every_round(clean) -> None:
    # d0 and d2 (torch) and d1 and d3 (onnx, a second graph for W_e and W_g's trunk) each count
    # all their images: the 600 training images, every round
    assert [r["calibrated"] for r in clean] == [600] * ROUNDS, clean
    assert all(r["merged"] == 4 for r in clean), [r["merged"] for r in clean]
    # W_e and the trunk go down again only when they changed: W_e is averaged after round 2 (ie=2)
    assert [r["versions"]["calib"] for r in clean] == [0, 0, 1], [r["versions"] for r in clean]
    assert min(r["accuracy"] for r in clean) > 0.5, [r["accuracy"] for r in clean]  # chance is 0.1


def test_head_statistics_that_do_not_fit_are_refused_and_change_nothing(mosquitto, clean, tmp_path) -> None:
    rogue = RogueCalibrator(mosquitto.url, "calib-rogue")
    try:
        poisoned = _sim(mosquitto.url, "calib-rogue", tmp_path / "rogue")
    finally:
        rogue.close()
    assert [r["accuracy"] for r in poisoned] == [r["accuracy"] for r in clean]
    assert [r["calibrated"] for r in poisoned] == [r["calibrated"] for r in clean]
    refused = poisoned[-1]["rejected"]["e0"]
    for rule in ("state.stale", "state.dim", "state.samples", "state.range"):
        assert refused.get(rule) == ROUNDS, (rule, refused)


def test_calibrated_rounds_follow_the_setting() -> None:
    def rounds(every: int) -> list[int]:
        method = create_method("hsfp", default_config("hsfp", ModelSpec(), calibrate_every=every))
        return [r for r in range(1, 8) if method.calibrates(r)]

    assert rounds(0) == [] and rounds(1) == list(range(1, 8)) and rounds(3) == [1, 4, 7]
