"""The edge aggregator: tracks its devices, relays the cloud's messages, closes rounds, reports up.

With one broker, `down` and `up` are the same transport. With `--upstream`, devices sit on the
edge-site broker (`down`) and the cloud on another (`up`); the edge is the only bridge.
Membership comes from the devices' hellos (runtime/membership.py) and liveness from their
`status` (a last will turns it "offline"), so a dead device stops holding rounds open.

The cloud's messages for devices (every device, one device, a group) arrive on the cloud's
downlink addressed to `@all`, a device id or `@<group>`; this runtime relays them on its own downlink with the same
address, kept (retained) when they carry a slot.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable, Mapping

from splitedge.edge.closing import Closer
from splitedge.edge.joining import MEMBERS_QUIET_S, Joining
from splitedge.edge.relaying import Relaying
from splitedge.methods.calibration.records import Gate
from splitedge.methods.compute import CPU, Compute
from splitedge.methods.contract import EdgeContext, EdgePart, Method, RoundPlan
from splitedge.protocol.codec import Envelope
from splitedge.protocol.topics import ALL_DEVICES, Topic, parse, pattern
from splitedge.protocol.transport import Transport
from splitedge.runtime import statefile
from splitedge.runtime.allowance import Allowance
from splitedge.runtime.guard import RoundGuard
from splitedge.runtime.membership import Members
from splitedge.runtime.mods import ModChain, plugin_mods
from splitedge.runtime.mods.costs import Costs
from splitedge.runtime.mods.crash import CrashPoints
from splitedge.runtime.mods.phases import EdgePhases
from splitedge.runtime.mods.releases import Releases
from splitedge.runtime.mods.secure import EdgeSecureSums
from splitedge.runtime.inbox import IDLE_WAKE_S, QUIET_WARN_S
from splitedge.runtime.node import Node, status
from splitedge.runtime.parts import PartHost
from splitedge.runtime.rounds import RoundCollector
from splitedge.runtime.router import edge_router
from splitedge.runtime.session import clear_retained
from splitedge.runtime.subscriptions import Subscriptions

log = logging.getLogger(__name__)

EDGE_DEADLINE_FRACTION = 0.8  # an edge closes its round before the cloud's deadline


class EdgeAggregator(Node[EdgePart[Any]]):
    def __init__(self, down: Transport, up: Transport | None = None, *, run: str, node_id: str,
                 cloud: str = "cloud", seed: int = 0, state_dir: Path | None = None,
                 host: Callable[..., PartHost] = PartHost, shared_process: bool = False,
                 listed: Mapping[str, Allowance] | None = None, guard: RoundGuard | None = None,
                 quiet_warn_s: float | None = QUIET_WARN_S, members_quiet_s: float = MEMBERS_QUIET_S,
                 compute: Compute = CPU) -> None:
        super().__init__(run=run, tier="edge", node_id=node_id, quiet_warn_s=quiet_warn_s)
        self.compute = compute  # the torch device its parts may train on (--device, methods/compute.py)
        self.guard = guard or RoundGuard(who=f"edge {node_id}")  # what its merge may take (runtime/guard.py)
        self.down, self.up, self.cloud = down, up or down, cloud
        self.rng = self.seeded_rng(seed)
        self.router = edge_router(self.down, self.up)
        self.host = host(self._build_part, rng=self.rng, stopped=self.stopped, name=f"edge {node_id}")
        self.plan: RoundPlan | None = None
        self.roster = Members(node_id, run, Subscriptions(self.down, self.enqueue), listed)
        self.rounds = RoundCollector()
        self.relaying = Relaying(self)  # its cloud's downlink, relayed to its devices (edge/relaying.py)
        self.state_file = Path(state_dir) / f"edge-{node_id}.state" if state_dir is not None else None
        # what cuts across methods, around the part's work (runtime/mods)
        self.mods = ModChain([EdgePhases(self), EdgeSecureSums(self), Releases(self),
                              Costs([self.down, self.up], shared_process=shared_process, children=True),
                              *plugin_mods(self, "edge"), CrashPoints("edge")])
        self.closer = Closer(self)  # how its phases close (edge/closing.py)
        self.joining = Joining(self, members_quiet_s)  # how its devices join it (edge/joining.py)

    @property
    def members(self) -> dict[str, int]:
        """device -> the samples it announced."""
        return self.roster.samples

    @property
    def closed_with(self) -> int | None:
        """Devices its last closed training round had a done from (runtime/metrics_http.py)."""
        return self.closer.closed_with

    # -- state (runtime/statefile.py) -----------------------------------------------------
    def own_state(self) -> dict[str, Any]:
        return {"plan": self.plan.to_body() if self.plan is not None else None, **self.mods.state()}

    def restore_own(self, state: Mapping[str, Any]) -> None:
        self.plan = RoundPlan.from_body(self.round, state["plan"]) if state.get("plan") is not None else None
        self.mods.restore(state)

    # -- wiring ----------------------------------------------------------------------------
    def start(self) -> None:
        statefile.resume(self.state_file, self)
        clear_retained(self.down, pattern(self.run_id, "edge", self.node_id, "down", "#"))
        # the hellos addressed to this edge (a device joins by sending it one); a member's other
        # messages, its status and a hello to another edge included, through its own filter
        self.down.subscribe(pattern(self.run_id, "device", "+", "up", "hello", to=self.node_id), self.enqueue)
        self.joining.settle()
        status.info("edge %s: up (run %s), waiting for devices and for cloud %s's round", self.node_id, self.run_id,
                    self.cloud)

    def run_forever(self, poll: float = 0.2) -> None:
        while not self.stopped.is_set():
            self.dispatch(self.next_event(self._wait_s(poll)))
            if self.mods.ticking():
                self.publish_all(self.mods.tick())
            self._maybe_close_round()

    def _wait_s(self, poll: float) -> float:
        """How long the loop may block on its inbox: until the open round can next close with no
        message (its deadline, or a just-gone device's grace ending), `poll` while a mod (a secure sum)
        ticks, else idle_wait. Each message wakes it anyway. An edge that checked its round every
        `poll` seconds, every member's presence each time, took most of a 10,000-device sim's CPU."""
        if self.mods.ticking():
            return poll
        if not self.rounds.is_open:
            return self.idle_wait(poll)
        grace = self.roster.presence.next_change_in()
        due_in = min(self.rounds.remaining_s(), IDLE_WAKE_S if grace is None else grace, self.idle_wait(poll))
        return due_in or poll  # due now but not closed (a model it needs is still on its way): poll

    # -- events ----------------------------------------------------------------------------
    def handle(self, topic: str, env: Envelope) -> None:
        where = parse(topic)
        if where.tier == "cloud":
            self._from_cloud(where, env)
        elif env.kind == "hello":
            self.joining.hello(where, env)
        elif env.kind == "status":
            self.joining.status(env)
        elif env.sender in self.members:
            self._from_device(env)

    def _from_cloud(self, where: Topic, env: Envelope) -> None:
        if env.kind == "status":
            return  # the cloud's presence: its rounds say all a waiting edge needs (Stops.hold, runtime/stopping.py)
        if env.kind == "round":
            self._on_round(env)
        elif self.current(env):
            if where.to is not None and where.to != self.node_id:
                self.relaying.relay(where, env)
            if self.part is not None and where.to in (None, self.node_id, ALL_DEVICES) and \
                    self.accepts(self.part, env, "parent"):
                self.publish_all(self.part.on_message(env))

    def _on_round(self, env: Envelope) -> None:
        plan = RoundPlan.from_body(env.round, env.body)
        self.follow_session(plan)
        stop = self.stops.on_stop(plan, started=self.plan is not None,
                                  done=f" after round {self.plan.round}" if self.plan else "")
        if stop in ("finished", "interrupted"):  # an interrupted cloud's stop is retained: restarted devices wait
            self.relaying.round_down(env, retain=not plan.directives.get("reason"))
        if stop or not plan.newer_than(self.plan) or not self._ensure_part(plan):
            return  # a stop, a retained announcement seen again, or a config we cannot use
        self.plan, self.round = plan, plan.round
        self.gate = Gate.of(plan, self.part.method) if plan.calibrating else None
        awaited = self.roster.awaited_in(self.plan)
        self.publish_all(self.mods.opened(plan))
        if not plan.calibrating:
            self.publish_all(self.part.on_round_open(plan, awaited))
        self.relaying.round_down(env)
        self.rounds.open(plan.round, plan.deadline_s * EDGE_DEADLINE_FRACTION, awaited, phase=plan.phase)
        self.closer.opened()

    def _new_session(self, session: str) -> None:
        """A (re)started cloud: forget the old incarnation's part, round and cached state."""
        super()._new_session(session)
        self.plan = None
        if self.rounds.is_open:
            self.rounds.close()

    def _ensure_part(self, plan: RoundPlan) -> bool:
        outcome = self.ensure_part(plan)
        if outcome is None:
            self.say_left(self.up, plan)
        if outcome is not None:  # another method: the cloud's retained data again, with its kinds
            self.relaying.sync(fresh=outcome == "replaced")
        return outcome is not None

    def _build_part(self, method: Method) -> EdgePart:
        part = method.edge_part(EdgeContext(node_id=self.node_id, method=method, rng=self.rng, run=self.run_id,
                                            compute=self.compute))
        part.members_changed(set(self.members))
        return part

    def _from_device(self, env: Envelope) -> None:
        if not self.accepts(self.part, env, "child", announced=self.roster.allowances.get(env.sender)):
            self.closer.refused(env, self.inbound.last_refusal)  # its phase fails
            return
        self.mods.receive(env, self._to_part)

    def _to_part(self, env: Envelope) -> None:
        """A device's checked message, past the mods: the part's (a reply goes straight back) or
        the round's collector's."""
        replies = self.part.on_device_message(env) if self.part is not None else []
        if replies:
            self.publish_all(replies)
        else:
            self.rounds.add(env)

    # -- closing a round -------------------------------------------------------------------
    def _maybe_close_round(self) -> None:
        if self.closer.due():
            self.closer.close()
