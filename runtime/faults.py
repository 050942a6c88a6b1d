"""Crash points for chaos tests: a process dies at a named step, as a kill -9 would leave it.

`SPLITEDGE_CRASH_AT=<point>:<round>` (e.g. `cloud.committed:2`) makes `crash_point(point,
round)` end the process at once with exit code 137 (no cleanup, no flush, no last will sent
cleanly): the chaos test restarts it and checks that the federation ends as an undisturbed one
would. Driven by the step, not by a sleep, so every step of a commit can be hit on purpose.
Unset (always, outside tests), a crash point is one dictionary lookup.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)

ENV = "SPLITEDGE_CRASH_AT"
CLOUD_POINTS = ("cloud.aggregated", "cloud.committed", "cloud.published", "cloud.calibrated", "cloud.metrics",
                "cloud.checkpoint")
"""The cloud's steps from a round's merge to its commit (cloud/driver.py, cloud/commit.py), in order."""
EDGE_POINTS = ("edge.aggregated", "edge.published", "edge.done", "edge.saved")
"""An edge's steps closing a round (edge/closing.py, through its CrashPoints mod), in order: merged,
merged statistics sent up, its `done` sent, its state saved."""


def crash_point(point: str, round_: int) -> None:
    """Die here if SPLITEDGE_CRASH_AT names this point and round."""
    wanted = os.environ.get(ENV)
    if wanted and wanted == f"{point}:{round_}":
        log.error("crash point %s at round %d: exiting as a kill -9 would (%s)", point, round_, ENV)
        logging.shutdown()
        os._exit(137)
