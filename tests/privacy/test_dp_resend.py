"""Under DP, a resend is a new release and is accounted (issue 53, item 2).

An H-SFP edge may ask its devices for their moments again (`request`, what=moments: it lost
them). With `dp_sigma` > 0 the device computes them afresh, with fresh noise: a second release
of the same statistics, which must enter the epsilon the cloud reports. The differencing guard
of secure sums (methods/privacy/roster.py) refuses a second sum of the same value over another
set of devices; a fresh release is another value, so under DP the resend goes through, and it is
counted like any other. Releases are counted here at the broker, as the devices' messages and
secure-sum inputs, independently of the devices' own `dp_releases`.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch

from mqtt_capture import Capture
from splitedge.methods.contract import Message, device as to_device
from splitedge.methods.hsfp.edge import HSFPEdge
from splitedge.methods.privacy.accountant import epsilon
from splitedge.protocol.codec import decode
from splitedge.sim import SimSettings, run_sim

SIGMA = 1.0
DP = {"dp_sigma": SIGMA, "dp_clip": 20.0, "dp_update_clip": 20.0}
DEVICES = ("d0", "d1", "d2", "d3")


def _ask_all_but_the_last_again(monkeypatch) -> None:
    """In round 2 (W_c unchanged: ic 5), the edge asks d0, d1 and d2, not d3, for their moments again."""
    def on_round_open(self, plan, members):
        if plan.round == 2 and plan.phase == "train":
            return [Message("request", {"what": "moments"}, to=to_device(d)) for d in sorted(members)[:-1]]
        return []

    monkeypatch.setattr(HSFPEdge, "on_round_open", on_round_open)


def _run(mosquitto, tmp_path: Path, run: str, topic: str, **overrides) -> tuple[list[dict], list]:
    torch.set_num_threads(1)
    capture = Capture(mosquitto, f"capture-{run}", topic=f"splitedge/{run}/device/+/up/{topic}")
    try:
        run_sim(SimSettings(rounds=2, devices=4, edges=1, method="hsfp", broker=mosquitto.url, run=run, out=tmp_path,
                            backends=("torch", "onnx"), max_train=400, max_test=100, deadline_s=60.0,
                            overrides={"ic": 5, **DP, **overrides}))
    finally:
        capture.close()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    return records, [decode(payload) for _topic, payload, *_ in capture.messages]


def _most_of_one_device(sent: Counter) -> int:
    """The run's releases of the device that released the most, summed round by round as the
    cloud bounds them (the most of one device each round)."""
    rounds = {r for r, _ in sent}
    return sum(max(n for (r, _), n in sent.items() if r == rnd) for rnd in rounds)


def test_a_resend_in_the_clear_is_a_release_the_cloud_counts(mosquitto, tmp_path, monkeypatch) -> None:
    _ask_all_but_the_last_again(monkeypatch)
    records, sent = _run(mosquitto, tmp_path, "dp-resend", "moments")
    moments = Counter((env.round, env.sender) for env in sent)
    # the broker saw: round 1 every device's moments, round 2 the three asked again (W_c unchanged)
    assert moments == Counter({**{(1, d): 1 for d in DEVICES}, **{(2, d): 1 for d in DEVICES[:3]}}), moments
    assert [r["dp_releases_total"] for r in records] == [1, 2] == [1, _most_of_one_device(moments)], records
    assert records[1]["dp_epsilon"] == pytest.approx(epsilon(SIGMA, 2, 1e-5))
    assert records[1]["dp_epsilon"] > records[0]["dp_epsilon"] == pytest.approx(epsilon(SIGMA, 1, 1e-5))


def test_in_a_secure_sum_the_fresh_release_passes_the_differencing_guard_and_is_counted(mosquitto, tmp_path,
                                                                                         monkeypatch) -> None:
    # Without DP the same request makes d0..d2 refuse the second sum (test_secagg_roster.py): the
    # difference of the two would be d3's exact moments. Under DP each resend carries fresh noise:
    # a second release, not the same value, so the sum runs over the three; the difference of
    # the two sums is d3's one release plus six devices' noise, and each of d0..d2 made two
    # releases, both counted.
    _ask_all_but_the_last_again(monkeypatch)
    records, sent = _run(mosquitto, tmp_path, "dp-resend-secagg", "secagg", secagg="full")
    inputs = Counter((env.round, env.sender) for env in sent
                     if env.body["sum"] == "moments.wc" and env.body["stage"] == "masked")
    assert inputs == Counter({**{(1, d): 1 for d in DEVICES}, **{(2, d): 1 for d in DEVICES[:3]}}), inputs
    assert [r["secagg"]["e0"]["moments.wc"] for r in records] == [{"devices": 4, "dropped": 0},
                                                                  {"devices": 3, "dropped": 0}], records
    assert [r["dp_releases_total"] for r in records] == [1, 2] == [1, _most_of_one_device(inputs)], records
    assert records[1]["dp_epsilon"] == pytest.approx(epsilon(SIGMA, 2, 1e-5))
