"""A device of a run with no cloud and no edge: decentralised methods (DecMAR) peer to peer.

Nobody announces rounds. Every device reads the same plan file (`splitedge peers` writes it:
the method and its typed config, the number of rounds, the peer graph) and clocks its own
rounds 1..N: it trains, sends to its neighbours, waits for theirs (bounded by the method's
gather timeout, so a missing neighbour slows a round but never stalls the run) and goes on.
A neighbour a round ahead is fine: peer messages are kept per round (DeviceAgent.gather).
The device subscribes to nothing but its neighbours' peer topics, which is all the plan's
ACL lets it read. At the end it saves its own model and its per-round records.

Imports no torch itself; the method's device part does, when it trains.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from splitedge.device.agent import DeviceAgent
from splitedge.device.placing import Placing
from splitedge.methods.compute import CPU, Compute
from splitedge.methods.contract import Placement, RoundPlan
from splitedge.runtime.node import status
from splitedge.protocol.topics import pattern
from splitedge.protocol.transport import Transport

log = logging.getLogger(__name__)

PLAN_FORMAT = 1


@dataclass(frozen=True)
class PeerPlan:
    """What every peer of a cloud-less run must agree on; one JSON file, the same for all."""

    run: str
    method: str
    config: Mapping[str, Any]  # the RunConfig's wire form (model spec + the method's settings)
    rounds: int
    deadline_s: float
    graph: Mapping[str, tuple[str, ...]]

    def to_json(self) -> str:
        return json.dumps({"format": PLAN_FORMAT, "run": self.run, "method": self.method, "config": self.config,
                           "rounds": self.rounds, "deadline_s": self.deadline_s,
                           "graph": {d: list(p) for d, p in self.graph.items()}}, indent=1)

    @classmethod
    def load(cls, path: Path) -> "PeerPlan":
        """The plan at `path`, checked: ValueError with one line saying what is wrong."""
        from splitedge.methods import topology
        from splitedge.methods.registry import create_method

        try:
            raw = json.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ValueError(f"peer plan {path} does not exist (write one with `splitedge peers`)") from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"peer plan {path} is not a JSON file: {exc}") from None
        if not isinstance(raw, dict) or raw.get("format") != PLAN_FORMAT:
            raise ValueError(f"peer plan {path}: not a format-{PLAN_FORMAT} plan from `splitedge peers`")
        try:
            graph = {str(d): tuple(str(p) for p in nbrs) for d, nbrs in raw["graph"].items()}
            plan = cls(run=str(raw["run"]), method=str(raw["method"]), config=dict(raw["config"]),
                       rounds=int(raw["rounds"]), deadline_s=float(raw["deadline_s"]), graph=graph)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"peer plan {path}: missing or malformed field ({exc})") from None
        topology.check_graph(plan.graph)
        if plan.rounds < 1 or plan.deadline_s <= 0:
            raise ValueError(f"peer plan {path}: rounds and deadline_s must be positive")
        create_method(plan.method, plan.config)  # a method and settings this install knows
        return plan


class PeerPlacing(Placing):
    """A peer device's placement: no edge, its neighbours from the plan."""

    def __init__(self, device: Any, peers: tuple[str, ...]) -> None:
        super().__init__(device, edge="")
        self.placement = Placement(edge="", peers=peers)

    def sync(self, fresh: bool = False) -> None:
        """Only its neighbours' peer topics (all of them, and those addressed to it)."""
        dev = self.device
        me, peers = dev.node_id, self.placement.peers if dev.part is not None else ()
        self.subs.sync({f for p in peers for f in (pattern(dev.run_id, "device", p, "peer"),
                                                   pattern(dev.run_id, "device", p, "peer", to=me))}, fresh=fresh)

    def hello(self) -> None:
        """No edge to greet."""


class PeerAgent(DeviceAgent):
    """DeviceAgent with its own round clock, peers from the plan and no edge."""

    def __init__(self, transport: Transport, *, plan: PeerPlan, node_id: str, data: tuple[np.ndarray, np.ndarray],
                 backend: Any = "torch", seed: int = 0, compute: Compute = CPU) -> None:
        if node_id not in plan.graph:
            raise ValueError(f"device {node_id!r} is not in the peer plan's graph "
                             f"(its devices: {', '.join(sorted(plan.graph))})")
        super().__init__(transport, run=plan.run, node_id=node_id, edge="", data=data, backend=backend, seed=seed,
                         compute=compute)
        self.plan = plan
        self.session = hashlib.sha256(f"peers/{plan.run}".encode()).hexdigest()[:16]  # the same on every peer
        self.placing = PeerPlacing(self, tuple(plan.graph[node_id]))
        self.records: list[dict[str, Any]] = []

    def start(self) -> None:
        self.announce_online(self.transport)
        status.info("device %s: up with %d images (run %s, no cloud), %d rounds with peers %s", self.node_id,
                    len(self.data[1]), self.run_id, self.plan.rounds, list(self.placement.peers))

    def round_plan(self, round_: int) -> RoundPlan:
        return RoundPlan(round=round_, method=self.plan.method, deadline_s=self.plan.deadline_s,
                         config=self.plan.config, session=self.session)

    def run_rounds(self) -> list[dict[str, Any]]:
        """Rounds 1..N of the plan; returns one record per round (what the device's done says)."""
        for r in range(1, self.plan.rounds + 1):
            if self.stopped.is_set():
                break
            plan = self.round_plan(r)
            if not self._ensure_part(plan):
                raise ValueError(self.fatal or f"device {self.node_id}: cannot run {self.plan.method}")
            self.placing.sync()
            while (event := self.next_event(0)) is not None:  # what arrived between rounds (peer messages)
                self.dispatch(event)
            self.working.run(plan)
            self.records.append({"round": r, **self.working.done_info(plan).to_info()})
        status.info("device %s: run finished after round %d", self.node_id, len(self.records))
        return self.records

    def save(self, out: Path) -> list[Path]:
        """<out>/<id>-rounds.jsonl and, when the method keeps a model, <id>-model.safetensors."""
        from splitedge.runtime.outputs import dumps

        out.mkdir(parents=True, exist_ok=True)
        rounds = out / f"{self.node_id}-rounds.jsonl"
        rounds.write_text("".join(dumps(r) + "\n" for r in self.records))
        state = self.part.local_state() if self.part is not None else {}
        if not state:
            return [rounds]
        from splitedge.runtime.outputs import save_checkpoint

        model = out / f"{self.node_id}-model.safetensors"
        save_checkpoint(model, state, {"round": str(len(self.records)), "method": self.plan.method,
                                       "device": self.node_id})
        return [rounds, model]
