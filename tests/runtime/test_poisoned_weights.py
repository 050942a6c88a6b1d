"""One device multiplies its weights by 100 (each value inside the absolute bound): the issue's
row where FedAvg fell from 97.5 to 66.4 % and froze, every honest update refused once the
poisoned average pushed the global model beyond the bound. Over Mosquitto, FedAvg on digits
with 8 devices on 2 edges (the poison bench's run, bench/poison.py): the exact merge follows the
attacker but no honest update is refused (updates are bounded relative to the model they were
trained from); every robust rule holds the clean accuracy."""

from __future__ import annotations

import pytest
import torch

from splitedge.bench.poison import PoisonSettings, one_run

ROUNDS = 5
SETTINGS = PoisonSettings(method="fedavg", devices=8, edges=2, rounds=ROUNDS, max_test=300)


@pytest.fixture(scope="module")
def clean() -> dict:
    torch.set_num_threads(1)
    return one_run(SETTINGS, "none", 0, attacked=False)


def test_the_exact_merge_follows_the_attacker_but_refuses_no_honest_update(clean) -> None:
    hit = one_run(SETTINGS, "none", 0, attacked=True)
    assert hit["attacker_messages"] >= ROUNDS - 1, hit
    assert hit["final_accuracy"] < clean["final_accuracy"] - 0.2, (hit, clean)  # the attack works ...
    assert len(hit["accuracy_per_round"]) == ROUNDS
    assert "state.magnitude" not in hit["refused_by_node"].get("e1", {}), hit["refused_by_node"]  # ... e1 is honest


@pytest.mark.parametrize("robust", ["clip", "trimmed", "median"])
def test_every_robust_rule_holds_the_clean_accuracy(clean, robust: str) -> None:
    torch.set_num_threads(1)
    hit = one_run(SETTINGS, robust, 0, attacked=True)
    assert hit["attacker_messages"] >= ROUNDS - 1, hit
    assert hit["final_accuracy"] > clean["final_accuracy"] - 0.04, (robust, hit["accuracy_per_round"], clean)
    assert not hit["refused"], hit["refused"]  # held by the merge, not by refusals
