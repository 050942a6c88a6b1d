"""PROTOCOL.md as data: its marked tables parsed, and a frame checker built from them alone.

A reader in another language has only the page. This module is that reader: it takes the topic
grammar, the routes table, the envelope keys, the dtype codes and the per-kind field tables
from PROTOCOL.md and judges captured MQTT messages with nothing else (no `splitedge` import),
so a wire that drifts from the page, or a page that drifts from the wire, fails a test.
"""

from __future__ import annotations

import copy
import hashlib
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import numpy as np

DOC = Path(__file__).resolve().parents[1] / "PROTOCOL.md"


class Violation(ValueError):
    """A message that the page does not allow (or a page that cannot be read as data)."""


# -- markdown ------------------------------------------------------------------------------------

def block(text: str, name: str) -> str:
    """The text between `<!-- name:begin -->` and `<!-- name:end -->`."""
    m = re.search(rf"<!-- {re.escape(name)}:begin -->\n(.*?)<!-- {re.escape(name)}:end -->", text, re.S)
    if not m:
        raise Violation(f"PROTOCOL.md has no {name} block")
    return m.group(1)


def _cells(line: str) -> list[str]:
    return [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]


def table(text: str) -> list[dict[str, str]]:
    """The rows of the first markdown table in `text` as {header: cell}, backticks removed."""
    lines = [ln for ln in text.splitlines() if ln.strip().startswith("|")]
    if len(lines) < 2 or not set(lines[1].replace("|", "").strip()) <= set("-: "):
        raise Violation(f"not a markdown table: {text[:80]!r}")
    head = _cells(lines[0])
    rows = []
    for ln in lines[2:]:
        cells = [c.replace("\\|", "|") for c in _cells(ln)]
        if len(cells) != len(head):
            raise Violation(f"row {ln!r} has {len(cells)} cells, the header {len(head)}")
        rows.append({h: _unquote(c) for h, c in zip(head, cells)})
    return rows


def _unquote(cell: str) -> str:
    cell = cell.strip()
    return cell[1:-1] if len(cell) >= 2 and cell[0] == cell[-1] == "`" else cell


# -- types and constraints -----------------------------------------------------------------------

@dataclass(frozen=True)
class Type:
    """`int`, `float`, `number`, `bool`, `str`, `bytes`, `any`, `array`, `map`, `list`, `pages` or `record`."""

    name: str
    of: "Type | None" = None  # map values, list and pages items
    ref: str = ""  # a record: the name of its table (`record<done.info>`)
    dtypes: tuple[str, ...] = ()  # arrays; () = any whitelisted dtype
    shape: tuple[str, ...] | None = None  # arrays; None = any shape


SCALARS = ("int", "float", "number", "bool", "str", "bytes", "any")


def parse_type(text: str) -> Type:
    s = text.strip()
    if s in SCALARS:
        return Type(s)
    if s.startswith("map<") and s.endswith(">"):
        key, _, value = s[4:-1].partition(",")
        if key.strip() != "str":
            raise Violation(f"map keys must be str in {text!r}")
        return Type("map", of=parse_type(value))
    if s.startswith("list<") and s.endswith(">"):
        return Type("list", of=parse_type(s[5:-1]))
    if s.startswith("record<") and s.endswith(">"):
        return Type("record", ref=s[7:-1].strip())
    if s.startswith("pages<") and s.endswith(">"):
        return Type("pages", of=parse_type(s[6:-1]))
    m = re.fullmatch(r"array<([a-z0-9, ]+)>(?:\[([A-Za-z0-9_., ]+)\])?", s)
    if m:
        dtypes = tuple(d.strip() for d in m.group(1).split(","))
        shape = tuple(d.strip() for d in m.group(2).split(",")) if m.group(2) else None
        return Type("array", dtypes=() if dtypes == ("any",) else dtypes, shape=shape)
    raise Violation(f"unknown type {text!r}")


_BOUND = re.compile(r"(>=|>|<=) (-?[0-9.e+]+)")


def parse_constraints(text: str) -> list[tuple[str, Any]]:
    """`finite; >= 0; matches /re/; ...` -> [(name, argument)]; an unknown one is an error."""
    out: list[tuple[str, Any]] = []
    for item in (c.strip() for c in text.split(";")):
        if item in ("", "-"):
            continue
        if item in ("finite", "unique", "sha256 of model"):
            out.append((item, None))
        elif m := _BOUND.fullmatch(item):
            out.append((m.group(1), float(m.group(2))))
        elif m := re.fullmatch(r"matches /(.*)/", item):
            out.append(("matches", re.compile(m.group(1))))
        elif m := re.fullmatch(r"one of (.+)", item):
            out.append(("one of", {c.strip() for c in m.group(1).split(",")}))
        elif m := re.fullmatch(r"(len|items|keys len|depth) <= (\d+)", item):
            out.append((m.group(1), int(m.group(2))))
        else:
            raise Violation(f"unknown constraint {item!r}")
    return out


@dataclass(frozen=True)
class FieldDoc:
    name: str
    type: Type
    required: bool
    constraints: tuple[tuple[str, Any], ...]


@dataclass(frozen=True)
class Route:
    tier: str
    direction: str
    to: str  # "-", "@all", "@<g>", or "<X>" (a node id)
    segment: str  # the kind segment: kind or kind-slot
    retained: str  # "yes", "no" or "yes, unless stop with reason"

    def takes(self, to: str | None) -> bool:
        if self.to == "-":
            return to is None
        if to is None:
            return False
        if self.to == "@all":  # the reserved address: exactly itself
            return to == self.to
        if self.to.startswith("@<"):
            return to.startswith("@") and to != "@all"
        return self.to.startswith("<") and not to.startswith("@")


@dataclass
class ProtocolDoc:
    prefix: str
    routes: list[Route]
    envelope: dict[str, str]  # key -> type
    version: int
    dtypes: dict[int, tuple[str, np.dtype]]  # code -> (name, numpy dtype)
    kinds: dict[str, dict[str, FieldDoc]] = field(default_factory=dict)
    records: dict[str, dict[str, FieldDoc]] = field(default_factory=dict)  # typed records inside bodies

    @classmethod
    def parse(cls, text: str) -> "ProtocolDoc":
        grammar = block(text, "grammar")
        m = re.search(r"^(\w+)/<run>/<tier>/<id>/<direction>/<kind>\[/<to>\]$", grammar, re.M)
        if not m:
            raise Violation("PROTOCOL.md's grammar block does not read prefix/<run>/<tier>/<id>/<direction>/<kind>[/<to>]")
        routes = [Route(r["tier"], r["direction"], r["to"], r["kind segment"], r["retained"])
                  for r in table(block(text, "routes"))]
        for r in routes:
            if r.retained not in ("yes", "no", "yes, unless stop with reason"):
                raise Violation(f"route {r}: unknown retained value")
        envelope = {r["key"]: r["type"] for r in table(block(text, "envelope"))}
        version = re.search(r"`(\d+)`", next(r["meaning"] for r in table(block(text, "envelope")) if r["key"] == "v"))
        dtypes = {int(r["code"]): (r["name"], np.dtype(r["numpy"].split()[0].strip("`")))
                  for r in table(block(text, "dtypes"))}
        for code, (name, dt) in dtypes.items():
            if dt.itemsize != int(next(r["itemsize"] for r in table(block(text, "dtypes")) if int(r["code"]) == code)):
                raise Violation(f"dtype {name}: numpy itemsize disagrees with the itemsize column")
        kinds = {name: _fields(text, f"kind:{name}") for name in re.findall(r"<!-- kind:([a-z][a-z0-9_]*):begin -->", text)}
        records = {name: _fields(text, f"record:{name}")
                   for name in re.findall(r"<!-- record:([a-z][a-z0-9_.]*):begin -->", text)}
        return cls(m.group(1), routes, envelope, int(version.group(1)), dtypes, kinds, records)

    @classmethod
    def load(cls, path: Path = DOC) -> "ProtocolDoc":
        return cls.parse(path.read_text(encoding="utf-8"))

    def without_field(self, kind: str, name: str) -> "ProtocolDoc":
        """A copy of the page with one field row deleted (for tests that the checker can fail)."""
        out = copy.deepcopy(self)
        del out.kinds[kind][name]
        return out

    def without_route(self, **match: str) -> "ProtocolDoc":
        out = copy.deepcopy(self)
        out.routes = [r for r in out.routes if any(getattr(r, k) != v for k, v in match.items())]
        return out


# -- decoding with the page's tables only ---------------------------------------------------------

@dataclass(frozen=True)
class WireArray:
    """An ext type 1 value as the page describes it: dtype name, shape, elements."""

    dtype: str
    values: np.ndarray


def _ext_hook(doc: ProtocolDoc):
    def hook(code: int, data: bytes) -> Any:
        if code != 1:
            raise Violation(f"ext type {code} is not documented")
        if len(data) < 2 or data[0] not in doc.dtypes:
            raise Violation(f"array dtype code {data[:1].hex()} is not in the dtype table")
        name, dt = doc.dtypes[data[0]]
        ndim = data[1]
        if ndim > 8 or len(data) < 2 + 4 * ndim:
            raise Violation(f"array header: ndim {ndim}, {len(data)} bytes")
        dims = [int.from_bytes(data[2 + 4 * i:6 + 4 * i], "little") for i in range(ndim)]
        raw = data[2 + 4 * ndim:]
        if len(raw) != math.prod(dims) * dt.itemsize:
            raise Violation(f"array data: {len(raw)} bytes for dims {dims} of {name}")
        return WireArray(name, np.frombuffer(raw, dtype=dt).reshape(dims))
    return hook


def unpack(doc: ProtocolDoc, payload: bytes) -> Any:
    """Exactly one msgpack object, arrays per the page's ext layout."""
    unpacker = msgpack.Unpacker(raw=False, ext_hook=_ext_hook(doc), strict_map_key=False)
    unpacker.feed(payload)
    try:
        obj = unpacker.unpack()
    except msgpack.OutOfData as exc:
        raise Violation("truncated frame") from exc
    if unpacker.tell() != len(payload):
        raise Violation(f"{len(payload) - unpacker.tell()} bytes after the envelope")
    return obj


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _bounds(path: str, values: Any, constraints: list[tuple[str, Any]]) -> None:
    arr = np.asarray(values)
    for name, arg in constraints:
        ok = {">=": lambda: np.all(arr >= arg), ">": lambda: np.all(arr > arg), "<=": lambda: np.all(arr <= arg)}.get(name)
        if ok is not None and arr.size and not ok():
            raise Violation(f"{path}: not {name} {arg:g}")


def _unpage(path: str, value: Any) -> list:
    """A `pages<T>` value as the page describes it: a list<T>, or non-empty pages of <= 1024 T."""
    if not isinstance(value, list):
        raise Violation(f"{path}: expected list, got {type(value).__name__}")
    if not value or not all(isinstance(v, list) for v in value):
        return value
    for n, page in enumerate(value):
        if not 0 < len(page) <= 1024:
            raise Violation(f"{path}[{n}]: a page of {len(page)} items")
    return [item for page in value for item in page]


def _fields(text: str, name: str) -> dict[str, FieldDoc]:
    """A field table (a kind's or a record's) by field name."""
    fields = {}
    for r in table(block(text, name)):
        required = r["required"].strip()
        if required != "yes" and not required.startswith("no"):
            raise Violation(f"{name}.{r['field']}: required must be yes or no, got {required!r}")
        fields[r["field"]] = FieldDoc(r["field"], parse_type(r["type"]), required == "yes",
                                      tuple(parse_constraints(r["constraints"])))
    return fields


RECORDS: dict[str, dict[str, FieldDoc]] = {}
"""The page's records while a body is checked (check_body sets them)."""


def _check_fields(where: str, body: Any, fields: dict[str, FieldDoc]) -> dict[str, int]:
    """A body or a record against its table: no field it does not list, each listed one as it says."""
    if not isinstance(body, dict):
        raise Violation(f"{where}: body is a {type(body).__name__}, not a map")
    for key in body:
        if key not in fields and "*" not in fields:
            raise Violation(f"{where}: field {key!r} is not in its table")
    dims: dict[str, int] = {}
    for name, f in fields.items():
        if name == "*":
            continue
        if name not in body:
            if f.required:
                raise Violation(f"{where}: required field {name!r} is missing")
            continue
        check_value(f"{where}.{name}", body[name], f.type, list(f.constraints), dims)
    return dims


def check_value(path: str, value: Any, t: Type, constraints: list[tuple[str, Any]], dims: dict[str, int]) -> None:
    c = dict(constraints)
    if t.name == "record":
        if t.ref not in RECORDS:
            raise Violation(f"{path}: record {t.ref!r} has no table")
        _check_fields(path, value, RECORDS[t.ref])
        return
    if t.name == "pages":
        items = _unpage(path, value)
        if len(items) > c.get("items", 1024):
            raise Violation(f"{path}: {len(items)} entries > {c.get('items', 1024)}")
        inner = [(n, a) for n, a in constraints if n != "items"]
        for i, v in enumerate(items):
            check_value(f"{path}.{i}", v, t.of, inner, {})
        return
    if t.name in ("map", "list"):
        limit = c.get("items", 65536 if t.name == "map" else 1024)
        inner = [(n, a) for n, a in constraints if n not in ("items", "keys len")]
        if t.name == "map":
            if not isinstance(value, dict):
                raise Violation(f"{path}: expected map, got {type(value).__name__}")
            for k in value:
                if not isinstance(k, str) or len(k) > c.get("keys len", 256):
                    raise Violation(f"{path}: bad key {k!r:.40}")
            items = list(value.items())
        else:
            if not isinstance(value, list):
                raise Violation(f"{path}: expected list, got {type(value).__name__}")
            items = list(enumerate(value))
        if len(items) > limit:
            raise Violation(f"{path}: {len(items)} entries > {limit}")
        for k, v in items:
            check_value(f"{path}.{k}", v, t.of, inner, {})
        return
    if t.name == "int":
        if not _is_int(value):
            raise Violation(f"{path}: expected int, got {type(value).__name__}")
    elif t.name in ("float", "number"):
        if not (_is_int(value) or isinstance(value, float)):
            raise Violation(f"{path}: expected {t.name}, got {type(value).__name__}")
        if isinstance(value, float) and (t.name == "float" or "finite" in c) and not math.isfinite(value):
            raise Violation(f"{path}: not finite")
    elif t.name == "bool":
        if not isinstance(value, bool):
            raise Violation(f"{path}: expected bool, got {type(value).__name__}")
    elif t.name == "bytes":
        if not isinstance(value, bytes):
            raise Violation(f"{path}: expected bytes, got {type(value).__name__}")
    elif t.name == "str":
        if not isinstance(value, str):
            raise Violation(f"{path}: expected str, got {type(value).__name__}")
        if len(value) > c.get("len", 256):
            raise Violation(f"{path}: longer than {c.get('len', 256)}")
        if "matches" in c and not c["matches"].fullmatch(value):
            raise Violation(f"{path}: {value!r} does not match /{c['matches'].pattern}/")
        if "one of" in c and value not in c["one of"]:
            raise Violation(f"{path}: {value!r} not one of {sorted(c['one of'])}")
    elif t.name == "any":
        _check_plain(path, value, c.get("depth", 8), 0)
    elif t.name == "array":
        if not isinstance(value, WireArray):
            raise Violation(f"{path}: expected array, got {type(value).__name__}")
        if t.dtypes and value.dtype not in t.dtypes:
            raise Violation(f"{path}: dtype {value.dtype} not in {t.dtypes}")
        if t.shape is not None:
            _match_shape(path, value.values.shape, t.shape, dims)
        if "finite" in c and value.dtype.startswith("f") and not np.isfinite(value.values).all():
            raise Violation(f"{path}: NaN or Inf")
        if "unique" in c and np.unique(value.values).size != value.values.size:
            raise Violation(f"{path}: not unique")
    _bounds(path, value.values if isinstance(value, WireArray) else value, constraints)


def _match_shape(path: str, shape: tuple[int, ...], spec: tuple[str, ...], dims: dict[str, int]) -> None:
    fixed = spec[:-1] if spec[-1] == "..." else spec
    if len(shape) < len(fixed) or (spec[-1] != "..." and len(shape) != len(fixed)):
        raise Violation(f"{path}: shape {shape} does not match {list(spec)}")
    for size, want in zip(shape, fixed):
        if want.isdigit() and size != int(want):
            raise Violation(f"{path}: shape {shape} does not match {list(spec)}")
        if not want.isdigit() and dims.setdefault(want, size) != size:
            raise Violation(f"{path}: {want}={size} but {want}={dims[want]} elsewhere")


def _check_plain(path: str, value: Any, max_depth: int, depth: int) -> None:
    if depth > max_depth:
        raise Violation(f"{path}: nested deeper than {max_depth}")
    if value is None or isinstance(value, (bool, int, float, str, bytes, WireArray)):
        return
    if isinstance(value, list):
        for i, v in enumerate(value):
            _check_plain(f"{path}[{i}]", v, max_depth, depth + 1)
    elif isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                raise Violation(f"{path}: map key {k!r:.40} is not str")
            _check_plain(f"{path}.{k}", v, max_depth, depth + 1)
    else:
        raise Violation(f"{path}: {type(value).__name__} is not plain data")


def check_body(doc: ProtocolDoc, kind: str, body: Any) -> None:
    if kind not in doc.kinds:
        raise Violation(f"kind {kind!r} is not documented")
    fields = doc.kinds[kind]
    RECORDS.clear()
    RECORDS.update(doc.records)
    _check_fields(kind, body, fields)
    for name, f in fields.items():
        if name in body and ("sha256 of model", None) in f.constraints \
                and hashlib.sha256(body.get("model", b"")).hexdigest() != body[name]:
            raise Violation(f"{kind}.{name}: not the SHA-256 of model")
    if "*" in fields:
        for key in set(body) - set(fields):
            check_value(f"{kind}.{key}", body[key], fields["*"].type, list(fields["*"].constraints), {})


_ENVELOPE_TYPES = {"int": _is_int, "str": lambda v: isinstance(v, str), "map": lambda v: isinstance(v, dict)}


def check_message(doc: ProtocolDoc, topic: str, payload: bytes, retain: bool) -> dict[str, Any] | None:
    """Judge one captured PUBLISH by the page alone; returns the envelope (None for a retained
    clear) or raises Violation naming what the page does not allow."""
    parts = topic.split("/")
    if len(parts) not in (6, 7) or parts[0] != doc.prefix or not all(parts):
        raise Violation(f"{topic}: not {doc.prefix}/<run>/<tier>/<id>/<direction>/<kind>[/<to>]")
    _, run, tier, node, direction, segment, *rest = parts
    to = rest[0] if rest else None
    routes = [r for r in doc.routes if (r.tier, r.direction, r.segment) == (tier, direction, segment) and r.takes(to)]
    if not routes:
        raise Violation(f"{topic}: no documented route for {tier} {direction} {segment} to {to or '-'}")
    route = routes[0]
    if not payload:
        if not (retain and route.retained != "no"):
            raise Violation(f"{topic}: an empty payload is only a retained clear of a retained topic")
        return None
    env = unpack(doc, payload)
    if not isinstance(env, dict) or set(env) != set(doc.envelope):
        raise Violation(f"{topic}: envelope keys {sorted(env) if isinstance(env, dict) else type(env)} != "
                        f"{sorted(doc.envelope)}")
    for key, t in doc.envelope.items():
        if not _ENVELOPE_TYPES[t](env[key]):
            raise Violation(f"{topic}: envelope {key} is not a {t}")
    for key in ("r", "s", "i"):
        if not 1 <= len(env[key]) <= 128:
            raise Violation(f"{topic}: envelope {key} length {len(env[key])}")
    if env["v"] != doc.version or not 0 <= env["n"] < 2**63:
        raise Violation(f"{topic}: envelope v={env['v']} n={env['n']}")
    if (env["r"], env["s"], env["k"]) != (run, node, segment.split("-", 1)[0]):
        raise Violation(f"{topic}: envelope run/sender/kind {env['r']}/{env['s']}/{env['k']} disagree with the topic")
    try:
        check_body(doc, env["k"], env["b"])
    except Violation as exc:
        raise Violation(f"{topic}: {exc}") from None
    body = env["b"]
    want = {"yes": True, "no": False}.get(route.retained)
    if want is None:  # "yes, unless stop with reason"
        directives = body.get("directives")
        want = not (body.get("stop") is True and isinstance(directives, dict) and "reason" in directives)
    if retain != want:
        raise Violation(f"{topic}: retain {retain}, the routes table says {route.retained!r}")
    return env


__all__ = ["DOC", "ProtocolDoc", "Route", "FieldDoc", "Type", "Violation", "WireArray", "block", "table",
           "check_message", "check_body", "unpack", "parse_type", "parse_constraints"]
