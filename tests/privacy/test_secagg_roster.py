"""A roster the edge cannot choose, and no differencing (issue 53, items 1 and 2).

An edge runs its devices' secure sums. Before the fix an edge that lied could tell a device that
the roster was {that device, the edge itself}: the threshold fell to 1, a 1-of-1 share is the
secret, and the device's input came back exactly, signed or not. Here the edge lies, and each
test asserts what a device must do: refuse BEFORE any share leaves it, when the roster it gets
differs from the membership the cloud signed, holds a key that is not a device's, or is below
the minimum; and refuse to put one value into a second sum over another set of devices (the
difference of the two sums would be the left-out device's value).

The first tests drive one device's real `secure_send` against an edge scripted in the test
(every message the device sends is recorded); the last ones run a federation on a real
Mosquitto whose edge lies, and read what the devices publish off the broker.
"""

from __future__ import annotations

import collections
import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from splitedge.bench.secagg_cost import identities
from splitedge.methods.contract import Message, RoundFailed, RoundPlan
from splitedge.methods.privacy import secagg
from splitedge.protocol.codec import Envelope
from splitedge.runtime.secure_sum import ABORT, DOWN, agreement, secure_send

try:
    from splitedge.methods.privacy import roster as rosters
except ImportError:  # 52b8928, before the fix: no membership to carry; every attack below then succeeds
    rosters = None

RUN, SESSION, NAME = "run", "5e55", "weights.model"
IDS = ["d0", "d1", "d2", "d3"]


def _cfg(mode: str = "full", **kw: Any) -> SimpleNamespace:
    return SimpleNamespace(**{"secagg": mode, "secagg_min_devices": 3, "dp_devices": 1, "dp_sigma": 0.0, **kw})


def _plan(members: dict[str, list[str]], *, mode: str = "full", least: int = 3, signer: Any = None,
          round_: int = 1) -> RoundPlan:
    """The round plan as the cloud announces it: with the membership of each edge's secure sums,
    signed by `signer` (the cloud's identity, or whoever forges it)."""
    plan = RoundPlan(round=round_, method="fedavg", deadline_s=5.0, config={}, session=SESSION)
    if rosters is None:
        return plan
    return dataclasses.replace(plan, directives={rosters.ROSTER: rosters.directive(RUN, plan, mode, least, members,
                                                                                  signer)})


def _weights(value: float = 1.0) -> Message:
    return Message("weights", {"part": "model", "version": 1, "samples": 3,
                               "weights": {"x": np.full(3, value, np.float32)}})


class LyingEdge:
    """Edge e0 as a device sees it through `request`: whatever the device sends is recorded; its
    keys are answered with `roster` (a KeyRoster the edge made up), anything after with an abort."""

    def __init__(self, roster: Any) -> None:
        self.roster, self.sent = roster, []
        self.node = SimpleNamespace(refused=collections.Counter())  # the device whose exchange this is

    def request(self, msg: Message, kind: str, wait: float) -> Envelope:
        self.sent.append(msg.body["stage"])
        body = {"stage": DOWN[0], "batch": 0, "sum": NAME, "data": self.roster.to_body()} if msg.body["batch"] == 0 \
            else {"stage": ABORT, "batch": msg.body["batch"], "sum": NAME, "data": {"reason": "lied"}}
        return Envelope(kind=kind, run=RUN, round=1, sender="e0", body=body)


def _made_up(config: Any, ids: list[str], who: dict[str, Any], victim_keys: Any) -> Any:
    """A roster of the victim's real keys and keys the edge made for `ids` (signed with the key
    `who` holds for an id, when it holds one: the edge's own, in a signed federation)."""
    c, s, sigs = {victim_keys.device: victim_keys.c_public}, {victim_keys.device: victim_keys.s_public}, \
        {victim_keys.device: victim_keys.signature}
    for d in ids:
        keys = secagg.Device(d, config, who.get(d)).advertise_keys()
        c[d], s[d], sigs[d] = keys.c_public, keys.s_public, keys.signature
    return secagg.KeyRoster(c, s, None, sigs if victim_keys.signature is not None else None)


def _attack(plan: RoundPlan, cfg: Any, fake: list[str], who: dict[str, Any] | None = None,
            victim: str = "d0") -> tuple[LyingEdge, list, pytest.ExceptionInfo]:
    """The victim's secure send of its weights to an edge that answers its keys with a roster of
    its own keys and keys the edge made for `fake`."""
    who = who or {}
    published: list = []

    class Edge(LyingEdge):
        def request(self, msg: Message, kind: str, wait: float) -> Envelope:
            if msg.body["batch"] == 0 and self.roster is None:
                config = agreement(cfg, RUN, SESSION, plan, "e0", NAME)
                self.roster = _made_up(config, fake, who, secagg.AdvertiseKeys.from_body(msg.body["data"]))
            return super().request(msg, kind, wait)

    edge = Edge(None)
    with pytest.raises(RoundFailed) as failed:
        secure_send(_weights(), cfg=cfg, run=RUN, session=SESSION, plan=plan, node_id=victim, edge="e0",
                    num_classes=10, request=edge.request, publish=published.append, identity=who.get(victim))
    return edge, published, failed


# -- unsigned federations: what holds without keys -----------------------------------------------

def test_a_roster_of_the_device_and_its_edge_is_refused_before_any_share() -> None:
    # the attack: roster {d0, e0}, the edge's own keys beside the device's (t would be 1)
    edge, published, failed = _attack(_plan({"e0": IDS}), _cfg(), ["e0"])
    assert edge.sent == ["keys"] and published == []  # public keys only: no share, no masked input, no reveal
    assert "refused" in str(failed.value) and "e0" in str(failed.value), failed.value
    assert edge.node.refused == {"secagg.refused": 1}  # counted with the device's other refusals


def test_a_roster_below_the_minimum_is_refused_before_any_share() -> None:
    # the edge claims every other device dropped but one: a roster of two, under secagg_min_devices 3
    edge, published, failed = _attack(_plan({"e0": IDS}, mode="plus"), _cfg("plus"), ["d1"])
    assert edge.sent == ["keys"] and published == []
    assert "fewer than the 3" in str(failed.value), failed.value


def test_dp_devices_is_checked_before_the_keys_not_at_unmask_time() -> None:
    # dp_devices 5 with a membership of four: nothing leaves the device, not even its keys
    edge, published, failed = _attack(_plan({"e0": IDS}, least=5), _cfg(dp_devices=5), ["d1", "d2", "d3"])
    assert edge.sent == [] and published == []
    assert "fewer than the 5" in str(failed.value), failed.value


def test_a_roster_outside_the_membership_is_refused_before_any_share() -> None:
    # three ids, none an edge's, but two the edge made up: not among the devices the cloud named
    edge, published, failed = _attack(_plan({"e0": IDS}, mode="plus"), _cfg("plus"), ["d98", "d99"])
    assert edge.sent == ["keys"] and published == []
    assert "d98" in str(failed.value) and "membership" in str(failed.value), failed.value


# -- signed federations: the membership is the cloud's ---------------------------------------------

@pytest.fixture(scope="module")
def who() -> dict[str, Any]:
    """Every node's identity; keys carry their role (cloud, e0 and e1 edges, devices)."""
    return identities(["cloud", "e0", "e1", *IDS, "d4"])


def test_signed_a_roster_holding_the_edges_own_signed_keys_is_refused(who) -> None:
    # the edge signs its own keys, which every keyring holds: before the fix that passed
    edge, published, failed = _attack(_plan({"e0": IDS}, signer=who["cloud"]), _cfg(), ["e0"], who)
    assert edge.sent == ["keys"] and published == []
    assert "refused" in str(failed.value), failed.value


def test_signed_a_roster_holding_another_edges_key_is_refused_for_its_role(who) -> None:
    # e1 is no id of this plan's edges: only its key's role (edge) gives it away
    edge, published, failed = _attack(_plan({"e0": IDS}, signer=who["cloud"]), _cfg(), ["d1", "d2", "e1"], who)
    assert edge.sent == ["keys"] and published == []
    assert "of role edge" in str(failed.value), failed.value


def test_signed_a_membership_the_edge_signed_itself_is_refused_before_the_keys(who) -> None:
    # the edge writes the membership {d0, d1, d4... } and signs it with its own key
    edge, published, failed = _attack(_plan({"e0": ["d0", "d1", "d4"]}, signer=who["e0"]), _cfg(), ["d1", "d4"], who)
    assert edge.sent == [] and published == []
    assert "not signed by the cloud" in str(failed.value), failed.value


def test_signed_a_roster_with_a_device_the_cloud_did_not_name_is_refused(who) -> None:
    # d4 is a real device with a real signed key, but the cloud named d0..d2 for e0
    edge, published, failed = _attack(_plan({"e0": ["d0", "d1", "d2"]}, signer=who["cloud"]), _cfg(),
                                      ["d1", "d4"], {**who, "d4": who["d4"], "d1": who["d1"]})
    assert edge.sent == ["keys"] and published == []
    assert "d4" in str(failed.value) and "membership" in str(failed.value), failed.value


def test_signed_a_membership_below_the_minimum_is_refused_before_the_keys(who) -> None:
    edge, published, failed = _attack(_plan({"e0": ["d0", "d1"]}, signer=who["cloud"]), _cfg(), ["d1"], who)
    assert edge.sent == [] and published == []
    assert "fewer than the 3" in str(failed.value), failed.value


def test_the_threshold_follows_the_signed_membership_not_the_roster() -> None:
    # ten named devices: SecAgg's threshold is 5 (of 9 neighbours), so a roster of five (each
    # with 4 neighbours) cannot be used to hand out shares that fewer devices rebuild
    plan = _plan({"e0": [f"d{i}" for i in range(10)]})
    config = agreement(_cfg(), RUN, SESSION, plan, "e0", NAME)
    assert config.plan(10) == (9, 5)
    with pytest.raises(secagg.SecAggError, match="fewer than the threshold 5"):
        config.plan(5)


# -- differencing ---------------------------------------------------------------------------------

class HonestEdge:
    """Edge e0 running the real protocol with the victim (through `request`/`publish`) and the
    other devices of `others` (driven here); `result` is the sum the edge gets."""

    def __init__(self, plan: RoundPlan, cfg: Any, others: list[str]) -> None:
        self.config = agreement(cfg, RUN, SESSION, plan, "e0", NAME)
        self.server = secagg.Server(self.config, ["d0", *others])
        self.others = {d: secagg.Device(d, self.config) for d in others}
        self.sent: list[str] = []
        self.result = None

    def _reply(self, batch: int, data: Any) -> Envelope:
        return Envelope(kind="secagg", run=RUN, round=1, sender="e0",
                        body={"stage": DOWN[batch], "batch": batch, "sum": NAME, "data": data})

    def request(self, msg: Message, kind: str, wait: float) -> Envelope:
        batch, data = msg.body["batch"], msg.body["data"]
        self.sent.append(msg.body["stage"])
        if batch == 0:
            self.server.receive_keys(secagg.AdvertiseKeys.from_body(data))
            for d in self.others.values():
                self.server.receive_keys(d.advertise_keys())
            self.roster = self.server.roster()
            return self._reply(0, self.roster.to_body())
        if batch == 1:
            self.server.receive_shares(secagg.EncryptedShares.from_body(data))
            for d in self.others.values():
                self.server.receive_shares(d.share_keys(self.roster))
            inboxes = self.server.route_shares()
            for name, d in self.others.items():
                self.server.receive_masked(d.masked_input(inboxes[name], {"samples": np.array([3]),
                                                                          "w.x": np.full(3, 2.0)}))
            return self._reply(1, inboxes["d0"].to_body())
        self.server.receive_masked(secagg.MaskedInput.from_body(data))
        self.request_ = self.server.unmask_request()
        for d in self.others.values():
            self.server.receive_unmask(d.unmask(self.request_))
        return self._reply(2, self.request_.to_body())

    def publish(self, msg: Message) -> None:
        self.sent.append(msg.body["stage"])
        self.server.receive_unmask(secagg.UnmaskShares.from_body(msg.body["data"]))
        self.result = self.server.finish()


def test_a_value_goes_into_a_second_sum_only_over_the_same_devices() -> None:
    # round 1: d0's weights summed with d1..d3. Round 2: the edge asks again for the same value
    # (same W_c, same update) from everyone but d3: the difference of the two sums would be d3's
    # exact value. Each device refuses; here d0, before any share of the second sum leaves it.
    cfg = _cfg()
    first = HonestEdge(_plan({"e0": IDS}), cfg, ["d1", "d2", "d3"])
    secure_send(_weights(), cfg=cfg, run=RUN, session=SESSION, plan=_plan({"e0": IDS}), node_id="d0", edge="e0",
                num_classes=10, request=first.request, publish=first.publish)
    assert first.result is not None and first.result.devices == tuple(IDS)
    again = HonestEdge(_plan({"e0": IDS}, round_=2), cfg, ["d1", "d2"])
    with pytest.raises(RoundFailed, match="refused") as failed:
        secure_send(_weights(), cfg=cfg, run=RUN, session=SESSION, plan=_plan({"e0": IDS}, round_=2), node_id="d0",
                    edge="e0", num_classes=10, request=again.request, publish=again.publish)
    assert "would isolate" in str(failed.value), failed.value
    assert "shares" not in again.sent and "reveal" not in again.sent and again.result is None
    # the same value over the same four devices again is no difference: it goes through
    same = HonestEdge(_plan({"e0": IDS}, round_=3), cfg, ["d1", "d2", "d3"])
    secure_send(_weights(), cfg=cfg, run=RUN, session=SESSION, plan=_plan({"e0": IDS}, round_=3), node_id="d0",
                edge="e0", num_classes=10, request=same.request, publish=same.publish)
    assert same.result is not None
    # and a new value (the next round's update) goes into a sum over any devices
    fresh = HonestEdge(_plan({"e0": IDS}, round_=4), cfg, ["d1", "d2"])
    secure_send(_weights(5.0), cfg=cfg, run=RUN, session=SESSION, plan=_plan({"e0": IDS}, round_=4), node_id="d0",
                edge="e0", num_classes=10, request=fresh.request, publish=fresh.publish)
    assert fresh.result is not None and fresh.result.devices == ("d0", "d1", "d2")


# -- a federation on a real broker whose edge lies ------------------------------------------------

def _lying_roster(monkeypatch, made_up: list[str]) -> None:
    """Every edge's secure sums answer the devices' keys with a roster of the first device's real
    keys and keys the edge made for `made_up` ("e0": the edge's own, signed with its key in a
    signed federation), to every device: the issue's attack, run by the real edge."""
    original = secagg.Server.roster

    def roster(self, device=None):
        original(self, device)  # closes round 0 as the honest edge would
        if not hasattr(self, "lie"):
            victim = self._keys[self.devices[0]]
            self.lie = _made_up(self.config, made_up, {"e0": self.identity} if self.identity else {}, victim)
        return self.lie

    monkeypatch.setattr(secagg.Server, "roster", roster)


@pytest.mark.parametrize("mode, sign, made_up", [
    ("full", True, ["e0"]),  # a signed federation: the edge's own signed keys beside the victim's
    ("plus", False, ["d98", "d99"]),  # unsigned: two devices the edge made up, outside the membership
], ids=["signed-edge-key", "unsigned-made-up-devices"])
def test_on_a_real_broker_no_share_leaves_a_device_whose_edge_lies(mosquitto, tmp_path, monkeypatch, mode, sign,
                                                                   made_up) -> None:
    import torch

    from mqtt_capture import Capture
    from splitedge.protocol.codec import decode
    from splitedge.protocol.signing import split_trailer
    from splitedge.sim import SimSettings, run_sim

    torch.set_num_threads(1)
    _lying_roster(monkeypatch, made_up)
    run = f"lie-{mode}"
    capture = Capture(mosquitto, f"capture-{run}", topic=f"splitedge/{run}/device/+/up/secagg")
    try:
        run_sim(SimSettings(rounds=1, devices=4, edges=1, method="fedavg", broker=mosquitto.url, run=run,
                            out=tmp_path, max_train=200, max_test=100, deadline_s=30.0, sign=sign,
                            overrides={"secagg": mode}))
    finally:
        capture.close()
    sent = []
    for _topic, payload, *_ in capture.messages:
        parts = split_trailer(payload)
        env = decode(bytes(parts[0]) if parts else payload)
        sent.append((env.sender, env.body["stage"]))
    assert ("d0", "keys") in sent, sent  # the attack reached the victim: its keys went up, the roster came down
    assert not [s for s in sent if s[1] != "keys"], sent  # and nothing after them: no share, no masked input
    record = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert "failed" in record["secagg"]["e0"]["weights.model"], record["secagg"]


def test_on_a_real_broker_an_edge_that_asks_all_but_one_again_gets_no_second_sum(mosquitto, tmp_path,
                                                                                   monkeypatch) -> None:
    # H-SFP, W_c unchanged over rounds 1 and 2 (ic 5): every device sends its W_c moments in round
    # 1, inside one secure sum over d0..d3. In round 2 the edge asks d0, d1 and d2 (not d3) to
    # send them again, a legitimate request (`request moments`, for an edge that lost them): a
    # second sum over the three minus the first would be d3's exact counts and means. Each of
    # the three refuses before its shares go out, so the edge gets no second sum.
    import torch

    from mqtt_capture import Capture
    from splitedge.methods.contract import device as to_device
    from splitedge.methods.hsfp.edge import HSFPEdge
    from splitedge.protocol.codec import decode
    from splitedge.sim import SimSettings, run_sim

    def on_round_open(self, plan, members):
        if plan.round == 2 and plan.phase == "train":
            return [Message("request", {"what": "moments"}, to=to_device(d)) for d in sorted(members)[:-1]]
        return []

    monkeypatch.setattr(HSFPEdge, "on_round_open", on_round_open)
    torch.set_num_threads(1)
    run = "lie-resend"
    capture = Capture(mosquitto, f"capture-{run}", topic=f"splitedge/{run}/device/+/up/secagg")
    try:
        run_sim(SimSettings(rounds=2, devices=4, edges=1, method="hsfp", broker=mosquitto.url, run=run,
                            out=tmp_path, max_train=300, max_test=100, deadline_s=30.0,
                            overrides={"secagg": "full"}))
    finally:
        capture.close()
    sent = {}
    for _topic, payload, *_ in capture.messages:
        env = decode(payload)
        sent.setdefault(env.round, []).append((env.sender, env.body["sum"], env.body["stage"]))
    assert {(d, "moments.wc", "reveal") for d in IDS} <= set(sent[1]), sent[1]  # round 1's sum, all four
    assert {(d, "moments.wc", "keys") for d in IDS[:3]} <= set(sent[2]), sent.get(2)  # the resend reached them
    assert [s for s in sent[2] if s[1] == "moments.wc" and s[2] != "keys"] == [], sent[2]  # no share, no input
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert records[0]["secagg"]["e0"]["moments.wc"] == {"devices": 4, "dropped": 0}, records[0]
    assert "failed" in records[1]["secagg"]["e0"]["moments.wc"], records[1]["secagg"]


def test_signed_a_config_the_edge_changed_is_refused_before_the_keys(who) -> None:
    # the cloud's signature covers the run's config beside the membership: an edge that relays
    # the plan with the DP noise or the minimum lowered is caught before anything leaves
    signed = dataclasses.replace(_plan({"e0": IDS}), config={"dp_sigma": 1.0, "secagg_min_devices": 4})
    signed = _plan({"e0": IDS}, signer=who["cloud"]) if rosters is None else dataclasses.replace(
        signed, directives={rosters.ROSTER: rosters.directive(RUN, signed, "full", 4, {"e0": IDS}, who["cloud"])})
    lowered = dataclasses.replace(signed, config={"dp_sigma": 0.0, "secagg_min_devices": 2})
    edge, published, failed = _attack(lowered, _cfg(secagg_min_devices=2), ["d1", "d2", "d3"], who)
    assert edge.sent == [] and published == []
    assert "not signed by the cloud" in str(failed.value), failed.value


def test_keys_carry_their_role_from_generation_to_the_keyring(tmp_path: Path) -> None:
    # `splitedge keys generate --role` writes <node>.role beside each .pub; the keyring a node
    # loads from its --verify-keys folder knows each key's role, and refuses a role it does not know
    from splitedge.cli import main
    from splitedge.protocol.signing import load_keyring

    for role, nodes in (("cloud", ["cloud"]), ("edge", ["e0"]), ("device", ["d0", "d1"])):
        assert main(["keys", "generate", "--out", str(tmp_path), "--role", role, *nodes]) == 0
    ring = load_keyring(tmp_path)
    assert {n: ring.role(n) for n in ("cloud", "e0", "d0", "d1")} == {"cloud": "cloud", "e0": "edge", "d0": "device",
                                                                        "d1": "device"}
    (tmp_path / "d1.role").write_text("admin\n")
    with pytest.raises(ValueError, match="d1.role: the role must be one of device, edge, cloud"):
        load_keyring(tmp_path)


def test_a_sim_whose_edges_cannot_hold_the_minimum_is_refused_in_one_line() -> None:
    from splitedge.sim import SimSettings

    with pytest.raises(ValueError, match="--secagg full: a device takes part in no secure sum of fewer than 3 devices"):
        SimSettings(devices=4, edges=2, method="fedavg", overrides={"secagg": "full"})
    SimSettings(devices=4, edges=2, method="fedavg", overrides={"secagg": "full", "secagg_min_devices": 2})
    SimSettings(devices=6, edges=2, method="fedavg", overrides={"secagg": "plus"})
