"""A cloud killed at every step of a round's commit (issue 30, item 4), by crash point
(runtime/faults.py), not by a sleep: cloud, 2 edges and 4 devices as processes on Mosquitto,
H-SFP with head calibration and W_c averaged every 2 rounds, the cloud dying in round 2 at the
named step and started again with its arguments.

Before, a cloud killed after publishing W_c version 1 but before committing resumed at version
0: edges then refused every device message as newer than the current and W_c was never
averaged again. Now what leaves the cloud is committed first, and a restart publishes the same
again: every round is logged once, every edge and device exits by itself, nothing is refused,
W_c's versions advance as in an undisturbed run and the accuracy is an undisturbed run's.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from federation import CRASH_ROUNDS, assert_undisturbed, run_with_crash, undisturbed_run
from splitedge.runtime.faults import CLOUD_POINTS

QUICK = ("cloud.committed", "cloud.metrics")
"""Run in the default suite: the step of the issue's crash, and one after the metrics line; the
others with -m slow."""


@pytest.fixture(scope="module")
def undisturbed(tmp_path_factory) -> list[dict]:
    return undisturbed_run(tmp_path_factory.mktemp("undisturbed"))


@pytest.mark.usefixtures("mosquitto_binary")
@pytest.mark.parametrize("point", [p if p in QUICK else pytest.param(p, marks=pytest.mark.slow) for p in CLOUD_POINTS])
def test_a_cloud_killed_at_a_step_of_its_commit_finishes_as_an_undisturbed_run(point: str, undisturbed,
                                                                                tmp_path: Path) -> None:
    # Execute: the cloud dies at the step, and is started again with its arguments
    fed, metrics = run_with_crash(tmp_path, "cloud", point)
    # Assert: both edges in every round, the restarted cloud resumed, and the run is undisturbed
    assert [m["edges"] for m in metrics] == [2] * CRASH_ROUNDS, fed.logs()
    assert "resuming run itest" in fed.log("cloud")
    assert_undisturbed(fed, metrics, undisturbed)
