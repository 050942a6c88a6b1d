"""Every release counted (issue 53, item 4): a device's noisy class counts go up as the noise made
them, never capped to its true sample count N (the released total exceeds N as often as the
Gaussian says; the edge fits them to the samples the device announced, a bound public to it);
and a round that fails after a release still reports it, so the run's epsilon composes every
release a device made, counted here independently at the broker."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from mqtt_capture import Capture
from parts import wire
from splitedge.methods.calibration.stats import HeadStats, head_stats_arrays
from splitedge.methods.config import ModelSpec
from splitedge.methods.contract import DeviceContext
from splitedge.methods.moments import ClassMoments, moments_to_body
from splitedge.methods.privacy.accountant import epsilon
from splitedge.methods.privacy.release import (private_accumulator, private_class_means, private_head_stats,
                                               private_moments)
from splitedge.methods.registry import create_method, default_config
from splitedge.protocol.codec import decode
from splitedge.runtime.allowance import Allowance, listed
from splitedge.protocol.errors import ProtocolError
from splitedge.runtime.inbound import Inbound, within_announced

CLASSES, PER_CLASS, DIM = 4, 40, 3
# adapter, the second moment it releases, and P: the parts of the one Gaussian mechanism
ADAPTERS = {"moments": (private_moments, "class", 3), "head statistics": (private_head_stats, "diag", 3),
            "class means": (private_class_means, "none", 2)}


def _releasing_part(sigma: float):
    """A device part of a DP run holding PER_CLASS images of each of CLASSES classes."""
    m = create_method("hsfp", default_config("hsfp", ModelSpec(num_classes=CLASSES), dp_sigma=sigma, dp_clip=1.0,
                                             dp_update_clip=1.0, min_class_count=1))
    labels = np.repeat(np.arange(CLASSES), PER_CLASS)
    part = m.device_part(DeviceContext("d0", m, np.random.default_rng(0)),
                         (np.zeros((len(labels), 8, 8, 1), np.uint8), labels), "onnx")
    return part, labels


def _totals(adapter: str, sigma: float, draws: int) -> tuple[np.ndarray, int]:
    """The released counts' totals of `draws` releases through the device's release path."""
    part, labels = _releasing_part(sigma)
    make, second, _ = ADAPTERS[adapter]
    sums = private_accumulator(part, 1.0, second, make(part, labels))(DIM)
    sums.add(np.random.default_rng(1).normal(0.0, 0.3, (len(labels), DIM)), labels)
    totals = []
    for _ in range(draws):
        out = sums.result()
        counts = out[1] if isinstance(out, tuple) else out.counts
        totals.append(int(np.asarray(counts).sum()))
    assert part.dp_releases == draws  # each one counted
    return np.array(totals), len(labels)


def _gaussian_exceeds(sd: float, classes: int) -> float:
    """P(total > N) that the mechanism implies, simulated here apart from it: each held class's
    released count is n_c + rint(e_c), e_c ~ N(0, sd^2), so the total exceeds N when the sum of
    the rounded noises is > 0."""
    e = np.random.default_rng(12345).normal(0.0, sd, (400_000, classes))
    return float((np.rint(e).sum(axis=1) > 0).mean())


@pytest.mark.parametrize("sigma", [0.3, 2.0])
@pytest.mark.parametrize("adapter", sorted(ADAPTERS))
def test_released_counts_exceed_the_true_count_as_often_as_the_noise_implies(adapter: str, sigma: float) -> None:
    # Prepare / Execute: 1,500 releases of a device holding N = 160 images
    draws = 1500
    totals, n = _totals(adapter, sigma, draws)
    # Check: the fraction over N is the Gaussian's (within 4 binomial sds), and the totals centre
    # on N: nothing caps them (a cap to N made the fraction 0 at any sigma)
    count_sd = sigma * math.sqrt(ADAPTERS[adapter][2])
    expected = _gaussian_exceeds(count_sd, CLASSES)
    observed = float((totals > n).mean())
    slack = 4 * math.sqrt(expected * (1 - expected) / draws) + 0.005
    assert observed > 0 and abs(observed - expected) < slack, (observed, expected)
    assert abs(float(totals.mean()) - n) < 4 * count_sd * math.sqrt(CLASSES / draws) + 0.05, totals.mean()


def _admits(msg, dp_sigma: float, allowance: Allowance) -> bool:
    """The edge's step that holds a child to what it may count (runtime/inbound.py), on `msg`."""
    part = SimpleNamespace(cfg=SimpleNamespace(dp_sigma=dp_sigma))
    try:
        return within_announced(Inbound(msg, "child", part, allowance), lambda m: True)
    except ProtocolError as exc:
        assert exc.rule == "state.samples"
        return False


def _moments(counts: list[int]):
    k = len(counts)
    m = ClassMoments(np.arange(k), np.array(counts), np.full((k, DIM), 0.1), np.full((k, DIM), 0.01))
    return wire("moments", moments_to_body(m, "f8"), "d0")


def _head_stats(counts: list[int]):
    k = len(counts)
    h = HeadStats(np.arange(k), np.array(counts), np.full((k, DIM), 0.1), np.eye(DIM) * 0.01)
    return wire("arrays", {"name": "head_stats", "version": 1, "arrays": head_stats_arrays(h, "f8", "full")}, "d0")


@pytest.mark.parametrize("build", [_moments, _head_stats], ids=["moments", "head statistics"])
def test_an_edge_fits_noisy_counts_to_what_the_device_may_count_instead_of_refusing_them(build) -> None:
    # Prepare: a device that announced 160 samples sends noisy counts summing to 168
    said = Allowance(160)
    counts_of = (lambda e: e.body["counts"]) if build is _moments else (lambda e: e.body["arrays"]["counts"])
    # Execute / Check: without DP such counts are a lie, refused; under DP they are fitted (post-processing)
    assert not _admits(build([44, 41, 40, 43]), 0.0, said)
    msg = build([44, 41, 40, 43])
    assert _admits(msg, 1.0, said)
    fitted = np.asarray(counts_of(msg))
    assert fitted.sum() <= 160 and (fitted >= 1).all() and fitted.dtype == np.dtype("<i8")
    # a manifest's class counts bound each class too
    msg = build([44, 41, 40, 43])
    assert _admits(msg, 1.0, Allowance(160).within(listed(160, [40, 40, 40, 40])))
    assert np.asarray(counts_of(msg)).tolist() == [40, 40, 40, 40]
    # counts that fit are left as they are
    msg = build([38, 41, 40, 37])
    assert _admits(msg, 1.0, said) and np.asarray(counts_of(msg)).tolist() == [38, 41, 40, 37]


def test_a_failed_round_reports_the_releases_it_made() -> None:
    from splitedge.methods.privacy.release import private_weights

    part, _ = _releasing_part(1.0)
    assert part.release_info() == {}
    start = {"w": np.zeros(10, np.float32)}
    private_weights(part, {"w": np.ones(10, np.float32)}, start)
    private_weights(part, {"w": np.ones(10, np.float32)}, start)
    assert part.release_info() == {"dp_releases": 2}


def test_a_round_that_fails_after_releasing_enters_the_run_s_epsilon(mosquitto, tmp_path: Path, monkeypatch) -> None:
    """FedAvg under DP, 4 devices, 2 rounds: in round 1 every device sends its private update
    and then fails (`done {failed}`); round 2 goes as usual. A raw subscriber to the run's
    topics counts each device's `weights` (one release each): the cloud's epsilon after each
    round is that of the most releases any device had made by then, never 0."""
    import torch

    from splitedge.methods.contract import DONE
    from splitedge.methods.errors import RoundFailed
    from splitedge.methods.fedavg.device import FedAvgDevice
    from splitedge.sim import SimSettings, run_sim

    torch.set_num_threads(1)
    real = FedAvgDevice.run_round

    def fails_after_releasing(self, plan):
        for item in real(self, plan):
            if item is DONE and plan.round == 1:
                raise RoundFailed("forced by the test after its release")
            yield item

    monkeypatch.setattr(FedAvgDevice, "run_round", fails_after_releasing)
    run, sigma = "every-release", 2.0
    capture = Capture(mosquitto, f"capture-{run}", topic=f"splitedge/{run}/#")
    try:
        run_sim(SimSettings(rounds=2, devices=4, edges=2, method="fedavg", broker=mosquitto.url, run=run,
                            out=tmp_path / run, max_train=400, max_test=100, deadline_s=60.0,
                            overrides={"dp_sigma": sigma, "dp_update_clip": 5.0}))
        time.sleep(0.3)
    finally:
        capture.close()
    envs = [decode(payload) for topic, payload, *_ in capture.messages if "/device/" in topic]
    by_round: dict[int, dict[str, int]] = {}
    for e in envs:
        if e.kind == "weights":  # a device's private update: one release
            by_round.setdefault(e.round, {}).setdefault(e.sender, 0)
            by_round[e.round][e.sender] += 1
    failed = [e.body["info"] for e in envs if e.kind == "done" and e.body["info"].get("failed")]
    records = [json.loads(line) for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
    # Check: every device released in both rounds (round 1's four failed), and the epsilon after
    # each round is that of the most releases a device had made by then
    assert sorted(by_round) == [1, 2] and all(len(by_round[r]) == 4 for r in (1, 2)), by_round
    assert [r["round"] for r in records] == [1, 2], records
    for r in records:
        made = {d: sum(by_round[q].get(d, 0) for q in by_round if q <= r["round"]) for d in by_round[1]}
        most = max(made.values())
        assert r["dp_releases_total"] == most, (r["round"], r.get("dp_releases_total"), made)
        assert r["dp_epsilon"] > 0 and r["dp_epsilon"] == pytest.approx(epsilon(sigma, most, 1e-5))
        assert not any(r["rejected"].get(edge) for edge in ("e0", "e1")), r["rejected"]
    assert len(failed) == 4 and all(i.get("dp_releases") == 1 for i in failed), failed  # each said what it released
    assert records[0].get("failures") == {"other": 4} and "failures" not in records[1], records


def test_a_done_that_comes_after_its_round_closed_still_enters_the_run_s_epsilon(mosquitto, tmp_path: Path,
                                                                                 monkeypatch) -> None:
    """As above, but in round 1 every device fails only after its round's deadline: its edge has
    closed the round without it, and counts the releases of the late `done` in its next one. The
    run's last epsilon is that of every release counted at the broker."""
    import torch

    from splitedge.methods.contract import DONE
    from splitedge.methods.errors import RoundFailed
    from splitedge.methods.fedavg.device import FedAvgDevice
    from splitedge.sim import SimSettings, run_sim

    torch.set_num_threads(1)
    real, deadline_s = FedAvgDevice.run_round, 8.0

    def fails_late(self, plan):
        for item in real(self, plan):
            if item is DONE and plan.round == 1:
                time.sleep(deadline_s + 3)
                raise RoundFailed("forced by the test after the deadline")
            yield item

    monkeypatch.setattr(FedAvgDevice, "run_round", fails_late)
    run, sigma = "late-release", 2.0
    capture = Capture(mosquitto, f"capture-{run}", topic=f"splitedge/{run}/#")
    try:
        run_sim(SimSettings(rounds=2, devices=4, edges=2, method="fedavg", broker=mosquitto.url, run=run,
                            out=tmp_path / run, max_train=400, max_test=100, deadline_s=deadline_s,
                            overrides={"dp_sigma": sigma, "dp_update_clip": 5.0}))
        time.sleep(0.3)
    finally:
        capture.close()
    envs = [decode(payload) for topic, payload, *_ in capture.messages if "/device/" in topic]
    made: dict[str, int] = {}
    for e in envs:
        if e.kind == "weights":
            made[e.sender] = made.get(e.sender, 0) + 1
    records = [json.loads(line) for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
    assert len(made) == 4 and set(made.values()) == {2}, made  # every device released in both rounds
    assert [r["round"] for r in records] == [1, 2], records
    assert records[-1]["dp_releases_total"] == max(made.values()), (records, made)
    assert records[-1]["dp_epsilon"] == pytest.approx(epsilon(sigma, max(made.values()), 1e-5))


def test_an_edge_s_reports_sum_to_the_most_one_device_released_when_a_done_comes_late() -> None:
    """What failed CI once (cflhkd, 3 releases a round): in round 2 device a's done came after the
    phase closed while b led; summing each phase's most, plus the late done's on top, counted a's
    round-2 releases twice (3 + 3 + 6 = 12 for 9 made). The ledger reports 3 + 3 + 3."""
    from splitedge.methods.privacy.floor import ReleaseLedger

    ledger, reported = ReleaseLedger(), []
    ledger.add("a", 3), ledger.add("b", 3)
    reported.append(ledger.take())  # round 1
    ledger.add("b", 3)
    reported.append(ledger.take())  # round 2 closes without a
    ledger.add("a", 3)  # a's late done of round 2
    ledger.add("a", 3), ledger.add("b", 3), ledger.add("c", "3")  # round 3; c's count is no count
    reported.append(ledger.take())
    assert reported == [3, 3, 3] and sum(reported) == max(ledger.made.values()) == 9
    assert ledger.take() == 0  # nothing new: nothing more to count
    restarted = ReleaseLedger()
    restarted.restore(ledger.state())  # a restarted edge carries its ledger on (its state file)
    restarted.add("a", 1)
    assert restarted.take() == 1 and restarted.made == {"a": 10, "b": 9}
