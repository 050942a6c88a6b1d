"""The `done` info, typed as the round plan is: what a node says when a phase ends.

One record at every tier, so a figure keeps its name as it travels up. A device's own entries
(`dp_releases`, `withheld`, `refused`, `loss`, `cost`, `failed`, `left`, `scores`) come back in its
edge's `devices` section under the same names, merged or by device as each field says; the cloud
reads them there. Who writes each field is declared beside it: the runtime, a mod
(runtime/mods), the method (`method`: its part's `round_info`), a mod of one's own (`mods`, under
the mod's name). The codec checks every `done` against the schema built from these declarations
(`DONE_INFO`), so a peer's done info is typed before any tier reads it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from .fields import Bool, Data, Field, Int, List, Map, Number, Scalar, Str
from .schema import Record, Schema

__all__ = ["DONE_INFO", "DevicesDone", "DoneInfo", "Scores", "done_info", "dones"]

_KEY = 64  # a rule, a loss, a layer or a device id's length in a done info's maps
_COUNTS = Map(values=Int(ge=0), max_entries=256, key_max_len=_KEY, optional=True, default={})
_LOSSES = Map(values=Number(), max_entries=64, key_max_len=_KEY, optional=True, default={})
_COST = Map(values=Scalar(), max_entries=32, key_max_len=_KEY, optional=True, default={})
_BY_DEVICE = 65536


def _wire(spec: Field, doc: str) -> Any:
    """A record field's declaration: its wire spec and who writes it (the schema is built from it).
    Every field is optional on the wire: a record says only what it has to say."""
    return {"wire": spec.but(optional=True), "doc": doc}


@dataclass(frozen=True)
class Scores:
    """A head's scores on held-out images (an evaluation phase): a device's own, or merged."""

    accuracy: float | None = field(default=None, metadata=_wire(
        Number(default=None), "the accuracy over `eval_samples` held-out images"))
    eval_samples: int = field(default=0, metadata=_wire(Int(ge=0, default=0), "how many images were scored"))
    layer_scores: dict[str, list[int]] = field(default_factory=dict, metadata=_wire(
        Map(values=List(items=Int(ge=0), max_items=2), max_entries=16, key_max_len=_KEY, default={}),
        "each candidate layer's head: [correct, scored] on the images held back"))


@dataclass(frozen=True)
class DevicesDone:
    """What an edge says of its devices in a phase, each entry under the name its devices use."""

    reported: int = field(default=0, metadata=_wire(Int(ge=0, default=0), "runtime: devices that sent a done"))
    samples: int = field(default=0, metadata=_wire(Int(ge=0, default=0), "runtime: the images behind `loss`"))
    loss: dict[str, float] = field(default_factory=dict, metadata=_wire(
        _LOSSES, "runtime: their losses, sample weighted"))
    refused: dict[str, int] = field(default_factory=dict, metadata=_wire(
        _COUNTS, "runtime: what they refused, summed by rule"))
    failed: dict[str, int] = field(default_factory=dict, metadata=_wire(
        _COUNTS, "runtime: devices whose phase failed, by reason (memory, time, refused, other)"))
    withheld: dict[str, int] = field(default_factory=dict, metadata=_wire(
        _COUNTS, "runtime: classes and images held back below the minimum count, summed"))
    left: dict[str, str] = field(default_factory=dict, metadata=_wire(
        Map(values=Str(max_len=512), max_entries=_BY_DEVICE, key_max_len=128, default={}),
        "runtime: by device, why it left the run"))
    dp_releases: int = field(default=0, metadata=_wire(Int(ge=0, default=0), (
        "mod Releases: how much the most DP releases one device made so far grew since the edge's last done "
        "(late dones included): what the cloud's accountant counts")))
    cost: dict[str, dict[str, Any]] = field(default_factory=dict, metadata=_wire(
        Map(values=_COST.but(optional=False), max_entries=_BY_DEVICE, key_max_len=128, default={}),
        "mod Costs: by device, each one's cost (devices with private reports only in `private_cost`)"))
    private_cost: dict[str, Any] = field(default_factory=dict, metadata=_wire(
        _COST, "mod Costs: the costs of its devices with private reports, summed (`devices`: how many)"))
    calibrated: int | None = field(default=None, metadata=_wire(
        Int(ge=0, default=None), "mod EdgePhases: devices whose head statistics a calibration merged"))
    scores: Scores = field(default_factory=Scores, metadata=_wire(
        Record(schema=Schema(), default={}), "mod EdgePhases: their scores of an evaluation phase, merged"))


@dataclass(frozen=True)
class DoneInfo:
    """A node's own `done` info; an edge's adds `devices`."""

    samples: int | None = field(default=None, metadata=_wire(
        Int(ge=0, default=None), "runtime, device: the images it holds"))
    loss: dict[str, float] = field(default_factory=dict, metadata=_wire(_LOSSES, "runtime: its part's losses"))
    refused: dict[str, int] = field(default_factory=dict, metadata=_wire(
        _COUNTS, "runtime: messages it refused, by rule"))
    failed: bool = field(default=False, metadata=_wire(Bool(default=False), "runtime: its phase failed"))
    reason: str = field(default="", metadata=_wire(
        Str(max_len=32, default=""), "runtime: why (memory, time: over its round guard; failed)"))
    left: str = field(default="", metadata=_wire(Str(max_len=512, default=""), "runtime: why it left the run"))
    withheld: dict[str, int] = field(default_factory=dict, metadata=_wire(
        _COUNTS, "runtime, device: classes and images its statistics held back below the minimum count"))
    dp_releases: int = field(default=0, metadata=_wire(
        Int(ge=0, default=0), "runtime, device: the DP releases it made in the phase"))
    private_reports: bool = field(default=False, metadata=_wire(
        Bool(default=False), "mod PrivateReports: this info holds only what private reports let through"))
    seconds: float | None = field(default=None, metadata=_wire(
        Number(default=None), "runtime, edge: how long its close took"))
    errors: int = field(default=0, metadata=_wire(Int(ge=0, default=0), "runtime, edge: its errors so far"))
    cost: dict[str, Any] = field(default_factory=dict, metadata=_wire(
        _COST, "mod Costs: CPU seconds, peak memory and bytes since its last done"))
    secagg: dict[str, Any] = field(default_factory=dict, metadata=_wire(
        Map(values=Data(max_depth=2), max_entries=8, key_max_len=_KEY, default={}),
        "mod EdgeSecureSums: each secure sum of the phase (devices, dropped, why it failed)"))
    scores: Scores = field(default_factory=Scores, metadata=_wire(
        Record(schema=Schema(), default={}), "mod DevicePhases, device: its scores of an evaluation phase"))
    method: dict[str, Any] = field(default_factory=dict, metadata=_wire(
        Data(max_depth=6, default={}), "the method: its part's round_info"))
    mods: dict[str, Any] = field(default_factory=dict, metadata=_wire(
        Map(values=Data(max_depth=6), max_entries=16, key_max_len=_KEY, default={}),
        "mods of one's own: each one's entries under its name"))
    devices: DevicesDone | None = field(default=None, metadata=_wire(
        Record(schema=Schema(), default=None), "edge: what it says of its devices"))

    def to_info(self) -> dict[str, Any]:
        """The wire form: only the fields that differ from their defaults, as the codec sends
        any record (schema.Record.wire), so a device's done stays small."""
        return _RECORD.wire(_as_map(self))

    def but(self, **changes: Any) -> "DoneInfo":
        return dataclasses.replace(self, **changes)

    def but_devices(self, **changes: Any) -> "DoneInfo":
        """This info with some fields of its `devices` changed (an edge's: it has them)."""
        assert self.devices is not None, "only an edge's done info speaks of devices"
        return self.but(devices=dataclasses.replace(self.devices, **changes))

    def with_mod(self, name: str, entries: Any) -> "DoneInfo":
        """This info with a mod of one's own's entries under its name."""
        return self.but(mods={**self.mods, name: entries})


_NESTED = {("DoneInfo", "scores"): Scores, ("DoneInfo", "devices"): DevicesDone, ("DevicesDone", "scores"): Scores}
"""The fields that hold a record of their own (annotations are strings under `from __future__`)."""


def _schema(cls: type) -> Schema:
    """The schema of a record class, from its fields' declarations (nested records nested)."""
    specs = {}
    for f in dataclasses.fields(cls):
        spec = f.metadata["wire"]
        inner = _NESTED.get((cls.__name__, f.name))
        specs[f.name] = spec.but(schema=_schema(inner)) if inner is not None else spec
    return Schema(specs, doc=cls.__doc__ or "")


DONE_INFO = _schema(DoneInfo)
"""What the codec checks a `done`'s info against (protocol/kinds.py)."""


_RECORD = Record(schema=DONE_INFO)


def _as_map(record: Any) -> dict[str, Any]:
    """A record as a map of its fields, nested records as maps (nothing copied)."""
    return {f.name: _as_map(v) if dataclasses.is_dataclass(v := getattr(record, f.name)) else v
            for f in dataclasses.fields(record)}


def _record(cls: type, info: Mapping[str, Any]) -> Any:
    """A record from its checked wire form (DONE_INFO filled the defaults of what was absent)."""
    values = {}
    for f in dataclasses.fields(cls):
        if f.name not in info or info[f.name] is None and f.default is None:
            continue
        inner = _NESTED.get((cls.__name__, f.name))
        values[f.name] = _record(inner, info[f.name]) if inner is not None else info[f.name]
    return cls(**values)


def done_info(info: Mapping[str, Any] | None) -> DoneInfo:
    """The typed record of a checked `done` body's info (the codec checked it against DONE_INFO)."""
    return _record(DoneInfo, info or {})


def dones(reports: Iterable[Any]) -> dict[str, DoneInfo]:
    """Each report's `done` info (a round's reports: anything with `sender` and `get(kind)`), by
    sender; a child that sent no `done` is not in it."""
    return {r.sender: done_info(done.body.get("info")) for r in reports if (done := r.get("done")) is not None}
