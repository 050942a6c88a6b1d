"""A regulariser is switched on by config for ANY registered method (generated from the registry):
`feddecorr_beta` > 0 adds the FedDecorr term where the method trains a representation, and the
term shows, per tier, in the round's logged loss."""

from __future__ import annotations

import json
import math

import pytest
import torch

from parts import shipped_methods
from splitedge.sim import SimSettings, run_sim


@pytest.mark.parametrize("method", shipped_methods())
def test_feddecorr_switches_on_for_every_method_and_is_logged(method: str, tmp_path, mosquitto) -> None:
    torch.set_num_threads(1)
    s = SimSettings(rounds=1, devices=2, edges=1, method=method, broker=mosquitto.url, run=f"decorr-{method}",
                    out=tmp_path, max_train=200, max_test=100, deadline_s=60.0, overrides={"feddecorr_beta": "0.1"})
    run_sim(s)
    (record,) = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    with_term = {tier: losses for tier, losses in record["loss"].items() if "feddecorr" in losses}
    assert with_term, record["loss"]
    for losses in with_term.values():  # a mean squared correlation: positive unless perfectly whitened
        assert losses["feddecorr"] > 0 and math.isfinite(losses["total"])
