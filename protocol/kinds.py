"""The built-in message kinds of docs/internals.md and their body schemas.

Importing this module registers them (``import splitedge.protocol`` does); a registry entry is data,
not a process-wide side effect, and re-importing registers the same objects again harmlessly.
"""

from __future__ import annotations

from typing import Any

from .done import DONE_INFO
from .errors import ProtocolError
from .schema import (
    ALL_DTYPES, FLOAT_DTYPES, Array, Bool, Data, Float, Int, List, Map, Number, Paged, Record, Schema, Str,
    register_kind,
)

__all__ = ["BUILTIN_KINDS", "NAME_PATTERN", "kinds_markdown"]

_VERSION = Int(ge=0)
NAME_PATTERN = "[a-z][a-z0-9_]{0,31}"
_NAME = Str(pattern=NAME_PATTERN, max_len=32)
"""A model part, feature space, record or slot name chosen by a method (free-form, no '-')."""
_ID = Str(max_len=128, pattern=r"[^/+#\x00]+")
_IDS = Paged(items=_ID, max_items=65536)
"""Node ids of a whole federation (an edge's members, a round's participants): paged past 1024."""
_VERSIONS = Map(values=Int(ge=0), max_entries=64, key_max_len=32)
"""{model name: version}: which versions of a method's models a round or a statistic uses."""
# The cloud's run incarnation: a run id is reused when a cloud restarts, so retained models and
# cached moments of an earlier incarnation must be told apart from the current one.
_SESSION = Str(optional=True, default="", pattern="[0-9a-f]{0,32}")
_CLASSES = Array(dtypes="i8", shape=("K",), ge=0, unique=True)


BUILTIN_KINDS: dict[str, Schema] = {
    "hello": Schema({
        "role": Str(), "parent": Str(), "samples": Int(ge=0), "backend": Str(),
        "classes": _CLASSES.but(optional=True), "members": _IDS.but(optional=True, default=[]),
        "groups": List(items=_NAME, max_items=64, optional=True, default=[]),
    }, doc="any -> up (retained); an edge lists its live devices in `members`, a device its `groups`"),
    "status": Schema({
        "state": Str(choices=("online", "offline")), "role": Str(),
    }, doc="any (retained, last will)"),
    "round": Schema({
        "method": Str(max_len=64), "session": _SESSION, "deadline_s": Float(gt=0), "versions": _VERSIONS,
        "config": Data(), "directives": Data(optional=True, default={}),
        "stop": Bool(optional=True, default=False), "attempt": Int(ge=0, optional=True, default=0),
        "phase": Str(choices=("train", "calibrate", "evaluate"), optional=True, default="train"),
        "participants": _IDS.but(optional=True, default=[]),
    }, doc="cloud/edge -> down (retained); `config` is the method's typed config as a nested map, "
           "`directives` what the method asks of this round, `phase` its training or its calibration, "
           "`participants` the devices drawn (empty: all), `stop` ends the run"),
    "assign": Schema({
        "edge": Str(max_len=128), "groups": List(items=_NAME, max_items=64),
        "peers": List(items=_ID, max_items=1024),
    }, doc="cloud -> one device (through its edge, retained): the edge it reports to, its groups, "
           "its peer devices"),
    "moments": Schema({
        "classes": _CLASSES,
        "counts": Array(dtypes="i8", shape=("K",), ge=1),
        "mean": Array(dtypes=FLOAT_DTYPES, shape=("K", "D"), finite=True),
        "var": Array(dtypes=FLOAT_DTYPES, shape=("K", "D"), finite=True, ge=0),
        "space": _NAME, "versions": _VERSIONS, "session": _SESSION,
    }, doc="per-class count, mean and variance of features in a named `space`, computed with "
           "the model `versions` named"),
    "weights": Schema({
        "part": _NAME, "version": _VERSION, "samples": Int(ge=0),
        "weights": Map(values=Array(dtypes=ALL_DTYPES, finite=True)), "session": _SESSION,
        "codec": Str(choices=("dense", "int8", "topk", "base"), optional=True),
        "scales": Map(values=Array(dtypes=FLOAT_DTYPES, finite=True), optional=True),
        "indices": Map(values=Array(dtypes="i4"), optional=True),
        "base": Int(ge=0, optional=True),
    }, doc="a named model `part` as name -> array (a state dict without torch); float arrays must "
           "be finite (int buffers such as num_batches_tracked allowed); a device's compressed update "
           "(`codec` int8: int8 deltas and their `scales`; topk: delta values at `indices`) against the "
           "model `version` it was trained from; from the cloud, a model compressed against the `base` "
           "version the node holds (runtime/downlink.py; `codec` base: the model is that base), or a "
           "dense model that is a base (`base` = its `version`)"),
    "arrays": Schema({
        "name": _NAME, "version": _VERSION,
        "arrays": Map(values=Array(dtypes=ALL_DTYPES, finite=True)),
        "scalars": Map(values=Number(finite=True), optional=True, default={}), "session": _SESSION,
    }, doc="a generic record: named arrays and scalars under a method-chosen `name`"),
    "logits": Schema({
        "classes": _CLASSES,
        "counts": Array(dtypes="i8", shape=("K",), ge=0),
        "logits": Array(dtypes="f4", shape=("K", "C"), finite=True),
        "versions": _VERSIONS.but(optional=True, default={}), "session": _SESSION,
    }, doc="per-class mean logits (knowledge distillation)"),
    "metrics": Schema({}, extra=Number(), doc="cloud -> up (retained), once per round: its numeric metrics "
                                               "(accuracy, ...) for watchers; no node reads it"),
    "request": Schema({
        "what": _NAME,
    }, doc="parent -> one child: resend state the parent lost or never got (e.g. after a restart)"),
    "secagg": Schema({
        "stage": Str(choices=("keys", "roster", "shares", "inbox", "masked", "unmask", "reveal", "signed",
                              "signatures", "abort")),
        "batch": Int(ge=0, le=4), "sum": Str(pattern=f"{NAME_PATTERN}[.]{NAME_PATTERN}", max_len=65),
        "data": Data(), "meta": Data(optional=True, default={}), "session": _SESSION,
    }, doc="device <-> its edge: one exchange of secure aggregation (runtime/secure_sum.py); `batch` numbers "
           "the exchange (4: the consistency round of signed federations, between 2 and 3), `sum` names the aggregation (kind.what), `data` is secagg's message (methods/privacy/messages.py, checked there), `meta` what a "
           "masked input sums (kind, space, versions, dtype; for moments whether the merge weighs samples or devices) in the clear"),
    "done": Schema({
        "phase": Str(), "info": Record(schema=DONE_INFO, optional=True, default={}), "session": _SESSION,
    }, doc="any -> up; round-completion marker (`phase`: round, or calibrate); `info` the node's typed "
           "record (protocol/done.py); a `done` of another session (a replay from an earlier run) is dropped"),
}

for _name, _schema in BUILTIN_KINDS.items():
    register_kind(_name, _schema)


def kinds_markdown(schemas: dict[str, Schema] | None = None) -> str:
    """The kinds table of PROTOCOL.md, generated from the schemas so it cannot drift."""
    rows = ["| kind | direction | body |", "|---|---|---|"]
    for name, schema in (schemas or BUILTIN_KINDS).items():
        cells = (f"`{name}`", schema.doc, schema.describe())
        rows.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(rows)
