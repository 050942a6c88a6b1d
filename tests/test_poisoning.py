"""One peer's bad message cannot poison a round or a later one (issue: state that cannot be
poisoned by one message). A rogue device joins an H-SFP federation over Mosquitto and sends, every
round, moments of another feature dimension and a W_c of the wrong shape, plus its `done`. The
edge refuses both, counts them by rule, and the federation learns exactly what it learns without
the rogue."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from splitedge.protocol.codec import Envelope
from splitedge.protocol.node import connect
from splitedge.protocol.topics import pattern, topic
from splitedge.sim import SimSettings, run_sim


class Rogue:
    """Device d9 of edge e0: valid frames, values that do not fit the federation (another feature
    dimension, a class id beyond the model's, weights of other shapes, counts beyond its hello)."""

    def __init__(self, url: str, run: str) -> None:
        self.run, self.t = run, connect(url, run=run, tier="device", node_id="d9")
        self.say("hello", {"role": "device", "parent": "e0", "samples": 100_000, "backend": "torch",
                           "classes": np.arange(3, dtype=np.int64)}, 0, retain=True)
        self.say("status", {"state": "online", "role": "device"}, 0, retain=True)
        self.t.subscribe(pattern(run, "edge", "e0", "down", "round"), self.on_round)

    def say(self, kind: str, body: dict, round_: int, retain: bool = False) -> None:
        env = Envelope(kind=kind, run=self.run, round=round_, sender="d9", body=body)
        self.t.publish(topic(self.run, "device", "d9", "up", kind), env, retain=retain)

    def on_round(self, _topic: str, env: Envelope) -> None:
        if env.body.get("stop"):
            return
        r, rng = env.round, np.random.default_rng(env.round)
        self.say("moments", {"classes": np.arange(3, dtype=np.int64), "counts": np.full(3, 50, np.int64),
                             "mean": rng.normal(size=(3, 7)).astype("f4"), "var": np.ones((3, 7), "f4"),
                             "space": "wc", "versions": {"wc": env.body["versions"]["wc"]}}, r)
        self.say("moments", {"classes": np.array([51], dtype=np.int64), "counts": np.array([50], np.int64),
                             "mean": np.zeros((1, 512), "f4"), "var": np.ones((1, 512), "f4"),  # digits: 10 classes
                             "space": "wc", "versions": {"wc": env.body["versions"]["wc"]}}, r)
        self.say("weights", {"part": "wc", "version": env.body["versions"]["wc"], "samples": 10_000,
                             "weights": {"block1.conv.weight": np.ones((3, 3), "f4")}}, r)
        for counts in ([10**12, 1, 1], [2**63 - 1, 2**63 - 1, 2]):  # beyond its hello; a sum that wraps in i8
            self.say("moments", {"classes": np.arange(3, dtype=np.int64), "counts": np.array(counts, np.int64),
                                 "mean": np.zeros((3, 7), "f4"), "var": np.ones((3, 7), "f4"),
                                 "space": "wc", "versions": {"wc": env.body["versions"]["wc"]}}, r)
        self.say("weights", {"part": "wc", "version": env.body["versions"]["wc"], "samples": 10**12,
                             "weights": {"block1.conv.weight": np.ones((3, 3), "f4")}}, r)
        self.say("done", {"phase": "round", "info": {}}, r)

    def close(self) -> None:
        self.t.close()


def _sim(url: str, run: str, out: Path) -> list[dict]:
    torch.set_num_threads(1)
    s = SimSettings(rounds=3, devices=4, edges=2, broker=url, run=run, out=out, deadline_s=60.0,
                    overrides={"ic": 1, "edge_samples": 512, "cloud_samples": 512})
    run_sim(s)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_a_rogue_device_is_refused_and_changes_nothing(mosquitto, tmp_path) -> None:
    # Prepare: the clean federation's result as the reference
    clean = _sim(mosquitto.url, "poison-clean", tmp_path / "clean")
    rogue = Rogue(mosquitto.url, "poison-rogue")
    # Execute
    try:
        poisoned = _sim(mosquitto.url, "poison-rogue", tmp_path / "rogue")
    finally:
        rogue.close()
    # Assert: every round happened, with the same accuracy as without the rogue ...
    assert [r["accuracy"] for r in poisoned] == [r["accuracy"] for r in clean]
    assert all(r["edges"] == 2 for r in poisoned)
    # ... and e0 refused the rogue's two messages of every round, by rule
    refused = poisoned[-1]["rejected"]["e0"]
    assert refused.get("state.dim") == 3 and refused.get("state.weights") == 3, refused
    assert refused.get("state.classes") == 3, refused  # a label beyond the model's classes never reaches training
    assert refused.get("state.samples") == 9, refused  # counts beyond what its hello announced, 3 per round
    assert "e0" not in clean[-1]["rejected"]


def test_counts_are_bounded_by_the_announced_samples_without_wrapping() -> None:
    import pytest

    from splitedge.methods.checks import check_within_samples
    from splitedge.protocol.errors import ProtocolError

    check_within_samples({"counts": np.array([40, 60], np.int64)}, 100)  # exactly what it holds
    check_within_samples({"samples": 100, "weights": {}}, 100)
    with pytest.raises(ProtocolError, match="counts sum to 101, the sender announced 100"):
        check_within_samples({"counts": np.array([41, 60], np.int64)}, 100)
    wraps = np.array([2**63 - 1, 2**63 - 1, 2], np.int64)  # numpy's i8 sum of these is 0
    assert int(wraps.sum()) == 0
    with pytest.raises(ProtocolError, match="state|counts sum to 18446744073709551616"):
        check_within_samples({"counts": wraps}, 100)
    with pytest.raises(ProtocolError, match="samples 101, the sender announced 100"):
        check_within_samples({"samples": 101, "weights": {}}, 100)


def test_weights_beyond_any_trained_magnitude_are_refused() -> None:
    import pytest

    from splitedge.methods.checks import MAX_ABS_WEIGHT, check_weight_map
    from splitedge.protocol.errors import ProtocolError

    specs = {"w": ((2, 2), "f"), "n": ((), "i")}
    check_weight_map({"w": np.full((2, 2), MAX_ABS_WEIGHT, np.float32), "n": np.array(10**12)}, specs)  # int buffers
    with pytest.raises(ProtocolError, match="w: \\|w\\| up to 1e\\+37") as caught:
        check_weight_map({"w": np.array([[0, 1e37], [0, 0]], np.float32), "n": np.array(1)}, specs)
    assert caught.value.rule == "state.magnitude"
