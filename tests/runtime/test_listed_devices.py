"""Counts that cannot be inflated, and sybils (issue 30, items 2 and 9). On a broker without the
ACL anyone can join an edge under a new id and announce any samples. With the operator's
manifest (`splitedge edge --manifest`; the sim's `listed_only`), an edge admits only the devices
it lists and bounds each by its entry: eight sybils sending 100x the global model change
nothing, and a listed device's hello cannot raise its weight."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from splitedge.bench.lib.rogues import ScaledWeights
from splitedge.bench.lib.simrun import run_on_mosquitto
from splitedge.protocol.codec import Envelope
from splitedge.runtime.allowance import Allowance, listed, manifest_allowances
from splitedge.runtime.membership import Members
from splitedge.sim import SimSettings

SYBILS = 8


class Sybils:
    """Eight new ids on edge e0, each sending 100x the global model and its `done`."""

    def __init__(self, url: str, run: str) -> None:
        self.devices = [ScaledWeights(url, run, node_id=f"s{i}") for i in range(SYBILS)]

    @property
    def sent(self) -> int:
        return sum(d.sent for d in self.devices)

    def close(self) -> None:
        for d in self.devices:
            d.close()


def _run(listed_only: bool, sybils: bool) -> tuple[dict, Sybils | None]:
    torch.set_num_threads(1)
    s = SimSettings(rounds=3, devices=4, edges=2, method="fedavg", max_test=300, run="sybil", deadline_s=60.0,
                    listed_only=listed_only)
    held: list[Sybils] = []

    def attach(url: str, run: str) -> Sybils:
        held.append(Sybils(url, run))
        return held[-1]

    res = run_on_mosquitto(s, check_sys=False, attach=attach if sybils else None)
    return res, held[0] if held else None


@pytest.fixture(scope="module")
def clean() -> dict:
    return _run(listed_only=False, sybils=False)[0]


def test_an_open_edge_admits_sybils(clean) -> None:
    res, sybils = _run(listed_only=False, sybils=True)
    assert sybils.sent >= SYBILS * 2  # they joined and were counted in rounds
    assert res["summary"]["final_accuracy"] < clean["summary"]["final_accuracy"] - 0.2, res["summary"]  # 98.0 -> 66.0 %


def test_an_edge_with_a_manifest_refuses_every_sybil_and_learns_what_it_learns_without(clean) -> None:
    res, sybils = _run(listed_only=True, sybils=True)
    # Assert: the same federation as without them, to the last digit ...
    assert res["summary"]["accuracy_per_round"] == clean["summary"]["accuracy_per_round"]
    assert sybils.sent >= SYBILS * 2  # they sent their weights every round, to an edge that does not read them
    # ... and e0 counted every sybil's hello, e1 (whose topics they never wrote) none
    rejected = res["per_round"][-1]["rejected"]
    assert rejected["e0"].get("hello.unlisted", 0) >= SYBILS, rejected
    assert "hello.unlisted" not in rejected.get("e1", {}), rejected


def _hello(sender: str, samples: int, classes: list[int]) -> Envelope:
    return Envelope("hello", "r", 0, sender, {"role": "device", "parent": "e0", "samples": samples, "backend": "torch",
                                              "classes": np.array(classes, dtype=np.int64), "groups": []})


def test_a_listed_devices_hello_cannot_raise_what_it_may_count() -> None:
    members = Members("e0", listed={"d0": listed(120, [50, 70, 0])})
    assert members.hello(_hello("d0", 12_000, [0, 1, 2]), addressed=True)
    assert members.samples["d0"] == 120  # the manifest's, not the hello's 100x
    a = members.allowances["d0"]
    assert a.classes == {0, 1} and a.class_counts == {0: 50, 1: 70}  # class 2: announced, not held
    assert not members.admits("d7") and not members.hello(_hello("d7", 10, [0]), addressed=True)
    assert "d7" not in members and members.hello_body("cloud")["samples"] == 120
    open_edge = Members("e0")
    open_edge.hello(_hello("d0", 12_000, [0, 1, 2]), addressed=True)
    assert open_edge.allowances["d0"] == Allowance(12_000, frozenset({0, 1, 2}))  # bounded by its hello only


def test_the_manifest_of_data_split_is_read_and_a_wrong_file_named(tmp_path) -> None:
    import json

    path = tmp_path / "manifest.json"
    path.write_text(json.dumps({"devices": [{"id": "d0", "samples": 3, "class_counts": [1, 0, 2]}]}))
    assert manifest_allowances(path) == {"d0": Allowance(3, frozenset({0, 2}), {0: 1, 2: 2})}
    with pytest.raises(ValueError, match="no such file"):
        manifest_allowances(tmp_path / "nope.json")
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="not a manifest written by `splitedge data split`"):
        manifest_allowances(tmp_path / "bad.json")
