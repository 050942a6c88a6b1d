"""What a cloud restarted after a crash resumes from: `resume.state` in its --out folder.

Written atomically after every round (write, fsync, rename) once that round's metrics line
and checkpoint are on disk, so it is the commit point of a round: a cloud killed at any moment
restarts from the last committed round, with the same session (edges and devices keep their
state and models), and announces the next round with a higher `attempt` so that nodes which
already worked on it under the dead cloud do it again for the new one. Metrics lines past the
committed round (written just before a crash) are dropped, so no round is ever doubled.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from splitedge.methods import snapshot

log = logging.getLogger(__name__)

STATE_FILE = "resume.state"
FORMAT = 2  # 1 walked the part's attributes; parts now declare their state. A format-1 file: pass --overwrite


@dataclass
class CloudState:
    """The cloud's own state beside its part's (`part`, methods.snapshot data): cloud/commit.py's
    Committer writes and restores it."""

    run: str
    method: str
    config: dict[str, Any]
    seed: int
    session: str
    round: int  # the last round whose metrics and checkpoint are written
    attempt: int = 0  # how many times this session was resumed
    enough_edges: int = 1
    placements: dict[str, Any] = field(default_factory=dict)
    rng: dict[str, Any] = field(default_factory=dict)
    part: dict[str, Any] = field(default_factory=dict)
    finished: bool = False
    format: int = FORMAT
    pending: dict[str, Any] | None = None
    """Round `round + 1` merged but not yet written: what it had measured so far and every
    message it published since the merge (its outbox), committed before any of them left, so a
    restarted cloud publishes the same again and finishes that round (RoundDriver.resume_round)."""
    downlink: dict[str, Any] | None = None
    """The downlink codec's bases and what it has not sent yet (runtime/downlink.py), as of the
    commit: a restarted cloud encodes its outbox again to the same bytes."""
    calibration: list[Any] | None = None
    """The last calibration's inputs and metrics, while a round with the same inputs reuses its
    head (cloud/calibration_phase.py): a resumed cloud reuses it as the undisturbed one would."""


def save(out: Path, state: CloudState) -> None:
    snapshot.write_sealed(Path(out) / STATE_FILE, snapshot.fields_of(state))


def load(out: Path) -> CloudState | None:
    """The state in `out`, or None when there is none. SnapshotError when it cannot be read."""
    path = Path(out) / STATE_FILE
    if not path.exists():
        return None
    try:
        data = snapshot.read_sealed(path)  # a flipped byte is refused, never a changed weight
    except snapshot.SnapshotError as exc:
        raise snapshot.SnapshotError(f"{exc}; pass --overwrite to start afresh") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise snapshot.SnapshotError(f"{path} is not a state file of this splitedge version (format "
                                     f"{data.get('format') if isinstance(data, dict) else '?'}, want {FORMAT}); "
                                     f"pass --overwrite to start afresh")
    try:
        return CloudState(**data)
    except TypeError as exc:
        raise snapshot.SnapshotError(f"{path} is damaged ({exc}); pass --overwrite to start afresh") from None


def check_same_run(state: CloudState, *, out: Path, run: str, method: str, config: dict[str, Any],
                   seed: int, rounds: int) -> None:
    """A resume must continue the same federation: one ValueError naming what differs."""
    for name, saved, given in (("--run", state.run, run), ("--method", state.method, method),
                               ("--seed", state.seed, seed)):
        if saved != given:
            raise ValueError(f"--out {out} holds run {state.run!r} ({state.method}, seed {state.seed}) stopped after "
                             f"round {state.round}; {name} {given} differs from its {saved}: restart it with the same "
                             f"arguments to resume, or pass --overwrite to start afresh")
    if json.dumps(state.config, sort_keys=True, default=str) != json.dumps(config, sort_keys=True, default=str):
        raise ValueError(f"--out {out} holds run {state.run!r} stopped after round {state.round}, with other method "
                         f"settings (model, data set or --set values differ); restart it with the same arguments to "
                         f"resume, or pass --overwrite to start afresh")
    if state.finished or state.round >= rounds:
        raise ValueError(f"--out {out} holds run {state.run!r}, which finished after round {state.round}; nothing to "
                         f"resume (pass --overwrite to start afresh, or more --rounds than {state.round} to go on)")


def committed_history(out: Path, last_round: int) -> list[dict[str, Any]]:
    """metrics.jsonl up to `last_round`, rewritten without any line past it (written by a cloud
    that died before committing that round) or cut short by the crash."""
    path = Path(out) / "metrics.jsonl"
    if not path.exists():
        return []
    kept, dropped = [], 0
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
            ok = isinstance(record, dict) and int(record["round"]) <= last_round
        except (ValueError, KeyError, TypeError):
            ok = False
        if ok and all(int(r["round"]) != int(record["round"]) for r in kept):
            kept.append(record)
        else:
            dropped += 1
    if dropped:
        log.warning("cloud: dropped %d metrics line(s) past round %d (written before the crash)", dropped, last_round)
        snapshot.write_atomic(path, "".join(json.dumps(r) + "\n" for r in kept).encode())
    return kept
