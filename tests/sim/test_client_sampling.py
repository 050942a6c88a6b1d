"""Client sampling (runtime/sampling.py): the draw and its rules, reproducible from the seed and
only among online devices; end to end over a real broker, devices not drawn send nothing and
edges do not wait for them; virtual devices sitting rounds out hold one copy of each model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from splitedge.runtime.sampling import Sampling


def test_the_draw_is_reproducible_from_the_seed_and_changes_with_round_and_seed() -> None:
    online = [f"d{i}" for i in range(40)]
    s = Sampling(fraction=0.1, seed=7)
    first = [s.draw(r, online) for r in range(1, 6)]
    assert first == [Sampling(fraction=0.1, seed=7).draw(r, reversed(online)) for r in range(1, 6)]  # order-free
    assert all(len(d) == 4 and len(set(d)) == 4 and set(d) <= set(online) for d in first)
    assert len(set(first)) > 1  # rounds differ
    assert [Sampling(fraction=0.1, seed=8).draw(r, online) for r in range(1, 6)] != first


def test_only_online_devices_are_drawn_and_the_size_rules_hold() -> None:
    online = {"d1", "d3", "d5"}
    assert set(Sampling(count=2).draw(1, online)) <= online
    assert Sampling(fraction=0.5).size(9) == 4  # int(), as Flower's fraction_fit
    assert Sampling(fraction=0.01, minimum=3).size(100) == 3
    assert Sampling(count=50).size(10) == 10  # never more than are online
    assert Sampling().draw(1, online) == () and not Sampling().active  # every device: no list on the wire
    assert Sampling(count=2).draw(1, []) == ()
    for bad in (dict(fraction=0.0), dict(fraction=1.5), dict(count=-1), dict(minimum=0)):
        with pytest.raises(ValueError, match="--sample"):
            Sampling(**bad)


def _sim(tmp: Path, **kw) -> tuple[dict, list[dict]]:
    import torch

    from splitedge.sim import SimSettings, run_sim

    torch.set_num_threads(1)
    s = SimSettings(rounds=3, devices=8, edges=2, method="fedavg", out=tmp, max_train=800, max_test=200,
                    sample_fraction=0.25, seed=5, **kw)
    summary = run_sim(s)
    return summary, [json.loads(line) for line in (tmp / "metrics.jsonl").read_text().splitlines()]


def test_devices_not_drawn_sit_the_round_out(tmp_path) -> None:
    summary, rounds = _sim(tmp_path / "a")
    # two of eight devices each round: the edges waited for them alone and the rounds closed on quorum
    assert [r["participants"] for r in rounds] == [2, 2, 2]
    assert summary["closed_on_quorum"]
    sent = summary["device_bytes_by_kind"]["out"]
    assert sent["weights"]["messages"] == 3 * 2 and sent["done"]["messages"] == 3 * 2
    # the samples merged are the drawn devices' own: a fraction of the 800 images
    assert all(0 < r["samples"] < 800 for r in rounds)
    # the same seed draws the same devices: the same accuracy every round
    again, rounds_again = _sim(tmp_path / "b")
    assert [r["accuracy"] for r in rounds_again] == [r["accuracy"] for r in rounds]
    assert [r["samples"] for r in rounds_again] == [r["samples"] for r in rounds]


def test_virtual_devices_sample_alike_and_keep_one_copy_of_each_model(tmp_path) -> None:
    plain, rounds = _sim(tmp_path / "plain")
    virtual, rounds_v = _sim(tmp_path / "virtual", virtual=1)
    assert [r["accuracy"] for r in rounds_v] == [r["accuracy"] for r in rounds]


def test_a_parked_host_keeps_the_newest_message_of_each_slot() -> None:
    import threading

    from splitedge.protocol.topics import topic
    from splitedge.sim.virtual import ParkingHost

    host = ParkingHost(lambda method: None, slots=threading.Semaphore(1))
    host.parked = b"state"  # as after end_round
    model, request = topic("r", "edge", "e0", "down", "weights-model"), topic("r", "edge", "e0", "down", "request", "d0")
    for event in ((model, "v1"), (request, "a"), (model, "v2"), (request, "b"), (model, "v3")):
        assert host.hold(event)
    assert host.held() == [(request, "a"), (request, "b"), (model, "v3")]
