"""The cloud coordinator: owns the round schedule, closes rounds on quorum or deadline,
runs the method's cloud part, writes metrics (JSON lines) and checkpoints (safetensors).
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from splitedge.methods.registry import get_method
from splitedge.methods.strategy import CloudPart, NodeContext, RoundPlan
from splitedge.protocol.codec import Envelope
from splitedge.protocol.node import Node, clear_retained
from splitedge.protocol.rounds import RoundCollector
from splitedge.protocol.topics import parse, pattern
from splitedge.protocol.transport import Transport

log = logging.getLogger(__name__)


@dataclass
class CloudSettings:
    method: str
    rounds: int
    config: dict[str, Any]
    min_edges: int = 1
    min_devices: int = 0
    join_timeout_s: float = 60.0
    out_dir: Path | None = None
    seed: int = 0
    on_round: Callable[[dict[str, Any]], None] | None = field(default=None, repr=False)


class CloudCoordinator(Node):
    def __init__(self, transport: Transport, settings: CloudSettings, *, run: str,
                 test: tuple[np.ndarray, np.ndarray], node_id: str = "cloud") -> None:
        super().__init__(run=run, tier="cloud", node_id=node_id)
        self.session = uuid.uuid4().hex[:16]
        settings.config = {**settings.config, "session": self.session}
        self.transport, self.settings = transport, settings
        ctx = NodeContext(node_id=node_id, config=settings.config,
                          rng=np.random.default_rng(settings.seed), extra={"test": test})
        self.part: CloudPart = get_method(settings.method).cloud_part(ctx)
        self.edges: dict[str, int] = {}  # edge -> devices it reports
        self.online: set[str] = set()
        self.rounds = RoundCollector()
        self.history: list[dict[str, Any]] = []
        self.stopped = threading.Event()

    def start(self) -> None:
        clear_retained(self.transport, pattern(self.run_id, "cloud", self.node_id, "down"))
        self.transport.subscribe(pattern(self.run_id, "edge", "+", "up"), self.enqueue)
        for msg in self.part.initial_messages():
            self.send(self.transport, "down", msg.kind, msg.body, round_=0, retain=msg.retain,
                      topic_kind=msg.topic_kind)

    # -- membership -------------------------------------------------------------------------
    def handle(self, topic: str, env: Envelope) -> None:
        if parse(topic).tier != "edge":
            return
        if env.kind == "hello" and env.body["parent"] == self.node_id:
            self.edges[env.sender] = int(env.body.get("members", 0))
        elif env.kind == "status":
            (self.online.add if env.body["state"] == "online" else self.online.discard)(env.sender)
        elif env.sender in self.edges and self.current(env):
            self.part.on_edge_message(env)
            self.rounds.add(env)

    @property
    def live(self) -> set[str]:
        """Edges that said hello to this cloud and whose last status is online."""
        return {e for e in self.edges if e in self.online}

    def wait_for_edges(self) -> None:
        """Block until enough edges (and devices behind them) joined, or the join timeout."""
        deadline = time.monotonic() + self.settings.join_timeout_s
        while time.monotonic() < deadline:
            devices = sum(self.edges[e] for e in self.live)
            if len(self.live) >= self.settings.min_edges and devices >= self.settings.min_devices:
                return
            self.dispatch(self.next_event(deadline - time.monotonic()))
        raise TimeoutError(f"only {len(self.live)} edge(s) with {sum(self.edges.values())} device(s) "
                           f"joined within {self.settings.join_timeout_s:.0f} s")

    # -- rounds -----------------------------------------------------------------------------
    def run(self) -> list[dict[str, Any]]:
        """All rounds, then the stop announcement; returns the per-round metrics."""
        self.start()
        self.wait_for_edges()
        try:
            for r in range(1, self.settings.rounds + 1):
                if self.stopped.is_set():
                    break
                self.history.append(self.run_round(r))
        finally:
            self._announce_stop()
        return self.history

    def run_round(self, r: int) -> dict[str, Any]:
        started = time.monotonic()
        plan = self.part.plan(r)
        self.round = r
        self.rounds.open(r, plan.deadline_s, set(self.live))
        self.send(self.transport, "down", "round", plan.to_body(), retain=True)
        while not (self.rounds.complete(self.live) or self.rounds.expired()):
            self.dispatch(self.next_event(0.2))
        reports = self.rounds.close()
        messages, metrics = self.part.aggregate(plan, reports)
        for msg in messages:
            self.send(self.transport, "down", msg.kind, msg.body, retain=msg.retain, topic_kind=msg.topic_kind)
        record = {"round": r, **metrics, "edges": len(reports), "round_seconds": time.monotonic() - started,
                  "slow_wc": plan.slow_wc, "slow_we": plan.slow_we, "rounds": dict(self.rounds.counts),
                  "rejected": dict(self.transport.rejected), "bytes": self.transport.counters.snapshot()}
        self._persist(record)
        if self.settings.on_round:
            self.settings.on_round(record)
        return record

    def _announce_stop(self) -> None:
        plan = RoundPlan(round=self.round + 1, method=self.settings.method, slow_wc=False, slow_we=False,
                         deadline_s=1.0, wc_version=0, we_version=0, config={"stop": True})
        self.send(self.transport, "down", "round", plan.to_body(), round_=plan.round, retain=True)

    def _persist(self, record: dict[str, Any]) -> None:
        out = self.settings.out_dir
        if out is None:
            return
        out.mkdir(parents=True, exist_ok=True)
        with open(out / "metrics.jsonl", "a") as fh:
            fh.write(json.dumps(record, default=float) + "\n")
        save_checkpoint(out / "model.safetensors", self.part.state_for_checkpoint(),
                        {"round": str(record["round"]), "method": self.settings.method})


def save_checkpoint(path: Path, weights: dict[str, np.ndarray], meta: dict[str, str]) -> None:
    """Write the served model without pickle (safetensors), atomically."""
    if not weights:
        return
    from safetensors.numpy import save_file

    tmp = path.with_suffix(".tmp")
    save_file({k: np.array(v, order="C") for k, v in weights.items()}, str(tmp), metadata=meta)  # keeps 0-d
    tmp.replace(path)
