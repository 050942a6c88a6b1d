"""An edge's state on disk after each round, so a restarted edge carries on in the same session.

The file holds the node's session, its last round and announcement, its part (as the part
host keeps it: method, config and the part's declared state) and its randomness, written
atomically (runtime/outputs.py's write, fsync, rename). A file of another run, or of another
format, is not this node's: the edge starts afresh and says so.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from splitedge.methods import snapshot
from splitedge.methods.contract import RoundPlan

log = logging.getLogger(__name__)
status = logging.getLogger("splitedge.status")

FORMAT = 2  # 1: the part's state taken by walking its attributes (before parts declared it)


def save(path: Path | None, node: Any) -> None:
    """`node`'s state (an edge: its run, id, session, plan, part host and rng) at `path`, after
    each round (nothing without a path, or before the node has a round and a part)."""
    if path is None or node.plan is None or node.part is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {"format": FORMAT, "run": node.run_id, "node": node.node_id, "session": node.session,
             "round": node.plan.round, "plan": node.plan.to_body(), "part": node.host.state(),
             "rng": snapshot.to_plain(node.rng)}
    snapshot.write_sealed(path, state)


def resume(path: Path | None, node: Any) -> bool:
    """Put the state saved at `path` back into `node` (a round of the same session then carries
    on with it; a new session drops it, as ever); False when there is none of its run."""
    if path is None or not path.exists():
        return False
    try:
        state = snapshot.read_sealed(path)
    except snapshot.SnapshotError as exc:  # damaged: the cloud's round announcement brings the edge back
        log.warning("%s; starting afresh", exc)
        return False
    if not isinstance(state, dict) or state.get("format") != FORMAT or state.get("run") != node.run_id:
        log.warning("%s is not this run's state (or of another splitedge version); starting afresh", path)
        return False
    node.host.restore(state["part"])
    node.rng.bit_generator.state = snapshot.from_plain(state["rng"]).bit_generator.state  # after the build's draws
    node.session, node.round = state["session"], int(state["round"])
    node.plan = RoundPlan.from_body(node.round, state["plan"])
    status.info("%s %s: resuming session %s after round %d (%s)", node.tier, node.node_id, node.session, node.round,
                path)
    return True
