"""One peer's bad message cannot poison a round or a later one (issue: state that cannot be
poisoned by one message). A rogue device joins an H-SFP federation over Mosquitto and sends, every
round, moments of another feature dimension (one of them 50 MB), a class beyond the model's,
counts beyond its hello (10**12, and near 2**63 so an i8 sum wraps), a W_c of the wrong shape and
a W_c of the right shape holding 1e37, plus its `done`. The edge refuses each, counts it by rule,
and the federation learns exactly what it learns without the rogue. A replayer resends a
device's earlier moments under fresh message ids: refused, and the device keeps counting."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from splitedge.protocol.codec import Envelope
from splitedge.runtime.session import connect
from splitedge.protocol.topics import pattern, topic
from splitedge.sim import SimSettings, run_sim

from splitedge.bench.lib.rogues import RogueDevice

BIG_DIM = 50 * 2**20 // (2 * 4 * 3)
"""A moments body of 3 classes whose f4 mean and var take 50 MiB together: schema-valid, under
the transport's 64 MiB frame cap, and of another dimension than the federation's."""


class Rogue(RogueDevice):
    """Device d9 of edge e0: valid frames, values that do not fit the federation (another feature
    dimension, a class id beyond the model's, weights of other shapes, counts beyond its hello)."""

    def __init__(self, url: str, run: str) -> None:
        self.wc: dict[str, np.ndarray] | None = None  # the global W_c, copied with one 1e37 in it
        self.sent = {"big": 0, "huge_weights": 0}
        self.big = {"mean": np.zeros((3, BIG_DIM), "f4"), "var": np.ones((3, BIG_DIM), "f4")}
        super().__init__(url, run, samples=100_000, classes=3)
        self.listen("weights-wc", self.on_weights)

    def on_weights(self, _topic: str, env: Envelope) -> None:
        self.wc = {k: np.array(v) for k, v in env.body["weights"].items()}

    def on_round(self, env: Envelope) -> None:
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
        self.say("moments", {"classes": np.arange(3, dtype=np.int64), "counts": np.full(3, 50, np.int64),
                             **self.big, "space": "wc", "versions": {"wc": env.body["versions"]["wc"]}}, r)
        self.sent["big"] += 1
        if self.wc is not None:  # the model's own names and shapes, one float beyond any trained weight
            huge = {k: v.copy() for k, v in self.wc.items()}
            name = next(k for k, v in huge.items() if v.dtype.kind == "f")
            huge[name].flat[0] = 1e37
            self.say("weights", {"part": "wc", "version": env.body["versions"]["wc"], "samples": 100,
                                 "weights": huge}, r)
            self.sent["huge_weights"] += 1
        self.say("done", {"phase": "round", "info": {}}, r)


class Replayer:
    """Replays device d0's moments on d0's topic under fresh message ids: its round-1 moments (W_c
    v0) at the start of every later round, and each new message of d0 once more in its round."""

    def __init__(self, url: str, run: str, device: str = "d0", edge: str = "e0") -> None:
        self.run, self.device = run, device
        self.t = connect(url, run=run, tier="device", node_id=f"replay-{device}")
        self.first: Envelope | None = None
        self.own: set[str] = set()  # ids of our replays (they come back to us)
        self.sent = 0
        self.lock = threading.Lock()
        self.t.subscribe(pattern(run, "device", device, "up", "moments"), self.on_moments)
        self.t.subscribe(pattern(run, "edge", edge, "down", "round"), self.on_round)

    def replay(self, env: Envelope) -> None:
        fresh = Envelope(kind="moments", run=self.run, round=env.round, sender=self.device, body=env.body)
        assert fresh.msg_id != env.msg_id
        self.own.add(fresh.msg_id)
        self.t.publish(topic(self.run, "device", self.device, "up", "moments"), fresh)
        self.sent += 1

    def on_moments(self, _topic: str, env: Envelope) -> None:
        with self.lock:
            if env.msg_id not in self.own:
                self.first = self.first or env
                self.replay(env)  # the same round's message again, under a new id

    def on_round(self, _topic: str, env: Envelope) -> None:
        with self.lock:
            if not env.body.get("stop") and env.round >= 2 and self.first is not None:
                self.replay(self.first)  # round 1's moments, of W_c v0

    def close(self) -> None:
        self.t.close()


ROUNDS = 4
SIM = {"ic": 2, "edge_samples": 512, "cloud_samples": 512}
"""W_c averaged in rounds 2 and 4: devices send moments of v0 in round 1 and of v1 in round 3 only."""


def _sim(url: str, run: str, out: Path, **overrides) -> list[dict]:
    torch.set_num_threads(1)
    s = SimSettings(rounds=ROUNDS, devices=4, edges=2, broker=url, run=run, out=out, deadline_s=60.0,
                    overrides={**SIM, **overrides})
    run_sim(s)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def clean(mosquitto, tmp_path_factory) -> list[dict]:
    """The federation without any rogue: the reference every poisoned run must match."""
    return _sim(mosquitto.url, "poison-clean", tmp_path_factory.mktemp("clean"))


def test_a_rogue_device_is_refused_and_changes_nothing(mosquitto, clean, tmp_path) -> None:
    # Prepare
    rogue = Rogue(mosquitto.url, "poison-rogue")
    # Execute
    try:
        poisoned = _sim(mosquitto.url, "poison-rogue", tmp_path / "rogue")
    finally:
        rogue.close()
    # Assert: every round happened, with the same accuracy as without the rogue ...
    assert [r["accuracy"] for r in poisoned] == [r["accuracy"] for r in clean]
    assert all(r["edges"] == 2 for r in poisoned)
    assert [r["merged"] for r in poisoned] == [r["merged"] for r in clean] == [4] * ROUNDS  # the rogue never counted
    # ... and e0 refused the rogue's messages of every round, by rule
    refused = poisoned[-1]["rejected"]["e0"]
    assert rogue.sent["big"] == ROUNDS and rogue.sent["huge_weights"] >= ROUNDS - 1, rogue.sent
    assert refused.get("state.dim") == ROUNDS + rogue.sent["big"], refused  # 7-dim and 50 MiB moments
    assert refused.get("state.weights") == ROUNDS, refused
    assert refused.get("state.magnitude") == rogue.sent["huge_weights"], refused  # |w| = 1e37 in a W_c of its shapes
    assert refused.get("state.classes") == ROUNDS, refused  # a label beyond the model's classes never reaches training
    assert refused.get("state.samples") == 3 * ROUNDS, refused  # counts beyond what its hello announced
    assert "e0" not in clean[-1]["rejected"]


def test_replayed_moments_never_evict_a_device(mosquitto, clean, tmp_path) -> None:
    """d0's round-1 moments (W_c v0) replayed in round 4, where d0 sends none (its v1 moments of
    round 3 still hold), would, if they replaced the cached ones, leave d0 out of round 4's merge;
    copies of its own messages in their rounds are refused too."""
    # Prepare
    replayer = Replayer(mosquitto.url, "poison-replay")
    # Execute
    try:
        replayed = _sim(mosquitto.url, "poison-replay", tmp_path / "replay")
    finally:
        replayer.close()
    # Assert: d0 counted in every round's merge, and the federation learnt exactly the clean run's model ...
    assert replayer.sent == 2 + (ROUNDS - 1), replayer.sent  # d0's two messages again, round 1's in rounds 2-4
    assert [r["merged"] for r in replayed] == [4] * ROUNDS
    assert [r["accuracy"] for r in replayed] == [r["accuracy"] for r in clean]
    # ... because e0 refused every replay, as stale (older than the cached moments) or as a replay
    # (same version and round, another id), depending on whether d0's round-3 message came first
    refused = replayed[-1]["rejected"].get("e0", {})
    assert set(refused) <= {"state.stale", "state.replay"} and sum(refused.values()) == replayer.sent, refused
    assert refused.get("state.stale", 0) >= 1, refused  # round 4's, at least


def test_counts_are_bounded_by_the_announced_samples_without_wrapping() -> None:
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
    from splitedge.methods.checks import MAX_ABS_WEIGHT, check_weight_map
    from splitedge.protocol.errors import ProtocolError

    specs = {"w": ((2, 2), "f"), "n": ((), "i")}
    check_weight_map({"w": np.full((2, 2), MAX_ABS_WEIGHT, np.float32), "n": np.array(10**12)}, specs)  # int buffers
    with pytest.raises(ProtocolError, match="w: \\|w\\| up to 1e\\+37") as caught:
        check_weight_map({"w": np.array([[0, 1e37], [0, 0]], np.float32), "n": np.array(1)}, specs)
    assert caught.value.rule == "state.magnitude"


def test_stats_must_fit_the_federation_before_anything_is_decoded_into_state() -> None:
    from splitedge.methods.checks import check_stats
    from splitedge.protocol.errors import ProtocolError

    body = {"classes": np.arange(3, dtype=np.int64), "counts": np.full(3, 5, np.int64),
            "mean": np.zeros((3, 16), "f4"), "var": np.ones((3, 16), "f4")}
    check_stats(body, "mean", dim=16, num_classes=10, dtype="f4")
    cases = [({"mean": np.zeros((3, BIG_DIM), "f4"), "var": np.ones((3, BIG_DIM), "f4")}, "state.dim"),
             ({"var": np.ones((3, 16), "f8")}, "state.dtype"),  # var wider than the mean it travels with
             ({"var": np.ones((3, 8), "f4")}, "state.shape"),
             ({"classes": np.arange(11, dtype=np.int64), "mean": np.zeros((11, 16), "f4"),
               "var": np.ones((11, 16), "f4")}, "state.classes")]
    for change, rule in cases:
        with pytest.raises(ProtocolError) as caught:
            check_stats({**body, **change}, "mean", dim=16, num_classes=10, dtype="f4")
        assert caught.value.rule == rule, (rule, str(caught.value))


def _moments_env(sender: str, round_: int, version: int, dim: int, shift: float = 0.0):
    from parts import wire

    from splitedge.methods.moments import compute_moments, moments_to_body

    rng = np.random.default_rng(round_)
    m = compute_moments(rng.normal(size=(40, dim)) + shift, rng.integers(0, 3, 40))
    return wire("moments", moments_to_body(m, space="wc", versions={"wc": version}), sender, round_)


def test_an_edge_keeps_each_devices_newest_moments() -> None:
    from parts import edge_ctx, plan_for

    from splitedge.protocol.codec import Envelope
    from splitedge.protocol.errors import ProtocolError

    ctx = edge_ctx("hsfp", "e0")
    edge = ctx.method.edge_part(ctx)
    edge.on_round_open(plan_for(3, "hsfp", versions={"wc": 1}), {"d0"})
    dim = int(np.prod(edge.wc_shape))
    old, new = _moments_env("d0", 1, 0, dim, shift=5.0), _moments_env("d0", 3, 1, dim)
    for e in (old, new):  # in order, each replaces the last
        edge.check(e, "child")
        edge.on_device_message(e)
    assert edge.cache["d0"][0] == 1
    again = lambda e: Envelope(kind=e.kind, run=e.run, round=e.round, sender=e.sender, body=e.body)  # noqa: E731
    for e, rule in ((again(old), "state.stale"), (again(new), "state.replay")):
        with pytest.raises(ProtocolError) as caught:
            edge.check(e, "child")
        assert caught.value.rule == rule
        edge.on_device_message(e)  # even if it got this far, it replaces nothing
        assert edge.cache["d0"][0] == 1 and edge.cached_ids["d0"] == new.msg_id
    edge.check(new, "child")  # the same message again is the runtime's duplicate, not refused here


def test_the_hsfp_cloud_takes_only_label_histograms_of_the_models_classes() -> None:
    from parts import cloud_ctx, wire

    from splitedge.protocol.errors import ProtocolError

    ctx = cloud_ctx("hsfp", "cloud", test=None)
    cloud = ctx.method.cloud_part(ctx)
    good = {"name": "labels", "version": 1, "arrays": {"d0": np.ones(10, "f4"), "d1": np.zeros(10, "f4")}}
    cloud.check(wire("arrays", good, "e0"), "child")
    for body, rule in (({**good, "name": "other"}, "state.name"),
                       ({**good, "arrays": {"d0": np.ones(BIG_DIM, "f4")}}, "state.shape"),
                       ({**good, "arrays": {"d0": np.ones((10, 2), "f4")}}, "state.shape")):
        with pytest.raises(ProtocolError) as caught:
            cloud.check(wire("arrays", body, "e0"), "child")
        assert caught.value.rule == rule
