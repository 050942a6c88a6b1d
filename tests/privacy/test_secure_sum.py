"""Secure aggregation on the wire (runtime/secure_sum.py): with `secagg` on, H-SFP's moments and
every head-statistics record reach an edge only inside a sum over the round's devices. The sum
is the clear merge (the run is the same, round for round), devices that drop out after sharing
their keys are unmasked from the others' shares, and a bad `secagg` message is refused and
counted without touching the sum."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from splitedge.bench.lib.rogues import RogueDevice
from splitedge.methods.calibration.stats import HeadStats, head_stats_arrays
from splitedge.methods.config import ModelSpec
from splitedge.methods.moments import ClassMoments, merge_moments, moments_from_body, moments_to_body
from splitedge.methods.contract import RoundPlan
from splitedge.methods.privacy import additive, secagg
from splitedge.methods.registry import default_config
from splitedge.protocol.codec import Envelope
from splitedge.protocol.errors import ProtocolError
from splitedge.protocol.topics import pattern
from splitedge.runtime.rounds import done_phase
from splitedge.runtime.secure_sum import agreement
from splitedge.sim import SimSettings, run_sim


def _sim(url: str, run: str, out: Path, *, secure: str, method: str = "hsfp-cal", devices: int = 4, edges: int = 2,
         deadline: float = 120.0, sign: bool = False) -> list[dict]:
    torch.set_num_threads(1)
    # two devices an edge: below the default secagg_min_devices (3), so these runs lower it
    overrides = {"secagg": secure, "secagg_min_devices": 2} if secure != "off" else {}
    if method.startswith("hsfp"):
        overrides["ic"] = 2  # W_c copies go up (inside a sum of their own) in round 2
    s = SimSettings(rounds=3, devices=devices, edges=edges, broker=url, run=run, out=out, method=method,
                    backends=("torch", "onnx") if method.startswith("hsfp") else ("torch",), max_train=600, max_test=300, deadline_s=deadline, overrides=overrides, sign=sign)
    run_sim(s)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_sum_forms_give_back_the_exact_merge() -> None:
    rng = np.random.default_rng(0)
    parts = []
    for n in (30, 1, 12):
        y = rng.integers(0, 4, n)
        x = rng.normal(3.0, 2.0, (n, 6))
        from splitedge.methods.moments import compute_moments
        parts.append(compute_moments(x, y))
    summed = {}
    for p in parts:
        for k, v in additive.moments_sums(moments_to_body(p, "f8"), 5).items():
            summed[k] = summed.get(k, 0) + v
    got, want = additive.moments_of_sums(summed), merge_moments(parts)
    assert got.classes.tolist() == want.classes.tolist() and (got.counts == want.counts).all()
    np.testing.assert_allclose(got.mean, want.mean, rtol=1e-12)
    np.testing.assert_allclose(got.var, want.var, rtol=1e-9)
    h = HeadStats(np.array([0, 2]), np.array([3, 4]), rng.normal(size=(2, 3)), np.eye(3) * 0.5)
    back = additive.head_stats_of_sums(additive.head_stats_sums(head_stats_arrays(h, "f8"), 4))
    np.testing.assert_allclose(back.cov, h.cov, atol=1e-12)
    assert additive.moments_of_sums({"counts": np.zeros(3, np.int64), "sums": np.zeros((3, 2)),
                                     "sumsq": np.zeros((3, 2))}).classes.tolist() == []
    assert isinstance(moments_from_body(moments_to_body(ClassMoments.empty(2))), ClassMoments)


def test_prototype_and_logit_sums_give_back_fedprotos_and_cflhkds_merges() -> None:
    from splitedge.methods.cflhkd.distill import merge_tables
    from splitedge.methods.fedproto.protos import merge_protos, protos_body

    rng = np.random.default_rng(1)
    held = [np.array([0, 2, 3]), np.array([2]), np.array([1, 2, 4])]
    protos = [(c, rng.integers(10, 50, len(c)), rng.normal(size=(len(c), 5))) for c in held]
    summed: dict = {}
    for c, n, mu in protos:
        for k, v in additive.prototype_sums(protos_body(c, n, mu, "f8", 1), 6).items():
            summed[k] = summed.get(k, 0) + v
    got = additive.prototypes_of_sums(summed)  # FedProto's edge: every device alike, counts = devices
    want = merge_protos([(c, np.ones(len(c), np.int64), mu) for c, _, mu in protos])
    assert got.classes.tolist() == want[0].tolist() == [0, 1, 2, 3, 4] and got.counts.tolist() == [1, 1, 3, 1, 1]
    np.testing.assert_allclose(got.mean, want[2], rtol=1e-12)
    tables = [(c, n, rng.normal(size=(len(c), 6))) for c, n, _ in protos]
    summed = {}
    for c, n, t in tables:
        for k, v in additive.logits_sums({"classes": c, "counts": n, "logits": t}, 6).items():
            summed[k] = summed.get(k, 0) + v
    classes, counts, logits = additive.logits_of_sums(summed)
    want_counts, want_logits = merge_tables(tables, 6)
    assert counts.tolist() == want_counts[classes].tolist() and classes.tolist() == [0, 1, 2, 3, 4]
    np.testing.assert_allclose(logits, want_logits[classes], rtol=1e-12)


@pytest.fixture(scope="module")
def clear(mosquitto, tmp_path_factory) -> list[dict]:
    return _sim(mosquitto.url, "sa-clear", tmp_path_factory.mktemp("clear"), secure="off")


@pytest.mark.parametrize("secure", ["full", "plus"])
def test_a_secure_run_is_the_clear_run(mosquitto, clear, tmp_path, secure: str) -> None:
    # torch and thin devices; each edge sees its two devices' moments and head statistics only as
    # a sum, which is their exact merge up to 2^-24: the seeded run is the same, round for round
    records = _sim(mosquitto.url, f"sa-{secure}", tmp_path / secure, secure=secure)
    for key in ("accuracy", "accuracy_calibrated", "calibrated"):
        assert [r[key] for r in records] == pytest.approx([r[key] for r in clear], abs=1e-9), key
    two = {"devices": 2, "dropped": 0}
    for r in records:  # moments when W_c changed (rounds 1 and 3: ic 2), its copies in round 2; the edge
        # keeps its sum of the current W_c's moments instead of asking each device again
        sums = {"weights.wc": two} if r["round"] == 2 else {"moments.wc": two}
        assert r["secagg"] == {e: sums for e in ("e0", "e1")}, r
        assert r["calibration_secagg"] == {e: {"arrays.head_stats": two} for e in ("e0", "e1")}, r
        assert not any(r["rejected"].get(e) for e in ("e0", "e1")), r["rejected"]
    assert "secagg" not in clear[0]


def test_a_signed_federations_secure_sums_take_the_signed_form_and_are_the_clear_run(mosquitto, clear, tmp_path,
                                                                                     monkeypatch) -> None:
    # every node signs (sim --sign): devices sign their keys and the consistency statement, check
    # their neighbours' keys and a quorum of signatures before revealing; the sums are unchanged
    from splitedge.methods.privacy import secagg as module

    signed: list[str] = []
    sign = module.Device.sign_request
    monkeypatch.setattr(module.Device, "sign_request", lambda self, request: signed.append(self.id) or sign(self, request))
    records = _sim(mosquitto.url, "sa-signed", tmp_path / "signed", secure="plus", sign=True)
    assert json.loads((tmp_path / "signed" / "summary.json").read_text())["signed"] is True
    for key in ("accuracy", "accuracy_calibrated", "calibrated"):
        assert [r[key] for r in records] == pytest.approx([r[key] for r in clear], abs=1e-9), key
    assert all(r["calibration_secagg"] == {e: {"arrays.head_stats": {"devices": 2, "dropped": 0}} for e in ("e0", "e1")}
               for r in records), records
    assert not any(r["rejected"].get(e) for r in records for e in ("e0", "e1")), [r["rejected"] for r in records]
    # each round: one statement per device for its statistics and one for its head statistics
    assert sorted(set(signed)) == ["d0", "d1", "d2", "d3"] and len(signed) == 3 * 4 * 2, signed


def test_fedavg_models_summed_securely_are_the_clear_average(mosquitto, tmp_path) -> None:
    clear_run = _sim(mosquitto.url, "sa-fedavg-clear", tmp_path / "clear", secure="off", method="fedavg", devices=6)
    secure = _sim(mosquitto.url, "sa-fedavg", tmp_path / "secure", secure="plus", method="fedavg", devices=6)
    assert [r["accuracy"] for r in secure] == pytest.approx([r["accuracy"] for r in clear_run], abs=1e-9)
    assert all(r["secagg"] == {e: {"weights.model": {"devices": 3, "dropped": 0}} for e in ("e0", "e1")}
               for r in secure), secure
    # a survivor whose shares come after the sum was rebuilt from the others' is not refused
    assert not any(r["rejected"].get(e) for r in secure for e in ("e0", "e1")), [r["rejected"] for r in secure]


@pytest.mark.parametrize("method, sums", [("fedproto", ("moments.rep",)), ("cflhkd", ("logits.mean", "weights.model"))])
def test_prototypes_and_logits_summed_securely_are_the_clear_merge(mosquitto, tmp_path, method: str, sums) -> None:
    # FedProto's prototypes (a mean over devices, each alike) and CFLHKD's class-wise logits and
    # models reach the edge only as sums; CFLHKD's clustering signal stays per device (the cloud
    # compares devices by it)
    clear_run = _sim(mosquitto.url, f"sa-{method}-clear", tmp_path / "clear", secure="off", method=method)
    secure = _sim(mosquitto.url, f"sa-{method}", tmp_path / "secure", secure="full", method=method)
    assert [r["accuracy"] for r in secure] == pytest.approx([r["accuracy"] for r in clear_run], abs=1e-9)
    two = {"devices": 2, "dropped": 0}
    assert all(r["secagg"] == {e: dict.fromkeys(sums, two) for e in ("e0", "e1")} for r in secure), secure
    assert not any(r["rejected"].get(e) for r in secure for e in ("e0", "e1"))


def test_a_method_with_nothing_to_sum_securely_is_refused_before_round_1() -> None:
    from splitedge.cloud.options import build_run_config
    from splitedge.methods.data.datasets import load_dataset

    info = load_dataset("digits", max_train=10, max_test=10)[2]
    with pytest.raises(ValueError, match="secagg covers"):
        build_run_config("scaffold", info, None, 0, {"secagg": "full"})
    with pytest.raises(ValueError, match="robust merge"):
        default_config("hsfp", ModelSpec(), secagg="full", robust="median")
    build_run_config("scaffold", info, None, 0, {"secagg": "full", "calibrate": "lda"})  # head statistics
    build_run_config("fedavg", info, None, 0, {"secagg": "full"})  # its models


class Quitter(RogueDevice):
    """A device of edge e0 that takes part in the secure sum of the moments of each new W_c (as an
    honest device sends them) up to its shares, then leaves it (`done`, failed): the edge must remove the masks the others added
    towards it, from their shares of its key. With `garbage`, it first sends a malformed one."""

    def __init__(self, url: str, run: str, node_id: str, garbage: bool = False) -> None:
        self.garbage, self.me, self.plan, self.wc_version = garbage, None, None, -1
        self.lock = threading.Lock()
        super().__init__(url, run, node_id=node_id, parent="e0", samples=50)
        self.t.subscribe(pattern(run, "edge", "e0", "down", "secagg"), self.on_secagg)
        self.t.subscribe(pattern(run, "edge", "e0", "down", "secagg", to=node_id), self.on_secagg)

    def on_round(self, env: Envelope) -> None:
        plan = RoundPlan.from_body(env.round, env.body)
        with self.lock:
            self.plan = plan
            fresh = plan.version("wc") != self.wc_version  # as an honest device: moments when W_c changed
            self.wc_version = plan.version("wc")
            if plan.phase != "train" or not fresh:
                self.say("done", {"phase": done_phase(plan.phase), "info": {}, "session": plan.session}, plan.round)
                return
            cfg = SimpleNamespace(secagg="full")
            self.me = secagg.Device(self.node_id, agreement(cfg, self.run, plan.session, plan, "e0", "moments.wc"))
            if self.garbage:
                self.say("secagg", {"stage": "keys", "batch": 0, "sum": "moments.wc",
                                    "data": {"device": self.node_id, "c": b"x"},
                                    "session": plan.session}, plan.round)
            self.say("secagg", {"stage": "keys", "batch": 0, "sum": "moments.wc",
                                "data": self.me.advertise_keys().to_body(), "session": plan.session}, plan.round)

    def on_secagg(self, _topic: str, env: Envelope) -> None:
        with self.lock:
            if self.me is None or self.plan is None or env.round != self.plan.round or env.body["sum"] != "moments.wc":
                return
            if env.body["stage"] == "roster":
                shares = self.me.share_keys(secagg.KeyRoster.from_body(env.body["data"]))
                self.say("secagg", {"stage": "shares", "batch": 1, "sum": "moments.wc", "data": shares.to_body(),
                                    "session": self.plan.session}, env.round)
            elif env.body["stage"] == "inbox":  # leave before masking its input
                self.me = None
                self.say("done", {"phase": "round", "info": {"failed": True}, "session": self.plan.session},
                         env.round)


def test_devices_that_leave_after_sharing_their_keys_are_unmasked_from_the_others(mosquitto, tmp_path) -> None:
    # one edge, four honest devices and two that leave after sharing their keys: the edge's sum
    # is the four honest devices' exactly, so the run is the clear one without the two
    run = "sa-drop"
    clean = _sim(mosquitto.url, "sa-drop-clean", tmp_path / "clean", secure="off", method="hsfp", edges=1,
                 deadline=40.0)
    quitters = [Quitter(mosquitto.url, run, "d8", garbage=True), Quitter(mosquitto.url, run, "d9")]
    try:
        records = _sim(mosquitto.url, run, tmp_path / "drop", secure="full", method="hsfp", edges=1, deadline=40.0)
    finally:
        for q in quitters:
            q.close()
    assert [r["accuracy"] for r in records] == pytest.approx([r["accuracy"] for r in clean], abs=1e-9)
    for r in records:  # moments go up when W_c changed (rounds 1 and 3; ic 2), with the quitters in the sum
        if r["round"] != 2:
            assert r["secagg"]["e0"]["moments.wc"] == {"devices": 4, "dropped": 2}, r
    assert records[-1]["rejected"]["e0"].get("secagg.keys", 0) >= 1, records[-1]["rejected"]


def test_a_survivors_late_shares_are_not_refused_but_a_strangers_are() -> None:
    # an edge's SecureSum with five devices under SecAgg+ (threshold below five): the sum is
    # rebuilt before the last survivor's shares arrive; those are dropped quietly, while shares
    # from a device outside the sum are still refused
    from splitedge.runtime.secure_sum import SecureSum

    ids = [f"d{i}" for i in range(5)]
    plan = RoundPlan(round=1, method="fedavg", deadline_s=60.0, config={})
    config = agreement(SimpleNamespace(secagg="plus"), "run", "s", plan, "e0", "moments.wc")
    edge = SecureSum("e0", plan, config, set(ids), name="moments.wc")
    devices = {d: secagg.Device(d, config) for d in ids}

    def up(d: str, batch: int, data: dict, **extra) -> list:
        env = Envelope(kind="secagg", run="run", round=1, sender=d,
                       body={"stage": ["keys", "shares", "masked", "reveal"][batch], "batch": batch,
                             "sum": "moments.wc", "data": data, **extra})
        return edge.on_message(env)

    for d in ids:
        out = up(d, 0, devices[d].advertise_keys().to_body())
    roster = secagg.KeyRoster.from_body(out[0].body["data"])
    for d in ids:
        out = up(d, 1, devices[d].share_keys(roster).to_body())
    inbox = {m.to.node: secagg.ShareInbox.from_body(m.body["data"]) for m in out}
    meta = {"kind": "weights", "part": "model", "version": 1, "dtypes": {"x": "<f4"}}
    for d in ids:
        out = up(d, 2, devices[d].masked_input(inbox[d], {"samples": np.array([1]), "w.x": np.ones(3)}).to_body(),
                 meta=meta)
    request = secagg.UnmaskRequest.from_body(out[0].body["data"])
    replies = {d: devices[d].unmask(request).to_body() for d in ids}
    for d in ids[:-1]:
        up(d, 3, replies[d])
    assert edge.result is not None, "the sum is rebuilt from four devices' shares"
    assert up(ids[-1], 3, replies[ids[-1]]) == []
    with pytest.raises(ProtocolError, match="closed"):
        up("d9", 3, replies[ids[-1]])


@pytest.mark.parametrize("reply, reason", [
    ("abort", "edge e0 aborted the secure sum: too few devices"),
    ("timeout", "TimeoutError"),
])
def test_a_secure_sum_that_breaks_fails_the_devices_round_in_one_line(reply: str, reason: str) -> None:
    # a device's secure send of its weights: the edge aborts the sum, or never replies; either is
    # the round's known failure (RoundFailed: the node logs its message, no traceback), naming the sum
    from splitedge.methods.contract import Message, RoundFailed
    from splitedge.runtime.secure_sum import ABORT, secure_send

    plan = RoundPlan(round=1, method="fedavg", deadline_s=1.0, config={})
    msg = Message("weights", {"part": "model", "version": 1, "samples": 3, "weights": {"x": np.ones(3, np.float32)}})
    published = []

    def request(out: Message, kind: str, wait: float) -> Envelope:
        if reply == "timeout":
            raise TimeoutError
        return Envelope(kind=kind, run="run", round=1, sender="e0",
                        body={"stage": ABORT, "data": {"reason": "too few devices"}})

    with pytest.raises(RoundFailed, match="the secure sum of weights.model with edge e0 failed") as failed:
        secure_send(msg, cfg=SimpleNamespace(secagg="plus"), run="run", session="s", plan=plan, node_id="d0",
                    edge="e0", num_classes=10, request=request, publish=published.append)
    assert reason in str(failed.value) and published == []
