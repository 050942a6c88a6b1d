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

log = logging.getLogger(__name__)

FORMAT = 2  # 1: the part's state taken by walking its attributes (before parts declared it)


def save(path: Path, *, run: str, node: str, session: str, round_: int, plan: dict[str, Any],
         part: dict[str, Any], rng: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {"format": FORMAT, "run": run, "node": node, "session": session, "round": round_, "plan": plan,
             "part": part, "rng": snapshot.to_plain(rng)}
    snapshot.write_atomic(path, snapshot.dumps(state))


def load(path: Path, *, run: str) -> dict[str, Any] | None:
    """The saved state, or None (no file, or not this run's: logged)."""
    if not path.exists():
        return None
    state = snapshot.loads(path.read_bytes())
    if not isinstance(state, dict) or state.get("format") != FORMAT or state.get("run") != run:
        log.warning("%s is not this run's state (or of another splitedge version); starting afresh", path)
        return None
    state["rng"] = snapshot.from_plain(state["rng"])
    return state
