"""Body schemas and the registry of message kinds.

A kind's schema is checked on every decode (a peer's bad message must never reach
aggregation state) and, by default, on every encode (a local caller's mistake raises early,
as a ``ValueError``). Methods add kinds with ``register_kind`` without touching the codec.
The field specs live in fields.py and are re-exported here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from .errors import ProtocolError
from .fields import (  # noqa: F401 - re-exported: schema.py is the documented home of the specs
    ALL_DTYPES, FLOAT_DTYPES, Array, Bool, Bytes, Data, Dims, Field, Float, Int, List, Map, Number,
    Paged, Scalar, Str, _fail,
)

__all__ = [
    "Field", "Int", "Float", "Number", "Bool", "Str", "Bytes", "Scalar", "Array", "Map", "List", "Paged", "Data",
    "Record", "Schema", "FLOAT_DTYPES", "ALL_DTYPES", "register_kind", "get_schema", "registered_kinds",
    "validate_body",
]

_MISSING = object()


def _run_check(kind: str, check: Callable[[dict[str, Any]], None], body: dict[str, Any]) -> None:
    """Cross-field checks are user code: any failure becomes a ProtocolError."""
    try:
        check(body)
    except ProtocolError:
        raise
    except Exception as exc:  # noqa: BLE001 - a peer's data must never crash the receiver
        raise ProtocolError("schema.check", f"{kind}: {exc}") from exc


@dataclass(frozen=True)
class Schema:
    """Fields of a message body; unknown fields are rejected unless ``extra`` is given.

    ``extra`` (a Field) admits any other str key (e.g. the ``metrics`` kind); ``checks`` are
    cross-field callables ``check(body) -> None`` that raise on a bad body.
    """

    fields: Mapping[str, Field] = field(default_factory=dict)
    extra: Field | None = None
    checks: tuple[Callable[[dict[str, Any]], None], ...] = ()
    doc: str = ""

    def validate(self, body: Any, kind: str = "body") -> dict[str, Any]:
        """Return a new, normalised body dict (defaults filled) or raise ProtocolError."""
        if not isinstance(body, Mapping):
            raise _fail("schema.type", kind, f"body must be a map, got {type(body).__name__}")
        for key in body:
            if not isinstance(key, str):
                raise _fail("schema.key", kind, f"body key {key!r:.80} is not str")
            if key not in self.fields and self.extra is None:
                raise _fail("schema.unknown_field", kind, f"unknown field {key!r:.80}")
        dims: Dims = {}
        out: dict[str, Any] = {}
        for name, spec in self.fields.items():
            value = body.get(name, _MISSING)
            if value is None and spec.optional and spec.default is None:
                value = _MISSING  # a receiver's filled-in absence, relayed: absent again (`wire`)
            path = f"{kind}.{name}"
            out[name] = spec.missing(path) if value is _MISSING else spec.check(path, value, dims)
        for key in body:
            if key not in self.fields:
                out[key] = self.extra.check(f"{kind}.{key}", body[key], dims)
        for check in self.checks:
            _run_check(kind, check, out)
        return out

    def wire(self, body: dict[str, Any]) -> dict[str, Any]:
        """A validated body as it goes on the wire: each field's wire form (Paged lists paged); an
        optional field left at a default of None is left out (absent, not nil: a receiver fills it)."""
        return {k: self.fields[k].wire(v) if k in self.fields else v for k, v in body.items()
                if not (v is None and k in self.fields and self.fields[k].optional and self.fields[k].default is None)}

    def describe(self) -> str:
        parts = [f"`{name}`: {spec.describe()}" for name, spec in self.fields.items()]
        if self.extra is not None:
            parts.append(f"any other key: {self.extra.describe()}")
        return "; ".join(parts)


@dataclass(frozen=True, kw_only=True)
class Record(Field):
    """A typed record inside a body (a `done`'s info, protocol/done.py): a map checked against its
    own schema, defaults filled, unknown keys refused."""

    schema: Schema = field(default_factory=Schema)

    def check(self, path: str, value: Any, dims: Dims) -> dict[str, Any]:
        return self.schema.validate(value, path)

    def wire(self, value: dict[str, Any]) -> dict[str, Any]:
        """Only what differs from its field's default: the receiver fills the rest (a device's
        `done` stays a few bytes)."""
        if value is None:
            return value
        out: dict[str, Any] = {}
        for key, item in value.items():
            spec = self.schema.fields.get(key)
            item = spec.wire(item) if spec is not None else item
            if spec is None or not spec.optional or not _unsaid(spec, item):
                out[key] = item
        return out

    def describe(self) -> str:
        return self._opt("record")


def _unsaid(spec: Field, value: Any) -> bool:
    """Whether an optional field's wire value says nothing its receiver would not fill in: its
    default (arrays never are), or for a nested record nothing at all."""
    if isinstance(spec, Record):
        return value is None or value == {}
    return type(value) is type(spec.default) and not hasattr(value, "shape") and value == spec.default


_REGISTRY: dict[str, Schema] = {}
_KIND_RE = re.compile(r"[a-z][a-z0-9_]{0,63}")


def register_kind(name: str, schema: Schema) -> Schema:
    """Register a message kind; re-registering an equal schema is a no-op, a different one a ValueError."""
    if not isinstance(name, str) or _KIND_RE.fullmatch(name) is None:
        raise ValueError(f"kind name {name!r} must match {_KIND_RE.pattern}")
    if not isinstance(schema, Schema):
        raise TypeError(f"schema for {name!r} must be a Schema, got {type(schema).__name__}")
    current = _REGISTRY.get(name)
    if current is not None and current != schema:
        raise ValueError(f"kind {name!r} is already registered with a different schema")
    _REGISTRY[name] = schema
    return schema


def get_schema(kind: str) -> Schema:
    """The schema of a registered kind; ProtocolError ``envelope.kind_unknown`` otherwise."""
    schema = _REGISTRY.get(kind) if isinstance(kind, str) else None
    if schema is None:
        raise ProtocolError("envelope.kind_unknown", f"unknown message kind {kind!r:.80}")
    return schema


def registered_kinds() -> list[str]:
    return sorted(_REGISTRY)


def validate_body(kind: str, body: Any) -> dict[str, Any]:
    """Validate ``body`` against the registered schema of ``kind``."""
    return get_schema(kind).validate(body, kind)
