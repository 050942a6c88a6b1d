"""A sim that carries on after its last finished round: `splitedge sim --resumable`.

A sim holds every node in one process, so a kill (a session's end, an out-of-memory, Ctrl-C)
takes the cloud, the edges and the devices at once; the cloud's own resume state (cloud/resume.py)
is no help when the edges and devices it expects to find are gone with it. With `--resumable`,
at the end of every round (the cloud's `on_round`, after its own state is written) the sim
waits until every node is idle (nothing queued or being handled, no message arriving for
SETTLE_S: the round's last models have reached every device) and writes one sealed file,
`sim.state`: the cloud's state, every edge's and device's (runtime/statefile.py: its part, its
randomness, its last round; a parked device's bytes as they are), their connections' byte
counters and the wall time so far. That file is the sim's commit point: restarted with the same
command, the sim puts the cloud back at that round (its later metrics lines are dropped) and
every node back as it was, on a fresh broker, and the run carries on as it would have
(tests/sim/test_sim_resume.py: two rounds, a kill, two more equal four in one go).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import Any, Iterable

from splitedge.methods import snapshot
from splitedge.runtime import statefile

log = logging.getLogger(__name__)
status = logging.getLogger("splitedge.status")

SIM_STATE = "sim.state"
FORMAT = 1
SETTLE_S = 0.5  # no message arriving anywhere and every node idle for this long: the round is over everywhere
SETTLE_MAX_S = 300.0  # never quiet within this: the round's snapshot is skipped (the previous one stays)


@dataclasses.dataclass
class SimState:
    """What `sim.state` holds (see the module docstring)."""

    run: str
    round: int
    cloud: dict[str, Any]  # cloud.resume.CloudState's fields
    nodes: dict[str, Any]  # node id -> statefile.state_of(node)
    counters: dict[str, Any]  # "tier/node" -> each of its connections' ByteCounters.state()
    wall_seconds: float
    device_bytes_rows: list[Any]  # sim.PerDeviceBytes.rows
    format: int = FORMAT


def load(out: Path) -> SimState | None:
    """The sim state in `out`, or None; SnapshotError (saying to pass --overwrite) when unreadable."""
    path = Path(out) / SIM_STATE
    if not path.exists():
        return None
    try:
        data = snapshot.read_sealed(path)
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise snapshot.SnapshotError(f"{path} is not a sim state of this splitedge version")
        return SimState(**data)
    except (snapshot.SnapshotError, TypeError) as exc:
        raise snapshot.SnapshotError(f"cannot resume from {path} ({exc}); pass --overwrite to start afresh") from None


def cloud_state(saved: SimState) -> Any:
    """The cloud's state as of the sim's last committed round."""
    from splitedge.cloud.resume import CloudState

    return CloudState(**saved.cloud)


def quiet(nodes: Iterable[Any], transports: Iterable[Any], settle_s: float = SETTLE_S,
          most_s: float = SETTLE_MAX_S) -> bool:
    """Wait until every node is idle and no connection received a message for `settle_s`;
    False when that did not happen within `most_s`."""
    nodes, transports = list(nodes), list(transports)
    deadline = time.monotonic() + most_s
    seen, since = None, time.monotonic()
    while time.monotonic() < deadline:
        count = sum(t.counters.total("in", "messages") for t in transports)
        if count != seen or not all(n.idle for n in nodes):
            seen, since = count, time.monotonic()
        elif time.monotonic() - since >= settle_s:
            return True
        time.sleep(0.05)
    return False


class Snapshots:
    """The round callback that writes `sim.state` (chained after the sim's own); `cloud` is the
    sim's coordinator, set once it exists (its settings carry this callback)."""

    def __init__(self, fed: Any, out: Path, per_device: Any, started: float, wall_before: float = 0.0) -> None:
        self.fed, self.out, self.per_device = fed, Path(out), per_device
        self.started, self.wall_before = started, wall_before
        self.cloud: Any = None

    def after_round(self, record: dict[str, Any]) -> None:
        r = int(record["round"])
        nodes = list(self.fed.nodes)
        if not quiet(nodes, [t for ts in self.fed.transports.values() for t in ts]):
            log.warning("sim: the nodes were still busy %.0f s after round %d; no snapshot of it (a resume starts "
                        "after an earlier round)", SETTLE_MAX_S, r)
            return
        from splitedge.cloud import resume

        cloud = resume.load(self.cloud.settings.out_dir)  # committed by the cloud just before this callback
        if cloud is None or cloud.round != r:
            log.warning("sim: the cloud's state is not at round %d; no snapshot of it", r)
            return
        state = SimState(run=self.fed.run, round=r, cloud=snapshot.fields_of(cloud),
                         nodes={n.node_id: statefile.state_of(n) for n in nodes},
                         counters=counters_of(self.fed),
                         wall_seconds=self.wall_before + time.monotonic() - self.started,
                         device_bytes_rows=[list(row) for row in self.per_device.rows])
        snapshot.write_sealed(self.out / SIM_STATE, snapshot.fields_of(state))


def counters_of(fed: Any) -> dict[str, Any]:
    return {f"{tier}/{node}": [t.counters.state() for t in ts]
            for tier, by_node in fed.node_transports.items() for node, ts in by_node.items()}


def carry_on(saved: SimState, tier: str, node_id: str, index: int, transport: Any) -> None:
    """A resumed node's connection (its `index`-th) counts on from the saved totals; carried
    before the node is built, so its cost meter (what it reports per round) starts past them."""
    counted = saved.counters.get(f"{tier}/{node_id}", [])
    if index < len(counted):
        transport.counters.carry_on(counted[index])


def put_back(saved: SimState, node: Any) -> None:
    """A node of the resumed sim as it was at the saved round (before it starts)."""
    state = saved.nodes.get(node.node_id)
    if state is None:
        log.warning("sim: %s %s has no saved state; it starts afresh", node.tier, node.node_id)
        return
    statefile.put_back(state, node, SIM_STATE)
