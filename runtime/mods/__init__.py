"""Mods: what cuts across every method (secure sums, DP ledgers, costs, privacy of reports, crash
points) as small handlers around a part's work, in an ordered chain per node.

After Flower's client mods (`(msg, ctx, call_next)`): a node passes each message its part sends
(`send`) and each checked message it receives for its part (`receive`: a device's from its
edge, an edge's from its devices) through its chain, each mod either handing it on with
`call_next` or taking it; every message leaving the node passes `leaving`; a device's work in a
phase runs inside `work` and an edge's merge inside `merge`. At a phase's boundaries the chain
hears it open (`opened`) and close (`closed`), may keep it from starting (`ready`) or hold it
open (`holds`), adds reports (`reports`) and folds the phase's `done` info (`done`: the typed
record of protocol/done.py), each mod writing the fields it declares in `writes` (the chain
refuses a mod that writes another's) or, declaring every field, filtering the whole. At the
cloud, a round's phases are heard (`phase_reports`), what a merged round holds through a crash
is gathered (`held`) and its record written (`record`). Every hook passes through by default, so
a mod overrides only what it changes.

No mod names a method: each acts on what a part declares (`DevicePart.secure_kinds`, the run's
config). A node builds its chain once (device/agent.py, edge/aggregator.py, cloud/coordinator.py);
a mod holds the node it serves and reads it, never the other way round. A node's owner adds a mod of their own
with `--plugin package.module:ModSubclass` (runtime/plugin_args.py): it runs on the tiers it
names in `tiers`, built with the node, after the shipped mods and before a device's private
reports, which still filter what it adds (docs/plugins.md).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from splitedge.methods.contract import Message, Method, RoundPlan
from splitedge.protocol.codec import Envelope
from splitedge.protocol.done import DoneInfo

EVERY_FIELD = ("*",)
"""`writes` of a mod that may change any field of the done info (a filter such as private reports)."""


class Mod:
    """One concern around a node's part; each hook passes through unless overridden."""

    name = ""  # its key in the node's saved state (runtime/statefile.py), when it has state
    tiers: tuple[str, ...] = ()  # a plug-in mod: the tiers it runs on ("device", "edge", "cloud")
    writes: tuple[str, ...] = ("mods",)
    """The done info's fields its `done` writes ("devices.cost": a field of an edge's `devices`);
    a mod of one's own writes its entries under `mods` (`DoneInfo.with_mod`)."""

    def vet(self, method: Method) -> str | None:
        """Why this node cannot run `method` with this mod on (None: it can)."""
        return None

    def opened(self, plan: RoundPlan) -> list[Message]:
        """A phase of `plan` opens on this node; what the mod sends at once."""
        return []

    def ready(self, plan: RoundPlan) -> bool:
        """Whether the phase may start as far as this mod goes (e.g. a message it needs is in)."""
        return True

    def work(self, plan: RoundPlan, call_next: Callable[[RoundPlan], Iterator[Any]]) -> Iterator[Any]:
        """The part's work in the phase (a device's items), wrapped."""
        return call_next(plan)

    def merge(self, plan: RoundPlan, reports: Sequence[Any],
              call_next: Callable[[RoundPlan, Sequence[Any]], list[Message]]) -> list[Message]:
        """An edge's merge of the phase's reports, wrapped: what it sends up."""
        return call_next(plan, reports)

    def send(self, msg: Message, call_next: Callable[[Message], None]) -> None:
        """A message the part sends."""
        call_next(msg)

    def receive(self, env: Envelope, call_next: Callable[[Envelope], None]) -> None:
        """A child's checked message, before the part or the round's collector has it."""
        call_next(env)

    def leaving(self, direction: str, kind: str, body: Mapping[str, Any]) -> None:
        """Every message about to leave the node (raises to stop it)."""

    def ticking(self) -> bool:
        """Whether the node must call `tick` often while the phase is open."""
        return False

    def tick(self) -> list[Message]:
        return []

    def holds(self) -> bool:
        """Whether the phase must stay open (until its deadline) for this mod."""
        return False

    def reports(self, plan: RoundPlan) -> list[Any]:
        """Reports the mod adds to the phase's when it closes (e.g. a secure sum's)."""
        return []

    def done(self, plan: RoundPlan, info: DoneInfo, children: Mapping[str, DoneInfo]) -> DoneInfo:
        """The phase's `done` info with this mod's entries (`children`: each child's done info)."""
        return info

    def closed(self, plan: RoundPlan) -> None:
        """The phase has closed and its `done` is sent."""

    def phase_reports(self, plan: RoundPlan, reports: Sequence[Any]) -> None:
        """The cloud: a phase of `plan` closed with its edges' `reports`."""

    def held(self, plan: RoundPlan, reports: Sequence[Any]) -> dict[str, Any]:
        """The cloud: entries of the merged round's record that hold with it until it is written,
        through a crash (the resumed round has no reports to read them from again)."""
        return {}

    def record(self, plan: RoundPlan, metrics: Mapping[str, Any]) -> dict[str, Any]:
        """The cloud: this mod's entries of the round's record (`metrics`: those so far)."""
        return {}

    def step(self, point: str, round_: int) -> None:
        """The node passed a named step of closing a round (crash points)."""

    def reset(self) -> None:
        """The node's part was (re)built, or a new incarnation of the run began: forget what
        belonged to the old one."""

    def state(self) -> Any:
        """What a restarted node carries on from (None: nothing)."""
        return None

    def restore(self, state: Any) -> None:
        """Take back what `state` returned before the restart (None: nothing was saved)."""


class ModChain:
    """A node's mods in order: the first wraps the rest (outermost), the `done` info is folded
    from the first to the last (so a filter placed last sees every entry)."""

    def __init__(self, mods: Sequence[Mod] = ()) -> None:
        self.mods = list(mods)

    def of(self, kind: type) -> Any:
        """The chain's mod of type `kind` (None: not in the chain)."""
        return next((m for m in self.mods if isinstance(m, kind)), None)

    def vet(self, method: Method) -> str | None:
        return next((why for why in (m.vet(method) for m in self.mods) if why), None)

    def opened(self, plan: RoundPlan) -> list[Message]:
        return [msg for m in self.mods for msg in m.opened(plan)]

    def ready(self, plan: RoundPlan) -> bool:
        return all(m.ready(plan) for m in self.mods)

    def work(self, plan: RoundPlan, last: Callable[[RoundPlan], Iterator[Any]]) -> Iterator[Any]:
        return _wrapped(self.mods, "work", last)(plan)

    def merge(self, plan: RoundPlan, reports: Sequence[Any],
              last: Callable[[RoundPlan, Sequence[Any]], list[Message]]) -> list[Message]:
        return _wrapped(self.mods, "merge", last)(plan, reports)

    def send(self, msg: Message, last: Callable[[Message], None]) -> None:
        _wrapped(self.mods, "send", last)(msg)

    def receive(self, env: Envelope, last: Callable[[Envelope], None]) -> None:
        _wrapped(self.mods, "receive", last)(env)

    def leaving(self, direction: str, kind: str, body: Mapping[str, Any]) -> None:
        for m in self.mods:
            m.leaving(direction, kind, body)

    def ticking(self) -> bool:
        return any(m.ticking() for m in self.mods)

    def tick(self) -> list[Message]:
        return [msg for m in self.mods for msg in m.tick()]

    def holds(self) -> bool:
        return any(m.holds() for m in self.mods)

    def reports(self, plan: RoundPlan) -> list[Any]:
        return [r for m in self.mods for r in m.reports(plan)]

    def done(self, plan: RoundPlan, info: DoneInfo, children: Mapping[str, DoneInfo] | None = None) -> DoneInfo:
        for m in self.mods:
            out = m.done(plan, info, children or {})
            wrote = set(changed(info, out))
            if m.writes != EVERY_FIELD and not wrote <= set(m.writes):
                raise TypeError(f"mod {type(m).__name__} wrote {', '.join(sorted(wrote - set(m.writes)))} of the done "
                                f"info, which its `writes` does not declare ({', '.join(m.writes) or 'nothing'})")
            info = out
        return info

    def phase_reports(self, plan: RoundPlan, reports: Sequence[Any]) -> None:
        for m in self.mods:
            m.phase_reports(plan, reports)

    def held(self, plan: RoundPlan, reports: Sequence[Any]) -> dict[str, Any]:
        return {k: v for m in self.mods for k, v in m.held(plan, reports).items()}

    def record(self, plan: RoundPlan, metrics: Mapping[str, Any]) -> dict[str, Any]:
        """Each mod's entries, in chain order; a later mod sees the earlier ones'."""
        out = dict(metrics)
        for m in self.mods:
            out.update(m.record(plan, out))
        return out

    def closed(self, plan: RoundPlan) -> None:
        for m in self.mods:
            m.closed(plan)

    def step(self, point: str, round_: int) -> None:
        for m in self.mods:
            m.step(point, round_)

    def reset(self) -> None:
        for m in self.mods:
            m.reset()

    def state(self) -> dict[str, Any]:
        """Each mod's state under its name (those with state)."""
        return {m.name: s for m in self.mods if m.name and (s := m.state()) is not None}

    def restore(self, state: Mapping[str, Any]) -> None:
        for m in self.mods:
            if m.name:
                m.restore(state.get(m.name))


def _wrapped(mods: Sequence[Mod], hook: str, last: Callable[..., Any]) -> Callable[..., Any]:
    """`last` wrapped by each mod's `hook` (its arguments, then `call_next`), the first mod outermost."""
    call = last
    for m in reversed(mods):
        call = _bind(getattr(m, hook), call)
    return call


def _bind(hook: Callable[..., Any], call_next: Callable[..., Any]) -> Callable[..., Any]:
    return lambda *args: hook(*args, call_next)


TIERS = ("device", "edge", "cloud")
_PLUGINS: list[type[Mod]] = []


def use_mod(cls: type[Mod]) -> None:
    """Register a mod of one's own (`--plugin`) for the nodes this process builds after it;
    ValueError in one line when it names no tier a mod runs on."""
    unknown = set(cls.tiers) - set(TIERS)
    if not cls.tiers or unknown:
        raise ValueError(f"mod {cls.__name__}: `tiers` must name where it runs, some of {', '.join(TIERS)} "
                         f"(it has {tuple(cls.tiers)!r})")
    if cls not in _PLUGINS:
        _PLUGINS.append(cls)


def plugin_mods(node: Any, tier: str) -> list[Mod]:
    """The registered plug-in mods of `tier`, each built with the node it serves."""
    return [cls(node) for cls in _PLUGINS if tier in cls.tiers]  # type: ignore[call-arg]


def changed(before: DoneInfo, after: DoneInfo) -> Iterator[str]:
    """The fields `after` holds anew (dataclasses.replace keeps the others' objects), an edge's
    `devices` by field ("devices.cost")."""
    for name in before.__dataclass_fields__:
        old, new = getattr(before, name), getattr(after, name)
        if old is new:
            continue
        if name == "devices" and old is not None and new is not None:
            yield from (f"devices.{f}" for f in old.__dataclass_fields__ if getattr(old, f) is not getattr(new, f))
        else:
            yield name
