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
import time
from pathlib import Path
from typing import Any, Callable, Mapping

from splitedge.methods.calibration.records import Gate
from splitedge.methods.compute import CPU, Compute
from splitedge.methods.contract import EdgePart, Method, NodeContext, RoundFailed, RoundPlan
from splitedge.protocol.codec import Envelope
from splitedge.protocol.topics import ALL_DEVICES, Topic, parse, pattern
from splitedge.protocol.transport import Transport
from splitedge.runtime import statefile
from splitedge.runtime.allowance import Allowance
from splitedge.runtime.filters import edge_cloud_filters
from splitedge.runtime.guard import OverBudget, RoundGuard
from splitedge.runtime.membership import Members
from splitedge.runtime.mods import ModChain, plugin_mods
from splitedge.runtime.mods.costs import Costs
from splitedge.runtime.mods.crash import CrashPoints
from splitedge.runtime.mods.phases import EdgePhases
from splitedge.runtime.mods.releases import Releases
from splitedge.runtime.mods.secure import EdgeSecureSums
from splitedge.runtime.node import IDLE_WAKE_S, QUIET_WARN_S, Node, status
from splitedge.runtime.parts import PartHost
from splitedge.runtime.records import edge_done_info
from splitedge.runtime.rounds import RoundCollector, done_phase
from splitedge.runtime.router import edge_router, relay_route, relayed_retained
from splitedge.runtime.session import clear_retained
from splitedge.runtime.subscriptions import Subscriptions

log = logging.getLogger(__name__)

EDGE_DEADLINE_FRACTION = 0.8  # an edge closes its round before the cloud's deadline
MEMBERS_QUIET_S, MEMBERS_SETTLE_S = 0.3, 3.0
"""At start, the devices' retained hellos and statuses are taken until none arrives for the
first, for at most the second (a broker sends retained messages right after each SUBACK)."""


class EdgeAggregator(Node):
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
        self.unlisted: set[str] = set()  # ids refused at their hello (a manifest lists the devices), logged once
        self.rounds = RoundCollector()
        self.refused_now: dict[str, str] = {}  # device -> rule of its message this phase refused (its phase failed)
        self.cloud_subs = Subscriptions(self.up, self.enqueue)  # the cloud's downlink, as far as we need it
        self.state_file = Path(state_dir) / f"edge-{node_id}.state" if state_dir is not None else None
        # what cuts across methods, around the part's work (runtime/mods)
        self.mods = ModChain([EdgePhases(self), EdgeSecureSums(self), Releases(self),
                              Costs([self.down, self.up], shared_process=shared_process, children=True),
                              *plugin_mods(self, "edge"), CrashPoints("edge")])
        self.closed_with: int | None = None  # devices its last closed training round had a done from
        self._settling = False  # start() is taking the members' retained hellos and statuses
        self._online = False  # its online status published (each transport republishes it after a reconnect)
        self.members_quiet_s = members_quiet_s  # 0: take none (a sim starts its edges before any device)

    @property
    def members(self) -> dict[str, int]:
        """device -> the samples it announced."""
        return self.roster.samples


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
        self._settle_members()
        self._members_changed()  # the cloud's downlink (and what it addresses to members), and our hello
        status.info("edge %s: up (run %s), waiting for devices and for cloud %s's round", self.node_id, self.run_id,
                    self.cloud)

    def _settle_members(self, most_s: float = MEMBERS_SETTLE_S) -> None:
        """Take the devices' retained hellos, and the statuses they open, before the cloud's
        downlink: an edge restarted into an open round must know who is live when it opens the
        round, or it would wait for nobody and close it at once. Until nothing arrives for
        `members_quiet_s`, at most `most_s`."""
        quiet_s = self.members_quiet_s
        if quiet_s <= 0:
            return
        self._settling = True
        try:
            deadline = time.monotonic() + most_s
            while time.monotonic() < deadline:
                event = self.next_event(min(quiet_s, deadline - time.monotonic()))
                if event is None:
                    break
                self.dispatch(event)
        finally:
            self._settling = False

    def _sync_subscriptions(self, fresh: bool = False) -> None:
        self.cloud_subs.sync(edge_cloud_filters(self.run_id, self.node_id, self.cloud, self.members,
                                                self.roster.group_addresses(), loaded=self.part is not None), fresh=fresh)

    def _announce(self) -> None:
        """The hello (who is live) every time it changes; the online status once, since each
        transport republishes it after a reconnect. Announced again with every member's status,
        it went to every member: an edge of m devices sent m^2/2 of them while they joined."""
        self.send(self.up, "up", "hello", self.roster.hello_body(self.cloud), round_=0, retain=True)
        if self._online:
            return
        for transport in {id(self.up): self.up, id(self.down): self.down}.values():
            self.announce_online(transport)  # the cloud reads it upstream, the devices on the site broker
        self._online = True

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
            if not self.roster.admits(env.sender):
                self._refuse_unlisted(env.sender)
            elif self.roster.hello(env, addressed=where.to is not None):
                self._members_changed()
        elif env.kind == "status":
            if self.roster.status(env) and not self._settling:
                self._announce()  # the cloud waits for live devices before round 1
        elif env.sender in self.members:
            self._from_device(env)

    def _refuse_unlisted(self, device: str) -> None:
        """A hello from an id the operator's manifest does not list: counted, logged once per id."""
        self.refused["hello.unlisted"] += 1
        if device not in self.unlisted:
            self.unlisted.add(device)
            log.warning("edge %s: refused device %s: not in this edge's manifest (--manifest)", self.node_id, device)

    def _members_changed(self) -> None:
        if self._settling:  # start() subscribes and announces once they are in
            return
        self._sync_subscriptions()
        self._announce()
        if self.part is not None:
            self.part.members_changed(set(self.members))

    def _pass_round_down(self, env: Envelope, *, retain: bool = True) -> None:
        """The cloud's round announcement (or stop), republished on this edge's downlink."""
        self.send(self.down, "down", "round", env.body, round_=env.round, retain=retain)

    def _from_cloud(self, where: Topic, env: Envelope) -> None:
        if env.kind == "status":
            return  # the cloud's presence: its rounds say all a waiting edge needs (Node.hold_stop)
        if env.kind == "round":
            self._on_round(env)
        elif self.current(env):
            if where.to is not None and where.to != self.node_id:
                self._relay(where, env)
            if self.part is not None and where.to in (None, self.node_id, ALL_DEVICES) and \
                    self.accepts(self.part, env, "parent"):
                self.publish_all(self.part.on_message(env))

    def _relay(self, where: Topic, env: Envelope) -> None:
        """Pass the cloud's message for devices on to ours, under the same address and slot."""
        route = relay_route(where, self.down, self.members)
        if route is not None:
            self.send(route.transport, route.direction, env.kind, env.body, round_=env.round,
                      retain=relayed_retained(where.kind), topic_kind=where.kind, to=route.to)

    def _on_round(self, env: Envelope) -> None:
        plan = RoundPlan.from_body(env.round, env.body)
        self.follow_session(plan)
        stop = self.on_stop(plan, started=self.plan is not None,
                            done=f" after round {self.plan.round}" if self.plan else "")
        if stop in ("finished", "interrupted"):  # an interrupted cloud's stop is retained: restarted devices wait
            self._pass_round_down(env, retain=not plan.directives.get("reason"))
        if stop or not plan.newer_than(self.plan) or not self._ensure_part(plan):
            return  # a stop, a retained announcement seen again, or a config we cannot use
        self.plan, self.round = plan, plan.round
        self.gate = Gate.of(plan, self.part.method) if plan.calibrating else None
        awaited = self.roster.awaited_in(self.plan)
        self.publish_all(self.mods.opened(plan))
        if not plan.calibrating:
            self.publish_all(self.part.on_round_open(plan, awaited))
        self._pass_round_down(env)
        self.rounds.open(plan.round, plan.deadline_s * EDGE_DEADLINE_FRACTION, awaited, phase=plan.phase)
        self.refused_now = {}

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
            self._sync_subscriptions(fresh=outcome == "replaced")
        return outcome is not None

    def _build_part(self, method: Method) -> EdgePart:
        part = method.edge_part(NodeContext(node_id=self.node_id, method=method, rng=self.rng, run=self.run_id,
                                            compute=self.compute))
        part.members_changed(set(self.members))
        return part

    def _from_device(self, env: Envelope) -> None:
        if not self.accepts(self.part, env, "child", announced=self.roster.allowances.get(env.sender)):
            if self.inbound.last_refusal and self.rounds.is_open and env.round == self.rounds.round:
                self.refused_now.setdefault(env.sender, self.inbound.last_refusal)  # its phase fails (_refused_phases)
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

    def _refused_phases(self, plan: RoundPlan, by_device: dict[str, Any]) -> dict[str, Any]:
        """A device whose message of this phase was refused did not take part, whatever its
        `done` says: it counts as failed ("refused", runtime/records.py), with one line naming
        the rule (a device restarted with another shard is re-admitted by its new hello,
        runtime/membership.py; a lying one is refused every round)."""
        for dev, rule in sorted(self.refused_now.items()):
            if dev in by_device and not by_device[dev].get("left"):
                by_device[dev] = {**by_device[dev], "failed": True, "reason": "refused"}
                log.warning("edge %s: device %s's round %d%s does not count: its message was refused [%s]",
                            self.node_id, dev, plan.round, "" if plan.phase == "train" else f" {plan.phase}", rule)
        return by_device  # refused_now starts afresh when the next phase opens

    # -- closing a round -------------------------------------------------------------------
    def _maybe_close_round(self) -> None:
        if not self.rounds.is_open or self.part is None or self.plan is None:
            return
        due = self.rounds.complete(self.roster.awaited_in(self.plan)) or self.rounds.expired()
        if not due or not self.part.ready(self.plan):
            return  # a model this round needs has not arrived yet; it is retained, so it will
        if self.mods.holds() and not self.rounds.expired():
            return  # a mod still collecting (a secure sum's last shares)
        started, plan = time.monotonic(), self.plan
        expected = set(self.rounds.expected)  # awaited at the round's opening, and any that reported
        reports = self.rounds.close() + self.mods.reports(plan)
        self.part.losses, extra = {}, {}
        what = f"round {plan.round}" + ("" if plan.phase == "train" else f" {plan.phase}") + " merge"
        try:
            with self.host.working(), self.guard.round(what, plan.deadline_s) as within:
                messages = self.mods.merge(plan, reports, self.part.aggregate)  # by phase (runtime/mods/phases.py)
                within.check()  # over its budget: nothing of it leaves
                self.mods.step("aggregated", plan.round)
                self.publish_all(messages)
                self.mods.step("published", plan.round)
        except RoundFailed as exc:  # over its memory ceiling or time budget (runtime/guard.py): one line
            self.errors += 1
            extra = {"merge_failed": exc.reason if isinstance(exc, OverBudget) else "failed"}
            log.error("edge %s: %s failed: %s", self.node_id, what, exc)
        except Exception:  # the cloud still hears that this edge is done, so the run goes on
            self.errors += 1
            log.exception("edge %s: aggregating round %d (%s) failed", self.node_id, plan.round, plan.phase)
        by_device = self._refused_phases(plan, {r.sender: r.get("done").body["info"] for r in reports
                                                if r.get("done") is not None})
        left = {d: str(i["left"]) for d, i in by_device.items() if i.get("left")}
        for d, why in left.items():
            log.warning("edge %s: device %s left the run: %s", self.node_id, d, why)
        if left:
            extra["left_devices"] = left  # the cloud says why, should the run end for want of devices
        infos = list(by_device.values())
        info = edge_done_info(self.part, infos, reported=len(reports), seconds=time.monotonic() - started,
                              errors=self.errors, refused=self.rejections([self.down, self.up]),
                              trained=plan.phase == "train")
        info = self.mods.done(plan, {**info, **extra}, by_device)
        self.send(self.up, "up", "done", {"phase": done_phase(plan.phase), "info": info})
        self.mods.closed(plan)
        self.mods.step("done", plan.round)
        if plan.phase == "train":
            self.completed, self.closed_with = self.completed + 1, len(infos)
        self.host.end_round()  # after the round's info is read off the part: a host may swap the part out
        statefile.save(self.state_file, self)  # what a restarted edge carries on from
        self.mods.step("saved", plan.round)
        failed = info.get("device_failed") or {}  # runtime/records.py: by reason
        # of the devices the round expected (those live at its opening, and any that reported), those
        # that reported and did not leave: never more than it expected (not the devices live now)
        status.info("edge %s: round %d%s closed with %d/%d devices%s%s in %.1f s", self.node_id, plan.round,
                    "" if plan.phase == "train" else f" {plan.phase}", len(infos) - len(left),
                    len(expected | set(by_device)),
                    f" ({sum(failed.values())} failed: {', '.join(f'{k} {v}' for k, v in sorted(failed.items()))})"
                    if failed else "", f" ({len(left)} left the run)" if left else "", time.monotonic() - started)
