"""The edge aggregator: tracks its devices, relays the cloud's messages, closes rounds, reports up.

With one broker, `down` and `up` are the same transport. With `--upstream`, devices sit on the
edge-site broker (`down`) and the cloud on another (`up`); the edge is the only bridge.
Membership comes from the devices' retained `hello` (addressed to this edge) and liveness from
their `status` (a last will turns it "offline"), so a dead device stops holding rounds open.
A device the cloud moved elsewhere says hello to its new edge and leaves this one.

The cloud's messages for devices (every device, one device, a group) arrive on the cloud's
downlink addressed to `@all`, a device id, `@<group>` or `@thin` (ONNX graphs: read only while a
member runs the onnx backend); this runtime relays them on its own downlink with the same
address, kept (retained) when they carry a slot.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
from pathlib import Path

import numpy as np

from splitedge.methods import snapshot

from splitedge.methods.losslog import device_losses
from splitedge.methods.registry import create_method
from splitedge.methods.contract import EdgePart, Message, NodeContext, RoundPlan
from splitedge.protocol.codec import Envelope
from splitedge.runtime.node import Node, status, topic_kind
from splitedge.runtime.session import clear_retained
from splitedge.runtime.presence import Presence
from splitedge.runtime.rounds import RoundCollector
from splitedge.protocol.topics import ALL_DEVICES, THIN_BACKEND, THIN_DEVICES, Topic, parse, pattern
from splitedge.protocol.transport import Transport

log = logging.getLogger(__name__)

EDGE_DEADLINE_FRACTION = 0.8  # an edge closes its round before the cloud's deadline
RETAINED_KINDS = frozenset({"round", "assign"})  # runtime-owned state a late joiner must find


def retained(kind_segment: str) -> bool:
    """A relayed message stays retained when it was: a slot's latest value or runtime state."""
    return "-" in kind_segment or kind_segment in RETAINED_KINDS


class EdgeAggregator(Node):
    def __init__(self, down: Transport, up: Transport | None = None, *, run: str, node_id: str,
                 cloud: str = "cloud", seed: int = 0, state_dir: Path | None = None,
                 slots: threading.Semaphore | None = None) -> None:
        super().__init__(run=run, tier="edge", node_id=node_id)
        self.down, self.up, self.cloud = down, up or down, cloud
        self.rng = self.seeded_rng(seed)
        self.part: EdgePart | None = None
        self.config: tuple[str, dict] | None = None  # (method, wire config) the part was built with
        self.plan: RoundPlan | None = None
        self.members: dict[str, int] = {}  # device -> samples
        # device -> the group addresses it reads, from its hello: "@<g>" per group, and "@thin"
        # on the onnx backend (the edge reads each from the cloud while a member needs it)
        self.addresses: dict[str, set[str]] = {}
        self.presence = Presence()  # which devices are online, and who went offline a moment ago
        # device -> msg_id of the hello that made it join; when its latest hello names another
        # edge, that id moves to `refuted`, so the copy addressed here (still retained if the
        # device restarted elsewhere) cannot make it join again
        self.joined_by: dict[str, str] = {}
        self.refuted: dict[str, str] = {}
        self.rounds = RoundCollector()
        self.stopped = threading.Event()
        self.subscribed: set[str] = set()  # the cloud's addressed downlink filters we read
        self.last_stop: Envelope | None = None  # a retained stop found at start (held, see Node.hold_stop)
        self.state_file = Path(state_dir) / f"edge-{node_id}.state" if state_dir is not None else None
        self.slots = slots  # a sim's pool: how many edges may aggregate (sample, train) at once

    # -- wiring ----------------------------------------------------------------------------
    def start(self) -> None:
        self._resume()
        clear_retained(self.down, pattern(self.run_id, "edge", self.node_id, "down", "#"))
        self._sync_subscriptions()
        # the hellos addressed to this edge (a device joins by sending it one); a member's other
        # messages, its status and a hello to another edge (it moved) included, through the
        # subscription its hello opens. On one broker, wildcards on every device's hello and
        # status made every edge receive every device's.
        self.down.subscribe(pattern(self.run_id, "device", "+", "up", "hello", to=self.node_id), self.enqueue)
        self._announce()
        status.info("edge %s: up (run %s), waiting for devices and for cloud %s's round", self.node_id, self.run_id,
                    self.cloud)

    def _cloud_filters(self) -> set[str]:
        """The cloud's downlink as far as this edge and its devices need it. Round announcements
        and each member's placement always; once a method is loaded (so its kinds decode), the
        rest: messages for all edges, for this edge, for all devices, for each member and for
        each group a member is in (and `@thin` while a member runs the onnx backend)."""
        cloud = lambda **kw: pattern(self.run_id, "cloud", self.cloud, "down", **kw)  # noqa: E731
        out = {cloud(kind="round"), *(cloud(kind="assign", to=d) for d in self.members),
               pattern(self.run_id, "cloud", self.cloud, "up", "status")}
        if self.part is not None:
            addressed = {self.node_id, ALL_DEVICES, *self.members, *(a for mine in self.addresses.values() for a in mine)}
            out |= {cloud(), *(cloud(to=to) for to in addressed)}
        return out

    def _sync_subscriptions(self) -> None:
        wanted = self._cloud_filters()
        for f in sorted(self.subscribed - wanted):
            self.up.unsubscribe(f)
        for f in sorted(wanted - self.subscribed):
            self.up.subscribe(f, self.enqueue)
        self.subscribed = wanted

    def _announce(self) -> None:
        hello = {"role": "edge", "parent": self.cloud, "samples": sum(self.members.values()),
                 "backend": "torch", "classes": np.zeros(0, dtype=np.int64), "members": sorted(self.live)}
        self.send(self.up, "up", "hello", hello, round_=0, retain=True)
        for transport in {id(self.up): self.up, id(self.down): self.down}.values():
            self.announce_online(transport)  # the cloud reads it upstream, the devices on the site broker

    def run_forever(self, poll: float = 0.2) -> None:
        while not self.stopped.is_set():
            self.dispatch(self.next_event(poll))
            self._maybe_close_round()
            if self.held_stop_due():
                if self.last_stop is not None:  # the devices leave too
                    self._pass_round_down(self.last_stop)
                self.stopped.set()

    def stop(self) -> None:
        self.stopped.set()

    # -- events ----------------------------------------------------------------------------
    def handle(self, topic: str, env: Envelope) -> None:
        where = parse(topic)
        if where.tier == "cloud":
            self._from_cloud(where, env)
        elif env.kind == "hello":
            self._on_hello(env, addressed=where.to is not None)
        elif env.kind == "status":
            self._on_status(env)
        elif env.sender in self.members:
            self._from_device(env)

    def _on_hello(self, env: Envelope, *, addressed: bool) -> None:
        """A device joins by the copy of its hello addressed here; from then on its latest
        unaddressed hello (through the member filter) says whether it stays, changed groups or
        moved to another edge. Two retained copies addressed to two edges cannot be ordered (a
        device restarted at another edge leaves one behind); the unaddressed one can."""
        dev = env.sender
        if addressed:
            if env.body["parent"] != self.node_id or dev in self.members or self.refuted.get(dev) == env.msg_id:
                return  # another edge's copy, a member's (its unaddressed one counts), or stale
        elif env.body["parent"] != self.node_id:
            if dev in self.members:  # moved to another edge (by the cloud, or restarted elsewhere)
                self.refuted[dev] = self.joined_by.pop(dev, "")
                self._drop(dev)
            return
        self.joined_by[dev] = env.msg_id
        if dev == self.node_id:
            log.warning("edge %s: a device with this edge's own id cannot join it", self.node_id)
            return
        thin = {THIN_DEVICES} if env.body["backend"] == THIN_BACKEND else set()
        addresses = {f"@{g}" for g in env.body["groups"]} | thin
        if dev in self.members and self.addresses.get(dev) == addresses:
            return
        if dev not in self.members:
            self.down.subscribe(pattern(self.run_id, "device", dev, "up", "#"), self.enqueue)
            status.info("edge %s: device %s joined (%d samples)", self.node_id, dev, env.body["samples"])
        self.members[dev], self.addresses[dev] = int(env.body["samples"]), addresses
        self._members_changed()

    def _drop(self, dev: str) -> None:
        self.members.pop(dev, None)
        self.addresses.pop(dev, None)
        self.down.unsubscribe(pattern(self.run_id, "device", dev, "up", "#"))
        status.info("edge %s: device %s left for another edge", self.node_id, dev)
        self._members_changed()

    def _members_changed(self) -> None:
        self._sync_subscriptions()
        self._announce()
        if self.part is not None:
            self.part.members_changed(set(self.members))

    def _on_status(self, env: Envelope) -> None:
        """A member's status (retained: it arrives when the member's subscription opens, and
        again whenever it changes)."""
        if self.presence.update(env.sender, env.body["state"]) and env.sender in self.members:
            if env.sender in self.presence.online:
                log.info("edge %s: device %s is online", self.node_id, env.sender)
            else:
                log.warning("edge %s: device %s went offline", self.node_id, env.sender)
            self._announce()  # the cloud waits for live devices before round 1

    @property
    def live(self) -> set[str]:
        """Members whose last status is online."""
        return self.presence.live(self.members)

    @property
    def awaited(self) -> set[str]:
        """Members a round waits for: online, or gone so recently they may be back (Presence)."""
        return self.presence.awaited(self.members)

    def _pass_round_down(self, env: Envelope, *, retain: bool = True) -> None:
        """The cloud's round announcement (or stop), republished on this edge's downlink."""
        self.send(self.down, "down", "round", env.body, round_=env.round, retain=retain)

    def _from_cloud(self, where: Topic, env: Envelope) -> None:
        if env.kind == "status":
            self.on_parent_status(env.body["state"])
            return
        if env.kind == "round":
            self._on_round(env)
            return
        if not self.current(env):
            return
        if where.to is not None and where.to != self.node_id:
            self._relay(where, env)
        if self.part is not None and (where.to in (None, self.node_id, ALL_DEVICES)) and self.accepts(self.part, env, "parent"):
            self._send_all(self.part.on_message(env))

    def _relay(self, where: Topic, env: Envelope) -> None:
        """Pass the cloud's message for devices on to ours, under the same address and slot."""
        to = None if where.to == ALL_DEVICES else where.to
        if to is not None and not to.startswith("@") and to not in self.members:
            return  # a device that just left us
        self.send(self.down, "down", env.kind, env.body, round_=env.round, retain=retained(where.kind),
                  topic_kind=where.kind, to=to)

    def _on_round(self, env: Envelope) -> None:
        plan = RoundPlan.from_body(env.round, env.body)
        if plan.session and plan.session != self.session and not plan.stop:
            self._new_session(plan.session)
        if plan.stop:
            reason = plan.directives.get("reason")
            if self.plan is not None or reason:
                self._pass_round_down(env, retain=not reason)
                status.info("edge %s: run finished%s", self.node_id,
                            f": {reason}" if reason else f" after round {self.plan.round}")
                self.stopped.set()
            else:  # found at start: the run is over, or a new one with this id is starting
                self.last_stop = env
                self.hold_stop(plan.session)
            return
        self.held_stop = None
        if not plan.newer_than(self.plan):
            return  # seen already (a retained announcement delivered again)
        if not self._ensure_part(plan):
            return
        self.plan, self.round = plan, plan.round
        awaited = self.awaited
        self._send_all(self.part.on_round_open(plan, awaited))
        self._pass_round_down(env)
        self.rounds.open(plan.round, plan.deadline_s * EDGE_DEADLINE_FRACTION, awaited)

    def _new_session(self, session: str) -> None:
        """A (re)started cloud: forget the old incarnation's part, round and cached state."""
        if self.session:
            log.info("edge %s: new session %s (was %s)", self.node_id, session, self.session)
        self.session, self.part, self.config, self.plan = session, None, None, None
        if self.rounds.is_open:
            self.rounds.close()

    def _ensure_part(self, plan: RoundPlan) -> bool:
        """Build (or reconfigure) the part for the announced method and config; False if the
        announcement cannot be used (unknown method, config that does not parse)."""
        wanted = (plan.method, dict(plan.config))
        if self.part is not None and self.config == wanted:
            return True
        try:
            method = create_method(plan.method, plan.config)
        except ValueError as exc:
            self.refused["config.invalid"] += 1
            log.error("edge %s: cannot take round %d: %s", self.node_id, plan.round, exc)
            return False
        if self.part is not None and self.config[0] == plan.method and self.part.spec == method.spec:
            log.info("edge %s: %s settings changed at round %d", self.node_id, plan.method, plan.round)
            self.part.reconfigure(method)
        else:
            if self.part is not None:  # another method: read the cloud's retained data again, with its kinds
                for f in sorted(self.subscribed):
                    self.up.unsubscribe(f)
                self.subscribed = set()
            self.part = method.edge_part(NodeContext(node_id=self.node_id, method=method, rng=self.rng))
            self.part.members_changed(set(self.members))
        self.config = wanted
        self._sync_subscriptions()
        return True

    def _from_device(self, env: Envelope) -> None:
        if not self.current(env) or not self.accepts(self.part, env, "child", announced=self.members.get(env.sender)):
            return
        if self.part is not None:
            replies = self.part.on_device_message(env)
            if replies:
                self._send_all(replies)
                return
        self.rounds.add(env)

    def _maybe_close_round(self) -> None:
        if not self.rounds.is_open or self.part is None or self.plan is None:
            return
        if not (self.rounds.complete(self.awaited) or self.rounds.expired()):
            return
        if not self.part.ready(self.plan):
            return  # a model this round needs has not arrived yet; it is retained, so it will
        started = time.monotonic()
        reports = self.rounds.close()
        self.part.losses = {}
        try:
            with self.slots if self.slots is not None else contextlib.nullcontext():
                self._send_all(self.part.aggregate(self.plan, reports))
        except Exception:  # the cloud still hears that this edge is done, so the run goes on
            self.errors += 1
            log.exception("edge %s: aggregating round %d failed", self.node_id, self.plan.round)
        infos = [r.get("done").body["info"] for r in reports if r.get("done") is not None]
        device_refused = collections.Counter()
        for i in infos:
            device_refused.update(i.get("refused") or {})
        info = {**self.part.round_info(), **device_losses(infos), "devices": len(reports),
                "device_refused": dict(device_refused),
                "seconds": round(time.monotonic() - started, 3), "errors": self.errors,
                "refused": self.rejections()}
        if self.part.losses:
            info["loss"] = dict(self.part.losses)
        self.send(self.up, "up", "done", {"phase": "round", "info": info})
        self._save_state()
        status.info("edge %s: round %d closed with %d/%d devices in %.1f s", self.node_id, self.plan.round,
                    len(infos), len(self.live), time.monotonic() - started)

    # -- crash safety ------------------------------------------------------------------------
    def _save_state(self) -> None:
        """After each round: what a restarted edge needs to carry on in the same session (its
        part's models, optimiser and cached statistics), written atomically."""
        if self.state_file is None or self.plan is None or self.part is None:
            return
        self.state_file.parent.mkdir(parents=True, exist_ok=True)
        state = {"format": 1, "run": self.run_id, "node": self.node_id, "session": self.session,
                 "round": self.plan.round, "plan": self.plan.to_body(), "method": self.config[0],
                 "config": self.config[1], "part": self.part.resume_state(), "rng": snapshot.to_plain(self.rng)}
        snapshot.write_atomic(self.state_file, snapshot.dumps(state))

    def _resume(self) -> None:
        """Take back the state a previous process of this edge saved; a round of the same
        session then carries on with it (a new session drops it, as ever)."""
        if self.state_file is None or not self.state_file.exists():
            return
        state = snapshot.loads(self.state_file.read_bytes())
        if not isinstance(state, dict) or state.get("format") != 1 or state.get("run") != self.run_id:
            log.warning("edge %s: %s is not this run's state; starting afresh", self.node_id, self.state_file)
            return
        method = create_method(state["method"], state["config"])
        self.part = method.edge_part(NodeContext(node_id=self.node_id, method=method, rng=self.rng))
        self.part.restore_state(state["part"])
        self.rng.bit_generator.state = snapshot.from_plain(state["rng"]).bit_generator.state  # after the build's draws
        self.config = (state["method"], dict(state["config"]))
        self.session, self.round = state["session"], int(state["round"])
        self.plan = RoundPlan.from_body(self.round, state["plan"])
        status.info("edge %s: resuming session %s after round %d (%s)", self.node_id, self.session, self.round,
                    self.state_file)

    def rejections(self) -> dict[str, int]:
        """Messages this edge dropped so far, by rule: malformed on either broker, refused by the part."""
        out = collections.Counter(self.refused)
        for transport in {id(self.down): self.down, id(self.up): self.up}.values():
            out.update(transport.rejected)
        return dict(out)

    def _send_all(self, messages: list[Message]) -> None:
        for msg in messages:
            self.publish(msg)

    def publish(self, msg: Message) -> None:
        """Route a part's message: up to the cloud, or down to all, one or a group of our devices."""
        role, node = msg.to.role, msg.to.node
        routes = {"up": (self.up, "up", None), "children": (self.down, "down", None),
                  "devices": (self.down, "down", None), "thin": (self.down, "down", THIN_DEVICES),
                  "device": (self.down, "down", node),
                  "group": (self.down, "down", f"@{node}")}
        if role not in routes or (role in ("device", "group") and not node):
            raise ValueError(f"an edge cannot send to {msg.to}")
        transport, direction, to = routes[role]
        self.send(transport, direction, msg.kind, msg.body, retain=msg.slot is not None,
                  topic_kind=topic_kind(msg.kind, msg.slot), to=to)
