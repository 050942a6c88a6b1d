"""What `splitedge watch` knows about a run: pure state, updated from (topic, envelope) events.

The watcher reads only what nodes already publish (PROTOCOL.md): every node's retained `status`
(online, or offline from a clean exit or its last will), hellos (a device's edge, an edge's live
devices), the cloud's and each edge's `round` announcement, every `done` (a device's carries its
cost and refusals, an edge's its devices' costs and its own refusals) and the cloud's `metrics`
(its numeric round record: accuracy, round seconds). Nothing here does I/O and the caller says
what time an event came, so tests feed it envelopes built with the codec and check what it
holds; `tables()` turns it into plain rows that any renderer (rich, plain text) can show.
"""

from __future__ import annotations

import re
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Mapping, NamedTuple

from splitedge.protocol.codec import Envelope
from splitedge.protocol.done import DevicesDone, DoneInfo, done_info
from splitedge.protocol.errors import ProtocolError
from splitedge.protocol.topics import parse

DONE_PHASE = {"train": "round", "calibrate": "calibrate", "evaluate": "evaluate"}
"""A round announcement's phase -> the phase its `done` messages name (runtime/rounds.py)."""
COST_KEYS = ("cpu_s", "bytes_up", "bytes_down")
"""Cost figures that add up over rounds; `rss_peak_mb` is a peak (runtime/cost.py)."""
Key = tuple[int, str]
"""(round, done phase): one unit of work a node reports with one `done`."""


@dataclass
class NodeView:
    """One node as the broker shows it: its liveness, where it sits and what it reported."""

    tier: str
    node_id: str
    state: str = "unknown"  # online | offline | unknown (never said)
    since: float | None = None  # when the state was seen to change (None: found retained at start)
    parent: str = ""  # a device's edge, an edge's cloud (its hello)
    backend: str = ""
    samples: int = 0
    members: tuple[str, ...] = ()  # an edge's live devices (its hello)
    at: Key | None = None  # an edge's open (round, phase): the announcement it relayed
    done: set[Key] = field(default_factory=set)
    costs: dict[Key, dict[str, Any]] = field(default_factory=dict)
    refused: dict[str, int] = field(default_factory=dict)  # cumulative, as its last `done` said

    def cost_total(self) -> dict[str, float]:
        """CPU seconds and bytes summed over the reported rounds, memory's peak as its maximum."""
        out = {k: sum(float(c.get(k, 0)) for c in self.costs.values()) for k in COST_KEYS}
        out["rss_peak_mb"] = max((float(c.get("rss_peak_mb", 0)) for c in self.costs.values()), default=0.0)
        return out

    def last_done(self) -> int:
        return max((r for r, _ in self.done), default=0)


@dataclass
class RoundView:
    """One round as the cloud announced it and as its edges and metrics closed it."""

    number: int
    phases: list[str] = field(default_factory=list)  # train, then calibrate / evaluate when announced
    drawn: frozenset[str] = frozenset()  # the devices drawn; empty: every online device
    opened: float | None = None
    edges_done: dict[str, set[str]] = field(default_factory=dict)  # done phase -> edges
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def phase(self) -> str:
        return self.phases[-1] if self.phases else "train"

    @property
    def accuracy(self) -> float | None:
        value = self.metrics.get("accuracy")
        return float(value) if isinstance(value, (int, float)) else None


@dataclass
class WatchState:
    """The run's federation as seen from the broker; `apply` returns one line per change."""

    run: str
    nodes: dict[tuple[str, str], NodeView] = field(default_factory=dict)
    rounds: dict[int, RoundView] = field(default_factory=dict)
    current: RoundView | None = None  # the cloud's latest announced round
    method: str = ""
    session: str = ""
    stopped: str | None = None  # why the run ended ("" for a plain stop), None while it runs
    left: list[tuple[float | None, str, str]] = field(default_factory=list)  # (when, tier, id) per exit
    frames: Counter[str] = field(default_factory=Counter)  # decoded envelopes by kind
    ignored: Counter[str] = field(default_factory=Counter)  # decoded but not for this run's layout
    undecodable: dict[str, int] = field(default_factory=dict)  # by rule, from the transport's refusals

    # -- events --------------------------------------------------------------------------
    def apply(self, topic: str, env: Envelope, now: float) -> list[str]:
        """Take one message received at `now` (epoch seconds) into the state; returns what
        changed, as log lines."""
        try:
            where = parse(topic)
        except ProtocolError:
            self.ignored["topic"] += 1
            return []
        if where.run != self.run:
            self.ignored["run"] += 1
            return []
        self.frames[env.kind] += 1
        handler = _HANDLERS.get(env.kind)
        return handler(self, self.node(where.tier, where.node_id), env, now) if handler else []

    def node(self, tier: str, node_id: str) -> NodeView:
        key = (tier, node_id)
        if key not in self.nodes:
            self.nodes[key] = NodeView(tier, node_id)
        return self.nodes[key]

    def _status(self, node: NodeView, env: Envelope, now: float) -> list[str]:
        state, before = env.body["state"], node.state
        if state == before:
            return []
        node.state, node.since = state, (None if before == "unknown" else now)
        if state == "offline":
            self.left.append((node.since, node.tier, node.node_id))
            return [f"{node.tier} {node.node_id} left" + ("" if node.since else " (before the watch began)")]
        return [f"{node.tier} {node.node_id} " + ("back online" if before == "offline" else "online")]

    def _hello(self, node: NodeView, env: Envelope, now: float) -> list[str]:
        """A line when what people read changed: an edge's live devices (it says hello again as
        its samples change too), a device's edge, samples or backend."""
        b = env.body
        seen = (node.parent, node.backend, node.samples, node.members)
        node.parent, node.backend, node.samples = b["parent"], b["backend"], int(b["samples"])
        node.members = tuple(b["members"]) if node.tier == "edge" else ()
        if node.tier == "edge":
            if seen[0] and seen[3] == node.members:  # not its first hello, and the same devices
                return []
            return [f"edge {node.node_id}: {len(node.members)} device(s) live ({', '.join(node.members[:8])}"
                    f"{', ...' if len(node.members) > 8 else ''})"]
        if seen == (node.parent, node.backend, node.samples, node.members):
            return []
        return [f"{node.tier} {node.node_id} reports to {node.parent} ({node.samples} samples, {node.backend})"]

    def _round(self, node: NodeView, env: Envelope, now: float) -> list[str]:
        b = env.body
        if node.tier == "edge":
            if not b.get("stop"):
                node.at = (env.round, DONE_PHASE.get(b.get("phase", "train"), "round"))
            return []
        if node.tier != "cloud":
            return []
        if b.get("session") and b["session"] != self.session:
            lines = self._new_session(b["session"])
        else:
            lines = []
        self.method = b.get("method", self.method)
        if b.get("stop"):
            reason = (b.get("directives") or {}).get("reason") if isinstance(b.get("directives"), Mapping) else None
            if self.stopped is None:
                self.stopped = str(reason or "")
                lines.append(f"run stopped after round {env.round - 1}" + (f": {reason}" if reason else ""))
            return lines
        self.stopped = None
        view = self.current = self.rounds.setdefault(env.round, RoundView(env.round))
        phase = str(b.get("phase", "train"))
        if phase in view.phases:  # the retained announcement again (a reconnect)
            return lines
        view.phases.append(phase)
        view.opened = view.opened or now
        view.drawn = frozenset(b.get("participants") or ())
        drawn = f"{len(view.drawn)} device(s) drawn" if view.drawn else "every online device"
        return [*lines, f"round {env.round} {phase} opened ({self.method}, {drawn})"]

    def _new_session(self, session: str) -> list[str]:
        """A cloud that started afresh with this run id: the old incarnation's rounds are history."""
        old, self.session = self.session, session
        if not old:
            return []
        self.rounds, self.current = {}, None
        for n in self.nodes.values():
            n.done, n.costs, n.at = set(), {}, None
        return [f"new session {session} (was {old}): round figures start again"]

    def _done(self, node: NodeView, env: Envelope, now: float) -> list[str]:
        key: Key = (env.round, str(env.body.get("phase", "round")))
        info = done_info(env.body.get("info"))  # the codec checked it against its record
        node.done.add(key)
        if info.refused:
            node.refused = dict(info.refused)
        if info.cost:
            node.costs[key] = dict(info.cost)
        if node.tier == "edge":
            return self._edge_done(node, key, info)
        if node.tier == "device":
            cost = node.costs.get(key, {})
            said = "failed" if info.failed else \
                f"up {_bytes(cost.get('bytes_up'))}, down {_bytes(cost.get('bytes_down'))}"
            return [f"device {node.node_id} done round {key[0]}{_phase(key[1])} ({said})"]
        return []

    def _edge_done(self, edge: NodeView, key: Key, info: DoneInfo) -> list[str]:
        """An edge closed a phase: its devices' costs (they reach the cloud's broker this way
        even when device topics stay on the edge site) and the round's tally of edges."""
        devices = info.devices or DevicesDone()
        for dev, cost in devices.cost.items():
            self.node("device", str(dev)).costs[key] = dict(cost)
        view = self.rounds.setdefault(key[0], RoundView(key[0]))
        view.edges_done.setdefault(key[1], set()).add(edge.node_id)
        seconds = "?" if info.seconds is None else info.seconds
        return [f"edge {edge.node_id} closed round {key[0]}{_phase(key[1])} with {devices.reported} "
                f"device(s) in {seconds} s"]

    def _metrics(self, node: NodeView, env: Envelope, now: float) -> list[str]:
        view = self.rounds.setdefault(env.round, RoundView(env.round))
        view.metrics = {k: v for k, v in env.body.items() if isinstance(v, (int, float))}
        acc = view.accuracy
        return [f"round {env.round} closed: accuracy {acc:.4f}" if acc is not None else f"round {env.round} closed"]

    # -- questions the views ask ---------------------------------------------------------
    def tier(self, tier: str) -> list[NodeView]:
        """The nodes of a tier in natural order (d2 before d10)."""
        return sorted((n for (t, _), n in self.nodes.items() if t == tier), key=lambda n: _natural(n.node_id))

    def edge_of(self, device: NodeView) -> str:
        """A device's edge: its own hello, else the edge listing it (device topics may stay on
        an edge site's broker, while its edge's hello reaches the cloud's)."""
        if device.parent:
            return device.parent
        return next((e.node_id for e in self.tier("edge") if device.node_id in e.members), "")

    def devices_of(self, edge: str) -> list[NodeView]:
        listed = set(self.node("edge", edge).members) if ("edge", edge) in self.nodes else set()
        return [d for d in self.tier("device") if d.node_id in listed or d.parent == edge]

    def progress(self, edge: NodeView) -> tuple[int, int] | None:
        """(devices done, devices awaited) in the phase the edge has open: its live devices,
        those drawn when the round draws some."""
        if edge.at is None:
            return None
        awaited = set(edge.members)
        view = self.rounds.get(edge.at[0])
        if view is not None and view.drawn:
            awaited &= view.drawn
        done = {d.node_id for d in self.devices_of(edge.node_id) if edge.at in d.done}
        return len(done & awaited), len(awaited)

    def refusals(self) -> dict[str, tuple[int, list[str]]]:
        """rule -> (refusals summed over nodes, the nodes), from each node's latest `done`."""
        out: dict[str, tuple[int, list[str]]] = {}
        for n in self.nodes.values():
            for rule, count in n.refused.items():
                total, where = out.get(rule, (0, []))
                out[rule] = (total + count, sorted([*where, n.node_id]))
        return dict(sorted(out.items()))


_HANDLERS = {"status": WatchState._status, "hello": WatchState._hello, "round": WatchState._round,
             "done": WatchState._done, "metrics": WatchState._metrics}


MAX_DEVICE_ROWS = 40  # a big federation's device table shows its first devices and says how many more
MAX_ROUND_ROWS = 12  # the latest rounds


class Table(NamedTuple):
    """A renderer-neutral table: rich draws it live, `--once` prints it, tests read its rows."""

    title: str
    columns: tuple[str, ...]
    rows: list[tuple[str, ...]]
    note: str = ""  # where the figures come from, under the table


def headline(state: WatchState) -> str:
    """One line: the run, its cloud, the round open and the latest accuracy."""
    clouds = state.tier("cloud")
    cloud = ", ".join(f"cloud {c.node_id} {c.state}" for c in clouds) or "no cloud seen"
    if state.stopped is not None:
        where = "stopped" + (f" ({state.stopped})" if state.stopped else "")
    elif state.current is not None:
        where = f"round {state.current.number} {state.current.phase}"
    else:
        where = "no round yet"
    scored = [r for r in state.rounds.values() if r.accuracy is not None]
    acc = f"accuracy {scored[-1].accuracy:.4f} (round {scored[-1].number})" if scored else "no accuracy yet"
    bad = sum(state.undecodable.values())
    return (f"run {state.run} | {state.method or 'method ?'} | {cloud} | {where} | {acc} | "
            f"{sum(state.frames.values())} messages" + (f", {bad} not decoded" if bad else ""))


def tables(state: WatchState) -> list[Table]:
    """Every table of the view, in the order it is shown."""
    out = [edge_table(state), device_table(state), round_table(state), refusal_table(state)]
    if state.left:
        out.append(left_table(state))
    return [*out, kind_table(state)]


def edge_table(state: WatchState) -> Table:
    rows = []
    for e in state.tier("edge"):
        devices = state.devices_of(e.node_id)
        online = sum(1 for d in devices if d.state == "online" or (d.state == "unknown" and d.node_id in e.members))
        progress = state.progress(e)
        if e.at is None:
            at, shown = "-", "-"
        else:
            at = f"{e.at[0]}{_phase(e.at[1])}"
            shown = "closed" if e.at in e.done else f"{progress[0]}/{progress[1]} done" if progress else "-"
        closed = max((r for r, p in e.done if p == "round"), default=0)
        rows.append((e.node_id, _state(e), f"{online}/{len(devices)}", at, shown, str(closed or "-")))
    return Table("Edges", ("edge", "state", "devices online", "round", "progress", "last closed"), rows)


def device_table(state: WatchState) -> Table:
    devices = state.tier("device")
    listed = {m for e in state.tier("edge") for m in e.members}
    rows = []
    for d in devices[:MAX_DEVICE_ROWS]:
        total = d.cost_total()
        shared = any(c.get("shared_process") for c in d.costs.values())
        rows.append((d.node_id, state.edge_of(d) or "?", _state(d, d.node_id in listed), str(d.last_done() or "-"),
                     _bytes(total["bytes_up"]) if d.costs else "-", _bytes(total["bytes_down"]) if d.costs else "-",
                     f"{total['cpu_s']:.1f}" if d.costs else "-",
                     (f"{total['rss_peak_mb']:.0f}" + ("*" if shared else "")) if d.costs else "-"))
    if len(devices) > MAX_DEVICE_ROWS:
        rows.append((f"... {len(devices) - MAX_DEVICE_ROWS} more", "", "", "", "", "", "", ""))
    return Table("Devices", ("device", "edge", "state", "last round", "bytes up", "bytes down", "cpu s", "rss MB"),
                 rows, "bytes, CPU and peak RSS over the rounds whose done this watch saw (done is not retained)"
                       + ("; * CPU and RSS of the sim's one process" if any("*" in r[-1] for r in rows) else ""))


def round_table(state: WatchState) -> Table:
    rows = []
    for n in sorted(state.rounds)[-MAX_ROUND_ROWS:]:
        r = state.rounds[n]
        edges = ", ".join(f"{p}: {len(es)}" for p, es in sorted(r.edges_done.items())) or "-"
        seconds = r.metrics.get("round_seconds")
        rows.append((str(n), "/".join(r.phases) or "-", edges,
                     f"{r.accuracy:.4f}" if r.accuracy is not None else "-",
                     f"{seconds:.1f}" if isinstance(seconds, (int, float)) else "-",
                     str(len(r.drawn)) if r.drawn else "all"))
    return Table("Rounds", ("round", "phases", "edges done", "accuracy", "seconds", "drawn"), rows)


def refusal_table(state: WatchState) -> Table:
    rows = [(rule, str(count), ", ".join(sorted(where)[:6]) + (" ..." if len(where) > 6 else ""))
            for rule, (count, where) in state.refusals().items()]
    rows += [(f"{rule} (this watcher)", str(count), "not decoded here")
             for rule, count in sorted(state.undecodable.items())]
    return Table("Refusals by rule", ("rule", "count", "where"), rows or [("none reported", "-", "-")],
                 "as devices and edges last reported them in their done; the cloud's own are not on the wire")


def kind_table(state: WatchState) -> Table:
    kinds = sorted(state.frames)
    counts = tuple(str(state.frames[k]) for k in kinds)
    return Table("Messages by kind", tuple(kinds) or ("none yet",), [counts or ("-",)])


def left_table(state: WatchState) -> Table:
    rows = [(clock(when) if when else "before the watch", f"{tier} {node}") for when, tier, node in state.left]
    return Table("Left", ("when", "node"), rows)


def clock(when: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(when))


def _state(node: NodeView, listed: bool = False) -> str:
    """online, left at a time, offline (found so), or for a node whose status this broker does not
    carry: listed (an edge's hello names it) or "?"."""
    if node.state == "offline":
        return f"left {clock(node.since)}" if node.since else "offline"
    if node.state == "unknown":
        return "listed" if listed else "?"
    return node.state


def _natural(node_id: str) -> list[Any]:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", node_id)]


def _phase(done_phase: str) -> str:
    return "" if done_phase == "round" else f" ({done_phase})"


def _bytes(value: Any) -> str:
    """A byte count as people read it (kB, MB), or "?" when it was not reported."""
    if not isinstance(value, (int, float)):
        return "?"
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if value >= size:
            return f"{value / size:.1f} {unit}"
    return f"{int(value)} B"
