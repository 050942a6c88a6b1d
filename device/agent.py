"""The device agent: holds only its own data, runs its method part, talks to its edge and peers.

Reads its edge's downlink (round announcements, models for every device, for this device or
for one of its groups) and its peers' peer topics; publishes `hello` (retained, and a copy
addressed to its edge) and a last-will `status` so the edge knows who is alive. The cloud may
move it to another edge, put it in groups or give it peers with an `assign` message: it then
re-subscribes and says hello to its new edge, without a restart. All learning happens in the
method's device part (hosted by runtime/parts.py); this loop only sequences it. A part that
must wait in the middle of a round has `request` and `gather` in its context (runtime/exchange.py).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Mapping

import numpy as np

from splitedge.device.building import build_part, vet
from splitedge.device.placing import Placing
from splitedge.device.working import Working
from splitedge.methods.compute import CPU, Compute
from splitedge.methods.contract import TRAIN_CHUNK, DevicePart, Placement, RoundPlan
from splitedge.methods import snapshot
from splitedge.protocol.codec import Envelope
from splitedge.protocol.topics import parse
from splitedge.protocol.transport import Transport
from splitedge.runtime.exchange import Exchange
from splitedge.runtime.guard import RoundGuard
from splitedge.runtime.mods import ModChain, plugin_mods
from splitedge.runtime.mods.budgets import Guarded, Uplink
from splitedge.runtime.mods.costs import Costs
from splitedge.runtime.mods.phases import DevicePhases
from splitedge.runtime.mods.private import PrivateReports
from splitedge.runtime.mods.secure import DeviceSecureSum
from splitedge.runtime.uplink import UplinkBudget
from splitedge.runtime.inbox import QUIET_WARN_S
from splitedge.runtime.node import Node, status
from splitedge.runtime.parts import PartHost
from splitedge.runtime.router import device_router

log = logging.getLogger(__name__)

CONTROL_KINDS = ("status", "round", "assign")  # what the runtime itself reads; the rest is the part's


class DeviceAgent(Node[DevicePart[Any]]):
    def __init__(self, transport: Transport, *, run: str, node_id: str, edge: str,
                 data: tuple[np.ndarray, np.ndarray], backend: Any = "torch", seed: int = 0,
                 host: Callable[..., PartHost] = PartHost, shared_process: bool = False,
                 min_class_count: int = 1, train_chunk: int = TRAIN_CHUNK, hide_classes: bool = False,
                 private_reports: bool = False, guard: RoundGuard | None = None,
                 uplink: UplinkBudget | None = None, quiet_warn_s: float | None = QUIET_WARN_S,
                 compute: Compute = CPU) -> None:
        super().__init__(run=run, tier="device", node_id=node_id, quiet_warn_s=quiet_warn_s)
        # what a round's compute may take (runtime/guard.py); by default its deadline, no memory ceiling
        self.guard = guard or RoundGuard(who=f"device {node_id}")
        self.uplink = uplink or UplinkBudget(who=f"device {node_id}")  # what a round may send up (runtime/uplink.py)
        self.transport, self.data, self.backend = transport, data, backend
        self.min_class_count = min_class_count  # the owner's floor; the run's applies when it is higher
        self.train_chunk = train_chunk  # samples a thin trainer's W_c step takes at a time (0: whole batches)
        self.compute = compute  # the torch device its part may train on (--device, methods/compute.py)
        # private reports (runs with DP): the hello names no class and only a power of two at or above the
        # samples held, and `done` carries neither the samples nor the training losses (coarse_samples)
        self.private_reports = private_reports
        self.hide_classes = hide_classes or private_reports  # the hello names no class
        # what the hello names: "torch", "onnx" (a thin device: numpy layers of its install) or a custom one
        self.backend_name = backend if isinstance(backend, str) else getattr(backend, "name", "custom")
        self.rng = self.seeded_rng(seed)
        self.router = device_router(transport)
        self.host = host(lambda method: build_part(self, method), rng=self.rng, vet=lambda method: vet(self, method),
                         stopped=self.stopped, name=f"device {node_id}")
        self.exchange = Exchange(self, super().next_event)
        self.pending: RoundPlan | None = None
        # RoundPlan.key of the last work done (a resumed cloud's come again, higher)
        self.last: tuple[int, int, int] = (0, 0, 0)
        self.placing = Placing(self, edge)  # where it is placed, and its hello (device/placing.py)
        self.working = Working(self)  # how it works a phase and says it is done (device/working.py)
        # what cuts across methods, around the part's work (runtime/mods); private reports filter
        # last what every mod before them (the owner's own, --plugin) added to the done info
        self.mods = ModChain([Guarded(self.guard), Uplink(self.uplink, f"device {node_id}"), DevicePhases(self),
                              DeviceSecureSum(self),
                              Costs([transport], shared_process=shared_process), *plugin_mods(self, "device"),
                              *([PrivateReports(self)] if private_reports else [])])

    @property
    def placement(self) -> Placement:
        return self.placing.placement

    @property
    def edge(self) -> str:
        return self.placement.edge

    @property
    def idle(self) -> bool:
        return super().idle and not self.exchange.deferred

    # -- state (runtime/statefile.py: a resumed sim puts every device back) -----------------
    def own_state(self) -> dict[str, Any]:
        """Beside the part: the last round worked on, where the device is placed, and the
        messages its host keeps for a parked part (they arrived after its round)."""
        return {"last": list(self.last), "placement": snapshot.to_plain(self.placement),
                "held": snapshot.to_plain(self.host.kept_for_part())}

    def restore_own(self, state: Mapping[str, Any]) -> None:
        self.last = tuple(int(v) for v in state["last"])
        self.placing.placement = snapshot.from_plain(state["placement"])
        self.host.keep_for_part([tuple(e) for e in snapshot.from_plain(state["held"])])

    def start(self) -> None:
        self.placing.sync()
        self.placing.hello()
        self.announce_online(self.transport)
        status.info("device %s: up with %d images (run %s), waiting for edge %s's round", self.node_id,
                    len(self.data[1]), self.run_id, self.edge)

    def run_forever(self, poll: float = 0.5) -> None:
        """Process events until the cloud announces the end of the run (or stop() is called)."""
        while not self.stopped.is_set():
            self.dispatch(self.next_event(self.idle_wait(poll)))

    def next_event(self, timeout: float) -> tuple[str, Envelope] | None:
        """Events deferred during a round's `request`/`gather` calls come first, in arrival order."""
        return self.exchange.deferred.popleft() if self.exchange.deferred else super().next_event(timeout)

    # -- events ----------------------------------------------------------------------------
    def handle(self, topic: str, env: Envelope) -> None:
        where = parse(topic)
        if (where.tier == "edge" and where.node_id != self.edge) or (
                env.kind not in CONTROL_KINDS and self.host.hold((topic, env))):
            return  # the downlink of an edge we left, or a message kept for a parked part
        if env.kind == "status" and where.tier == "edge":
            return  # the edge's presence: its rounds say all a waiting device needs (Stops.hold, runtime/stopping.py)
        if env.kind == "round":
            self._on_round(RoundPlan.from_body(env.round, env.body))
        elif env.kind == "assign":
            self.placing.assign(env.body)
        elif where.direction == "peer":
            self.exchange.on_peer(env)
        elif self.part is not None and self.accepts(self.part, env, "parent"):
            self.mods.receive(env, self.part.on_message)
        if self.pending is not None and self.part is not None and self.part.ready(self.pending) and \
                self.mods.ready(self.pending):
            plan, self.pending = self.pending, None
            self.working.run(plan)

    def _on_round(self, plan: RoundPlan) -> None:
        self.follow_session(plan)
        if self.stops.on_stop(plan, started=self.last[0] > 0 or self.pending is not None,
                              done=f" after round {self.last[0]}"):
            return
        if not plan.takes_part(self.node_id) and plan.key > self.last:
            self.last = plan.key  # not drawn this round: nothing to do, nothing to send
            return
        if plan.key <= self.last or not self.host.begin_round():
            return  # seen already (a retained announcement after a reconnect or a move), or stopped
        self.exchange.deferred.extendleft(reversed(self.host.held()))  # first, in their order
        if self._ensure_part(plan):
            self.pending = plan
        elif self.part is None:
            self.host.end_round()

    def _ensure_part(self, plan: RoundPlan) -> bool:
        outcome = self.ensure_part(plan)
        if outcome is None:
            self.say_left(self.transport, plan)
        if outcome in ("built", "replaced"):  # its kinds registered now: its retained data again
            self.mods.reset()
            self.placing.sync(fresh=outcome == "replaced")
        return outcome is not None

    def _new_session(self, session: str) -> None:
        """A (re)started cloud: forget the old incarnation's part, rounds and models."""
        super()._new_session(session)
        self.pending, self.last = None, (0, 0, 0)
        self.exchange.peer_box.clear()
        self.mods.reset()

    def send(self, transport: Transport, direction: str, kind: str, body: Mapping[str, Any], **kw: Any) -> Envelope:
        """Every message passes the mods before it leaves (the uplink budget charges it)."""
        self.mods.leaving(direction, kind, body)
        return super().send(transport, direction, kind, body, **kw)
