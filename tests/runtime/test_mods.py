"""Mods (runtime/mods, issue 52 item 1): the chain's order and hooks, the shipped mods where each
node puts them, and a mod of one's own (`--plugin`) in a federation over a real broker, filtered
by private reports like every shipped entry."""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

from splitedge.methods.contract import Message, RoundPlan
from splitedge.protocol.done import DoneInfo
from splitedge.protocol.transport import LoopbackBus, LoopbackTransport
from splitedge.runtime.mods import Mod, ModChain, plugin_mods
from splitedge.runtime.mods.private import PrivateReports
from splitedge.runtime.plugin_args import use_plugins
from splitedge.runtime.uplink import payload_bytes

MODS = Path(__file__).resolve().parents[1] / "plugin_models"
PLAN = RoundPlan(round=1, method="fedavg", deadline_s=10.0, config={})


class Tag(Mod):
    """Records what passes; takes messages of kind `take`; adds its name to the done info."""

    def __init__(self, name: str, seen: list, take: str = "", state: int | None = None) -> None:
        self.name, self.seen, self.take, self.saved = name, seen, take, state

    def send(self, msg, call_next):
        self.seen.append((self.name, msg.kind))
        if msg.kind != self.take:
            call_next(msg)

    def done(self, plan, info, children):
        return info.with_mod("by", [*info.mods.get("by", []), self.name])

    def state(self):
        return self.saved

    def restore(self, state):
        self.saved = state


@pytest.fixture(autouse=True)
def plugin_mods_as_they_were(monkeypatch):
    import splitedge.runtime.mods as mods

    monkeypatch.setattr(mods, "_PLUGINS", [])


def test_the_first_mod_wraps_the_rest_and_a_mod_may_take_a_message() -> None:
    seen, sent = [], []
    chain = ModChain([Tag("a", seen), Tag("b", seen, take="secret"), Tag("c", seen)])
    chain.send(Message("weights", {}), sent.append)
    chain.send(Message("secret", {}), sent.append)
    assert seen == [("a", "weights"), ("b", "weights"), ("c", "weights"), ("a", "secret"), ("b", "secret")]
    assert [m.kind for m in sent] == ["weights"]  # b took the secret: neither c nor the node saw it
    assert chain.done(PLAN, DoneInfo()).mods["by"] == ["a", "b", "c"]  # folded first to last: a filter goes last


def test_state_by_name_and_the_pass_through_defaults() -> None:
    kept = Tag("ledger", [], state=7)
    chain = ModChain([kept, Tag("", [], state=3), Mod()])
    assert chain.state() == {"ledger": 7}  # a mod without a name keeps nothing
    kept.saved = None
    chain.restore({"ledger": 9})
    assert kept.saved == 9
    assert not chain.holds() and not chain.ticking() and chain.tick() == [] and chain.reports(PLAN) == []
    assert chain.vet(None) is None and chain.opened(PLAN) == []
    assert list(chain.work(PLAN, lambda plan: iter([1, 2]))) == [1, 2]


def test_private_reports_filter_what_a_mod_of_one_s_own_adds() -> None:
    import sys

    sys.path.insert(0, str(MODS))
    try:
        from sent_bytes import SentBytes
    finally:
        sys.path.remove(str(MODS))
    mod = SentBytes(None)
    mod.opened(PLAN)
    mod.leaving("up", "weights", {"w": b"x" * 100})
    mod.leaving("up", "done", {"phase": "train"})
    mod.leaving("down", "weights", {"w": b"x" * 100})
    sent = ModChain([mod]).done(PLAN, DoneInfo()).mods["sent_bytes"]
    assert sent == {"weights": [1, payload_bytes({"w": b"x" * 100})]}
    device = SimpleNamespace(part=SimpleNamespace(clear_info=()))
    info = DoneInfo(samples=40, loss={"ce": 1.0}, dp_releases=2, cost={"cpu_s": 1.5, "bytes_up": 10.0})
    private = ModChain([mod, PrivateReports(device)]).done(PLAN, info)
    assert private.to_info() == {"dp_releases": 2, "cost": {"bytes_up": 10.0}, "private_reports": True}


class Greedy(Mod):
    """Writes a field another mod owns (its `writes` says only `mods`)."""

    def done(self, plan, info, children):
        return info.but(cost={"cpu_s": 0.0})


def test_a_mod_may_write_only_the_fields_it_declares() -> None:
    """The done info is typed per mod: a mod that writes another's field is refused, by name."""
    with pytest.raises(TypeError, match="mod Greedy wrote cost of the done info, which its `writes` does not declare"):
        ModChain([Greedy()]).done(PLAN, DoneInfo())
    Greedy.writes = ("cost",)
    try:
        assert ModChain([Greedy()]).done(PLAN, DoneInfo()).cost == {"cpu_s": 0.0}
    finally:
        del Greedy.writes


def test_a_device_runs_its_owner_s_mods_before_private_reports(monkeypatch) -> None:
    """A plug-in mod is built with the node and sits after the shipped ones and before private
    reports; one that names no tier, or a mod of a tier the node is not, is refused or left out."""
    import numpy as np

    from splitedge.device.agent import DeviceAgent

    monkeypatch.syspath_prepend(str(MODS))
    use_plugins(["sent_bytes:SentBytes"])
    with pytest.raises(ValueError, match="`tiers` must name where it runs"):
        use_plugins(["sent_bytes:Nowhere"])
    data = (np.zeros((4, 8, 8, 1), np.uint8), np.arange(4) % 2)
    agent = DeviceAgent(LoopbackTransport(LoopbackBus(), role="device", client_id="d0"), run="r", node_id="d0",
                        edge="e0", data=data, private_reports=True)
    names = [type(m).__name__ for m in agent.mods.mods]
    assert names[-2:] == ["SentBytes", "PrivateReports"] and agent.mods.mods[-2].node is agent
    assert plugin_mods(agent, "edge") == []


def test_a_mod_of_one_s_own_reports_what_each_device_sent(mosquitto, tmp_path, monkeypatch) -> None:
    """`splitedge sim --plugin sent_bytes:SentBytes` over a real broker: every device's `done`
    says it sent one weights message that round, of the size an observer of the broker reads
    (within 1 %: the mod sizes the body before the codec, the observer after decoding it)."""
    from splitedge.protocol.mqtt import MqttTransport
    from splitedge.protocol.topics import pattern
    from splitedge.sim import SimSettings, run_sim

    monkeypatch.syspath_prepend(str(MODS))
    run, lock, weights, dones = "own-mod", threading.Lock(), {}, {}

    def record(topic, env) -> None:
        with lock:
            if env.kind == "weights":
                weights[(env.sender, env.round)] = payload_bytes({k: v for k, v in env.body.items() if k != "session"})
            elif env.kind == "done":
                dones[(env.sender, env.round)] = env.body["info"]

    observer = MqttTransport(mosquitto.url, client_id="observer-own-mod", role="observer")
    observer.subscribe(pattern(run, "device", "+", "up", "weights"), record)
    observer.subscribe(pattern(run, "device", "+", "up", "done"), record)
    try:
        summary = run_sim(SimSettings(rounds=2, devices=4, edges=2, method="fedavg", broker=mosquitto.url, run=run,
                                      plugins=("sent_bytes:SentBytes",), out=tmp_path / "run", deadline_s=120.0))
    finally:
        observer.close()
    assert summary["status"] == "complete", summary
    assert len(weights) == 8 and set(weights) <= set(dones), (sorted(weights), sorted(dones))
    for key, sent in weights.items():
        mine = dones[key]["mods"]["sent_bytes"]
        assert set(mine) == {"weights"}, (key, dones[key])
        messages, size = mine["weights"]
        assert messages == 1 and abs(size - sent) <= 0.01 * sent, (key, mine, sent)


def test_the_cloud_s_mods_write_the_round_s_record_and_one_of_one_s_own_joins_them(tmp_path, monkeypatch) -> None:
    """The cloud's chain (costs, privacy spent, failures, crash points) and a cloud mod of one's own
    (`--plugin edge_seconds:EdgeSeconds`) in a sim: each round's record has its entry, read off
    the edges' done records of that round's training phase."""
    import json

    from splitedge.sim import SimSettings, run_sim

    monkeypatch.syspath_prepend(str(MODS))
    summary = run_sim(SimSettings(rounds=2, devices=4, edges=2, method="fedavg", plugins=("edge_seconds:EdgeSeconds",),
                                  out=tmp_path / "run", deadline_s=120.0, max_train=400, max_test=100))
    assert summary["status"] == "complete", summary
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    for r in records:
        assert set(r["edge_seconds"]) == {"e0", "e1"}, r
        assert all(seconds >= 0 and reported == 2 for seconds, reported in r["edge_seconds"].values()), r
        assert set(r["device_costs"]) == {"d0", "d1", "d2", "d3"} and set(r["edge_costs"]) == {"e0", "e1"}, r


def test_a_round_s_cloud_mods_start_afresh_with_its_training_phase() -> None:
    from splitedge.runtime.guard import RoundGuard
    from splitedge.runtime.mods.budgets import Failures
    from splitedge.runtime.mods.costs import CloudCosts

    def edge_done(info: dict) -> SimpleNamespace:
        env = SimpleNamespace(body={"info": info})
        return SimpleNamespace(sender="e0", get=lambda kind: env if kind == "done" else None)

    guard = RoundGuard(who="cloud")
    chain = ModChain([CloudCosts(), Failures(guard)])
    calibrate = dataclasses.replace(PLAN, phase="calibrate")
    failed = edge_done({"devices": {"failed": {"memory": 1}, "cost": {"d0": {"bytes_up": 10.0}}}})
    chain.opened(PLAN)
    chain.phase_reports(PLAN, [failed])
    chain.phase_reports(calibrate, [edge_done({"devices": {"failed": {"time": 1}, "cost": {"d0": {"bytes_up": 5.0}}}})])
    guard.failures["memory"] = 1  # the cloud's own evaluation went over its guard
    assert chain.held(PLAN, []) == {"evaluation_failed": {"memory": 1}} and not guard.failures
    record = chain.record(PLAN, {"accuracy": 0.5})
    assert record["failures"] == {"memory": 1}  # the training phase's, not the calibration's
    assert record["device_costs"] == {"d0": {"bytes_up": 15}} and record["accuracy"] == 0.5  # both phases' bytes
    chain.opened(dataclasses.replace(PLAN, round=2))
    assert "failures" not in chain.record(PLAN, {}) and chain.record(PLAN, {})["device_costs"] == {}
