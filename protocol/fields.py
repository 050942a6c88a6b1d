"""Field specs for body schemas (see schema.py for ``Schema`` and the kind registry).

Each spec checks one value and returns it normalised, or raises ProtocolError naming the rule
broken (``schema.type``, ``schema.bounds``, ``schema.finite``, ``schema.shape`` ...). Array
fields name their dimensions symbolically (``shape=("K", "D")``); one validation pass binds each
symbol once, so ``mean[K,D]``, ``var[K,D]`` and ``classes[K]`` must agree.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import re
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

from .arrays import DTYPE_CODES, dtype_name
from .errors import ProtocolError
from .limits import MAX_ARRAY_LEN

__all__ = [
    "Field", "Int", "Float", "Number", "Bool", "Str", "Bytes", "Scalar", "Array", "Map", "List", "Paged", "Data",
    "FLOAT_DTYPES", "ALL_DTYPES", "Dims",
]

Dims = dict[str, int]
FLOAT_DTYPES = ("f2", "f4", "f8")
ALL_DTYPES = tuple(DTYPE_CODES)


def _is_int(v: Any) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def _is_real(v: Any) -> bool:
    return _is_int(v) or isinstance(v, (float, np.floating))


def _fail(rule: str, path: str, message: str) -> ProtocolError:
    return ProtocolError(rule, f"{path}: {message}")


def _check_bounds(path: str, value: Any, ge: Any, gt: Any, le: Any) -> None:
    """Scalar or element-wise bounds; arrays are checked with numpy reductions."""
    arr = np.asarray(value)
    if ge is not None and not np.all(arr >= ge):
        raise _fail("schema.bounds", path, f"must be >= {ge}")
    if gt is not None and not np.all(arr > gt):
        raise _fail("schema.bounds", path, f"must be > {gt}")
    if le is not None and not np.all(arr <= le):
        raise _fail("schema.bounds", path, f"must be <= {le}")


def _bounds_text(ge: Any, gt: Any, le: Any) -> str:
    parts = [f"{op} {v}" for op, v in ((">=", ge), (">", gt), ("<=", le)) if v is not None]
    return (" " + " ".join(parts)) if parts else ""


@dataclass(frozen=True, kw_only=True)
class Field:
    """Base field spec. ``optional`` fields take ``default`` (copied) when absent."""

    optional: bool = False
    default: Any = None

    def check(self, path: str, value: Any, dims: Dims) -> Any:
        """Return the (normalised) value or raise ProtocolError naming the broken rule."""
        raise NotImplementedError

    def describe(self) -> str:
        """Short human text used in PROTOCOL.md's kinds table."""
        raise NotImplementedError

    def wire(self, value: Any) -> Any:
        """The checked ``value`` as it goes on the wire (the same, but for Paged)."""
        return value

    def but(self, **changes: Any) -> "Field":
        """A copy with some settings changed (specs are frozen), e.g. ``spec.but(optional=True)``."""
        return dataclasses.replace(self, **changes)

    def missing(self, path: str) -> Any:
        if not self.optional:
            raise _fail("schema.missing", path, "required field is missing")
        return copy.deepcopy(self.default)

    def _opt(self, text: str) -> str:
        return f"{text} (optional, default {self.default!r})" if self.optional else text


@dataclass(frozen=True, kw_only=True)
class Int(Field):
    """An integer (bool is not an integer here)."""

    ge: int | None = None
    le: int | None = None

    def check(self, path: str, value: Any, dims: Dims) -> int:
        if not _is_int(value):
            raise _fail("schema.type", path, f"expected int, got {type(value).__name__}")
        _check_bounds(path, int(value), self.ge, None, self.le)
        return int(value)

    def describe(self) -> str:
        return self._opt("int" + _bounds_text(self.ge, None, self.le))


@dataclass(frozen=True, kw_only=True)
class Float(Field):
    """A real number (ints accepted and widened); finite by default."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    finite: bool = True

    def check(self, path: str, value: Any, dims: Dims) -> float:
        if not _is_real(value):
            raise _fail("schema.type", path, f"expected float, got {type(value).__name__}")
        try:
            value = float(value)
        except OverflowError:
            raise _fail("schema.bounds", path, "integer too large for a float") from None
        if self.finite and not math.isfinite(value):
            raise _fail("schema.finite", path, f"{value} is not finite")
        _check_bounds(path, value, self.ge, self.gt, self.le)
        return value

    def describe(self) -> str:
        fin = " finite" if self.finite else ""
        return self._opt("float" + fin + _bounds_text(self.ge, self.gt, self.le))


@dataclass(frozen=True, kw_only=True)
class Number(Field):
    """An int or a float, kept as sent (metrics)."""

    finite: bool = False

    def check(self, path: str, value: Any, dims: Dims) -> int | float:
        if not _is_real(value):
            raise _fail("schema.type", path, f"expected number, got {type(value).__name__}")
        if self.finite and not _is_int(value) and not math.isfinite(value):
            raise _fail("schema.finite", path, f"{value} is not finite")
        return value.item() if isinstance(value, np.generic) else value

    def describe(self) -> str:
        return self._opt("number" + (" finite" if self.finite else ""))


@dataclass(frozen=True, kw_only=True)
class Bool(Field):
    def check(self, path: str, value: Any, dims: Dims) -> bool:
        if not isinstance(value, (bool, np.bool_)):
            raise _fail("schema.type", path, f"expected bool, got {type(value).__name__}")
        return bool(value)

    def describe(self) -> str:
        return self._opt("bool")


@dataclass(frozen=True, kw_only=True)
class Str(Field):
    """A string, optionally from a closed set or matching a regex."""

    choices: tuple[str, ...] | None = None
    max_len: int = 256
    pattern: str | None = None

    def check(self, path: str, value: Any, dims: Dims) -> str:
        if not isinstance(value, str):
            raise _fail("schema.type", path, f"expected str, got {type(value).__name__}")
        if len(value) > self.max_len:
            raise _fail("schema.bounds", path, f"longer than {self.max_len} characters")
        if self.choices is not None and value not in self.choices:
            raise _fail("schema.choice", path, f"{value!r} not in {list(self.choices)}")
        if self.pattern is not None and re.fullmatch(self.pattern, value) is None:
            raise _fail("schema.pattern", path, f"does not match {self.pattern}")
        return value

    def describe(self) -> str:
        if self.choices is not None:
            return self._opt("str in {" + ", ".join(self.choices) + "}")
        return self._opt("str" + (f" /{self.pattern}/" if self.pattern else ""))


@dataclass(frozen=True, kw_only=True)
class Bytes(Field):
    max_len: int | None = None

    def check(self, path: str, value: Any, dims: Dims) -> bytes:
        if not isinstance(value, (bytes, bytearray)):
            raise _fail("schema.type", path, f"expected bytes, got {type(value).__name__}")
        if self.max_len is not None and len(value) > self.max_len:
            raise _fail("schema.bounds", path, f"longer than {self.max_len} bytes")
        return bytes(value)

    def describe(self) -> str:
        return self._opt("bytes")


@dataclass(frozen=True, kw_only=True)
class Scalar(Field):
    """int | float | str | bool (config values)."""

    max_len: int = 1024

    def check(self, path: str, value: Any, dims: Dims) -> Any:
        if isinstance(value, (bool, np.bool_)):
            return bool(value)
        if isinstance(value, str):
            return Str(max_len=self.max_len).check(path, value, dims)
        if _is_real(value):
            return value.item() if isinstance(value, np.generic) else value
        raise _fail("schema.type", path, f"expected scalar, got {type(value).__name__}")

    def describe(self) -> str:
        return self._opt("int|float|str|bool")


def _match_shape(path: str, shape: tuple[int, ...], spec: tuple[Any, ...], dims: Dims) -> None:
    """Match ``shape`` against ``spec`` (ints, symbols, trailing "..."), binding symbols."""
    variadic = bool(spec) and spec[-1] == "..."
    fixed = spec[:-1] if variadic else spec
    if len(shape) < len(fixed) or (not variadic and len(shape) != len(fixed)):
        raise _fail("schema.shape", path, f"shape {shape} does not match {list(spec)}")
    for size, want in zip(shape, fixed):
        if isinstance(want, int) and size != want:
            raise _fail("schema.shape", path, f"shape {shape} does not match {list(spec)}")
        if isinstance(want, str) and dims.setdefault(want, size) != size:
            raise _fail("schema.shape", path, f"{want}={size} but {want}={dims[want]} elsewhere")


@dataclass(frozen=True, kw_only=True)
class Array(Field):
    """A numpy array: dtype whitelist subset, symbolic shape, finiteness, element bounds."""

    dtypes: tuple[str, ...] = ALL_DTYPES
    shape: tuple[int | str, ...] | None = None
    finite: bool = False
    unique: bool = False
    ge: float | None = None
    gt: float | None = None
    le: float | None = None

    def __post_init__(self) -> None:
        if isinstance(self.dtypes, str):
            object.__setattr__(self, "dtypes", (self.dtypes,))
        unknown = set(self.dtypes) - set(ALL_DTYPES)
        if unknown:
            raise ValueError(f"dtypes {sorted(unknown)} are not on the wire whitelist")

    def check(self, path: str, value: Any, dims: Dims) -> np.ndarray:
        if not isinstance(value, np.ndarray):
            raise _fail("schema.type", path, f"expected array, got {type(value).__name__}")
        name = dtype_name(value.dtype)
        if name not in self.dtypes:
            raise _fail("schema.dtype", path, f"dtype {value.dtype} not in {list(self.dtypes)}")
        if self.shape is not None:
            _match_shape(path, value.shape, self.shape, dims)
        if self.finite and name in FLOAT_DTYPES and not np.isfinite(value).all():
            raise _fail("schema.finite", path, "contains NaN or Inf")
        _check_bounds(path, value, self.ge, self.gt, self.le)
        if self.unique and np.unique(value).size != value.size:
            raise _fail("schema.unique", path, "values are not unique")
        return value

    def describe(self) -> str:
        text = "|".join(self.dtypes)
        if self.shape is not None:
            text += "[" + ",".join(str(d) for d in self.shape) + "]"
        text += " finite" if self.finite else ""
        text += " unique" if self.unique else ""
        return self._opt(text + _bounds_text(self.ge, self.gt, self.le))


@dataclass(frozen=True, kw_only=True)
class Map(Field):
    """A str-keyed map whose values all follow ``values``; insertion order is kept."""

    values: Field = field(default_factory=Scalar)
    max_entries: int = 65536
    key_max_len: int = 256

    def check(self, path: str, value: Any, dims: Dims) -> dict[str, Any]:
        if not isinstance(value, Mapping):
            raise _fail("schema.type", path, f"expected map, got {type(value).__name__}")
        if len(value) > self.max_entries:
            raise _fail("schema.bounds", path, f"more than {self.max_entries} entries")
        out: dict[str, Any] = {}
        for key, item in value.items():
            if not isinstance(key, str) or len(key) > self.key_max_len:
                raise _fail("schema.key", path, f"bad key {key!r:.80}")
            out[key] = self.values.check(f"{path}.{key}", item, {})  # symbols are per entry
        return out

    def describe(self) -> str:
        return self._opt(f"map str -> ({self.values.describe()})")


@dataclass(frozen=True, kw_only=True)
class List(Field):
    """A list whose items all follow ``items``; one msgpack array, so at most MAX_ARRAY_LEN
    (a longer one would be refused by every decoder: use Paged)."""

    items: Field = field(default_factory=Scalar)
    max_items: int = MAX_ARRAY_LEN

    def __post_init__(self) -> None:
        if self.max_items > MAX_ARRAY_LEN:
            raise ValueError(f"List(max_items={self.max_items}) exceeds MAX_ARRAY_LEN {MAX_ARRAY_LEN}: use Paged")

    def check(self, path: str, value: Any, dims: Dims) -> list[Any]:
        if not isinstance(value, (list, tuple)):
            raise _fail("schema.type", path, f"expected list, got {type(value).__name__}")
        if len(value) > self.max_items:
            raise _fail("schema.bounds", path, f"more than {self.max_items} items")
        return [self.items.check(f"{path}[{i}]", item, {}) for i, item in enumerate(value)]

    def describe(self) -> str:
        return self._opt(f"list of ({self.items.describe()})")


@dataclass(frozen=True, kw_only=True)
class Paged(Field):
    """A list that may outgrow one msgpack array (an edge's members, a round's participants).

    In Python always a flat list. On the wire a flat msgpack array while it has at most
    ``page`` items (the same bytes as a List), else an array of pages: non-empty arrays of at
    most ``page`` items, concatenated in order. A receiver takes either form at any length,
    bounded by ``max_items`` in all. Top-level body fields only (Schema.wire applies it)."""

    items: Field = field(default_factory=Scalar)
    max_items: int = 65536
    page: int = MAX_ARRAY_LEN

    def __post_init__(self) -> None:
        if not 0 < self.page <= MAX_ARRAY_LEN or -(-self.max_items // self.page) > MAX_ARRAY_LEN:
            raise ValueError(f"Paged(page={self.page}, max_items={self.max_items}) does not fit MAX_ARRAY_LEN pages "
                             f"of at most MAX_ARRAY_LEN {MAX_ARRAY_LEN}")
        if isinstance(self.items, (List, Paged, Data)):
            raise ValueError("Paged items cannot be lists: a page could not be told from an item")

    def check(self, path: str, value: Any, dims: Dims) -> list[Any]:
        if not isinstance(value, (list, tuple)):
            raise _fail("schema.type", path, f"expected list, got {type(value).__name__}")
        flat = self._flatten(path, value) if value and all(isinstance(v, (list, tuple)) for v in value) else value
        if len(flat) > self.max_items:
            raise _fail("schema.bounds", path, f"more than {self.max_items} items")
        return [self.items.check(f"{path}[{i}]", item, {}) for i, item in enumerate(flat)]

    def _flatten(self, path: str, pages: Any) -> list[Any]:
        """The items of the paged form, each page bounded (a receiver checks what msgpack did not)."""
        for n, page in enumerate(pages):
            if not 0 < len(page) <= self.page:
                raise _fail("schema.bounds", f"{path}[{n}]", f"a page holds 1..{self.page} items, not {len(page)}")
        return [item for page in pages for item in page]

    def wire(self, value: list[Any]) -> list[Any]:
        if len(value) <= self.page:
            return value
        return [value[i:i + self.page] for i in range(0, len(value), self.page)]

    def describe(self) -> str:
        return self._opt(f"list of ({self.items.describe()}), paged past {self.page}")


@dataclass(frozen=True, kw_only=True)
class Data(Field):
    """Free-form plain data (scalars, None, bytes, arrays, lists, str-keyed maps), depth-bounded."""

    max_depth: int = 8

    def check(self, path: str, value: Any, dims: Dims, depth: int = 0) -> Any:
        if depth > self.max_depth:
            raise _fail("schema.depth", path, f"nested deeper than {self.max_depth}")
        if value is None or isinstance(value, (bool, str, bytes, np.ndarray)) or _is_real(value):
            return value
        if isinstance(value, (list, tuple)):
            return [self.check(f"{path}[{i}]", v, dims, depth + 1) for i, v in enumerate(value)]
        if isinstance(value, Mapping):
            if not all(isinstance(k, str) for k in value):
                raise _fail("schema.key", path, "map keys must be str")
            return {k: self.check(f"{path}.{k}", v, dims, depth + 1) for k, v in value.items()}
        raise _fail("schema.type", path, f"unsupported type {type(value).__name__}")

    def describe(self) -> str:
        return self._opt("map/list/scalars")
