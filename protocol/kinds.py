"""The built-in message kinds of docs/internals.md and their body schemas.

Importing this module registers them (``import splitedge.protocol`` does); a registry entry is data,
not a process-wide side effect, and re-importing registers the same objects again harmlessly.
"""

from __future__ import annotations

import hashlib
from typing import Any

from .errors import ProtocolError
from .schema import (
    ALL_DTYPES, FLOAT_DTYPES, Array, Bool, Bytes, Data, Float, Int, Map, Number, Scalar, Schema,
    Str, register_kind,
)

__all__ = ["BUILTIN_KINDS", "kinds_markdown"]

_VERSION = Int(ge=0)
# The cloud's run incarnation: a run id is reused when a cloud restarts, so retained models and
# cached moments of an earlier incarnation must be told apart from the current one.
_SESSION = Str(optional=True, default="", pattern="[0-9a-f]{0,32}")
_CLASSES = Array(dtypes="i8", shape=("K",), ge=0, unique=True)


def _sha256_matches(body: dict[str, Any]) -> None:
    """The model bytes must hash to the announced digest (catches truncation/corruption)."""
    if hashlib.sha256(body["model"]).hexdigest() != body["sha256"]:
        raise ProtocolError("schema.check", "onnx_model: sha256 does not match model bytes")


BUILTIN_KINDS: dict[str, Schema] = {
    "hello": Schema({
        "role": Str(), "parent": Str(), "samples": Int(ge=0), "backend": Str(),
        "classes": _CLASSES, "members": Int(ge=0, optional=True, default=0),
    }, doc="any -> up (retained); an edge reports how many devices joined it in `members`"),
    "status": Schema({
        "state": Str(choices=("online", "offline")), "role": Str(),
    }, doc="any (retained, last will)"),
    "round": Schema({
        "method": Str(), "slow_wc": Bool(), "slow_we": Bool(), "deadline_s": Float(gt=0),
        "wc_version": _VERSION, "we_version": _VERSION, "config": Map(values=Scalar()),
    }, doc="cloud/edge -> down (retained)"),
    "moments": Schema({
        "classes": _CLASSES,
        "counts": Array(dtypes="i8", shape=("K",), ge=1),
        "mean": Array(dtypes=FLOAT_DTYPES, shape=("K", "D"), finite=True),
        "var": Array(dtypes=FLOAT_DTYPES, shape=("K", "D"), finite=True, ge=0),
        "wc_version": _VERSION, "we_version": _VERSION,
        "space": Str(choices=("wc", "we")), "session": _SESSION,
    }, doc="device -> edge, edge -> cloud"),
    "weights": Schema({
        "part": Str(choices=("wc", "we", "wg", "model")), "version": _VERSION,
        "samples": Int(ge=0), "weights": Map(values=Array(dtypes=ALL_DTYPES, finite=True)), "session": _SESSION,
    }, doc="any; float arrays must be finite (int buffers such as num_batches_tracked allowed)"),
    "logits": Schema({
        "classes": _CLASSES,
        "counts": Array(dtypes="i8", shape=("K",), ge=0),
        "logits": Array(dtypes="f4", shape=("K", "C"), finite=True),
    }, doc="device -> edge, edge -> cloud"),
    "activations": Schema({
        "batch": Int(ge=0),
        "x": Array(dtypes=("f2", "f4"), shape=("B", "..."), finite=True),
        "y": Array(dtypes="i8", shape=("B",)),
    }, doc="device -> edge (SplitFed)"),
    "gradients": Schema({
        "batch": Int(ge=0),
        "grad": Array(dtypes="f4", shape=("B", "..."), finite=True),
    }, doc="edge -> device (SplitFed)"),
    "onnx_model": Schema({
        "part": Str(), "version": _VERSION, "model": Bytes(),
        "sha256": Str(pattern="[0-9a-f]{64}"), "session": _SESSION,
    }, checks=(_sha256_matches,), doc="down"),
    "metrics": Schema({}, extra=Number(), doc="cloud -> down/out; the body is the metrics map"),
    "request": Schema({
        "what": Str(choices=("moments",)),
    }, doc="edge -> one device: resend state the edge lost or never got (e.g. after a restart)"),
    "done": Schema({
        "phase": Str(), "info": Data(optional=True, default={}),
    }, doc="any -> up; round-completion marker"),
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
