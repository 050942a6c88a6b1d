"""A node's state on disk, so a restarted edge (after each of its rounds) or a resumed sim (every
node, at each round's end: splitedge/sim/resume.py) carries on in the same session.

The file holds the node's session, its last round, its part (as the part host keeps it: method,
config and the part's declared state), its randomness and its role's own (an edge's round
announcement; a device's last round, placement and held messages), written
atomically (runtime/outputs.py's write, fsync, rename). A file of another run, or of another
format, is not this node's: the edge starts afresh and says so.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from splitedge.methods import snapshot

log = logging.getLogger(__name__)
status = logging.getLogger("splitedge.status")

FORMAT = 2  # 1: the part's state taken by walking its attributes (before parts declared it)


def state_of(node: Any) -> dict[str, Any]:
    """`node`'s state as plain data: its run, id, session, round, part host (None before it has
    a part) and rng, and what its role keeps beside them (`own_state`: an edge's plan, a
    device's last round, placement and the messages kept for its parked part)."""
    return {"format": FORMAT, "run": node.run_id, "node": node.node_id, "session": node.session,
            "round": node.round, "part": node.host.state() if node.host.loaded else None,
            "rng": snapshot.to_plain(node.rng), **node.own_state()}


def save(path: Path | None, node: Any) -> None:
    """`node`'s state (state_of) at `path`, after each round (nothing without a path, or
    before the node has a round and a part)."""
    if path is None or node.plan is None or node.part is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    snapshot.write_sealed(path, state_of(node))


def put_back(state: Any, node: Any, where: str) -> bool:
    """`state` (state_of's) back into `node`, before it starts: a round of the same session then
    carries on with it (a new session drops it, as ever). False, with a warning, when it is not
    this run's node state (or of another format)."""
    if not isinstance(state, dict) or state.get("format") != FORMAT or state.get("run") != node.run_id \
            or state.get("node", node.node_id) != node.node_id:
        log.warning("%s is not this run's state of %s %s (or of another splitedge version); starting afresh", where,
                    node.tier, node.node_id)
        return False
    node.session, node.round = state["session"], int(state["round"])
    node.restore_own(state)  # first: a part built now sees the node as it was (a device's placement)
    if state["part"] is not None:
        node.host.restore(state["part"])
    node.rng.bit_generator.state = snapshot.from_plain(state["rng"]).bit_generator.state  # after the build's draws
    return True


def resume(path: Path | None, node: Any) -> bool:
    """Put the state saved at `path` back into `node`; False when there is none of its run."""
    if path is None or not path.exists():
        return False
    try:
        state = snapshot.read_sealed(path)
    except snapshot.SnapshotError as exc:  # damaged: the cloud's round announcement brings the edge back
        log.warning("%s; starting afresh", exc)
        return False
    if not put_back(state, node, str(path)):
        return False
    status.info("%s %s: resuming session %s after round %d (%s)", node.tier, node.node_id, node.session, node.round,
                path)
    return True
