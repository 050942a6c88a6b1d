"""A part's state as bytes and back, without pickle: what a restarted cloud or edge resumes from.

A part's declared attributes (its `Kept` fields, `Part.kept`) are each kept in a tagged
msgpack form: numpy arrays (their dtype, shape and raw bytes; files written before that hold
``np.save``'s form, which is still read), torch modules and optimisers (their state dicts),
tensors, numpy generators (their bit-generator state), tuples, sets, maps with non-string keys
and this package's own dataclasses (e.g. ClassMoments, Placement). A declared
value of any other type is an error naming the part and the attribute: nothing is dropped
silently, and nothing the part did not declare (its context, views of its models, caches it
rebuilds) is kept twice.

Restoring loads modules and optimisers *in place*, so an optimiser still points at the very
parameters of the module it trains; every other attribute is replaced by its saved value. A
file is decoded with an allow-list (only dataclasses of ``splitedge.*`` are rebuilt), so a
state file cannot make the loader run arbitrary code.

This module is torch-free at import: torch is touched only when a value is a torch object.
"""

from __future__ import annotations

import dataclasses
import importlib
import hashlib
import io
import logging
import math
import os
import struct
import sys
import threading
from pathlib import Path
from typing import Any, Mapping, Sequence

import msgpack
import numpy as np

log = logging.getLogger(__name__)

_EXT_NDARRAY = 42  # np.save's .npy bytes: read, no longer written
_EXT_RAW = 43  # an array's dtype, shape and raw bytes: what is written


class SnapshotError(ValueError):
    """A value that cannot be kept, a state file that cannot be read, or one that does not fit
    the part it is loaded into."""


# -- values -> tagged plain data ----------------------------------------------------------

def _is_torch(obj: Any, name: str) -> bool:
    """A torch module or tensor; for "optim", anything that keeps its state the way torch's
    optimisers do (`state_dict` / `load_state_dict`: torch.optim, PlainSGD, schedulers)."""
    if name == "optim":
        return (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))
                and not _is_torch(obj, "module") and not isinstance(obj, type))
    torch = sys.modules.get("torch")  # not imported: obj cannot be torch's (the thin path never imports it)
    if torch is None:
        return False
    return isinstance(obj, {"module": torch.nn.Module, "tensor": torch.Tensor}[name])  # splitedge's own modules too


def to_plain(obj: Any) -> Any:
    """`obj` as tagged, msgpack-ready data; SnapshotError for what cannot be kept."""
    if isinstance(obj, int) and not isinstance(obj, bool) and not -2**63 <= obj < 2**64:
        return {"__t": "int", "v": str(obj)}  # e.g. PCG64's 128-bit state, past msgpack's integers
    if obj is None or isinstance(obj, (bool, int, float, str, bytes)):
        return obj
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        if obj.dtype.hasobject:
            raise SnapshotError("arrays of Python objects cannot be kept")
        return obj
    if isinstance(obj, np.random.Generator):
        return {"__t": "rng", "state": to_plain(obj.bit_generator.state)}
    if _is_torch(obj, "module"):
        return {"__t": "module", "state": {k: v.detach().cpu().numpy() for k, v in obj.state_dict().items()}}
    if _is_torch(obj, "optim"):
        return {"__t": "optim", "state": to_plain(obj.state_dict())}
    if _is_torch(obj, "tensor"):
        return {"__t": "tensor", "a": obj.detach().cpu().numpy()}
    if isinstance(obj, tuple):
        return {"__t": "tuple", "v": [to_plain(v) for v in obj]}
    if isinstance(obj, (set, frozenset)):
        return {"__t": "set", "v": [to_plain(v) for v in sorted(obj, key=repr)]}
    if isinstance(obj, list):
        return [to_plain(v) for v in obj]
    if isinstance(obj, dict):
        if all(isinstance(k, str) for k in obj) and "__t" not in obj:
            return {k: to_plain(v) for k, v in obj.items()}
        return {"__t": "map", "items": [[to_plain(k), to_plain(v)] for k, v in obj.items()]}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type) and type(obj).__module__.startswith("splitedge."):
        cls = type(obj)
        return {"__t": "dc", "cls": f"{cls.__module__}:{cls.__qualname__}",
                "fields": {f.name: to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}}
    raise SnapshotError(f"{type(obj).__name__} values cannot be kept")


def from_plain(data: Any) -> Any:
    """The value `to_plain` made (modules and optimisers stay state dicts: see `restore`)."""
    if isinstance(data, list):
        return [from_plain(v) for v in data]
    if not isinstance(data, dict):
        return data
    tag = data.get("__t")
    if tag is None:
        return {k: from_plain(v) for k, v in data.items()}
    if tag == "int":
        return int(data["v"])
    if tag == "tuple":
        return tuple(from_plain(v) for v in data["v"])
    if tag == "set":
        return {from_plain(v) for v in data["v"]}
    if tag == "map":
        return {_hashable(from_plain(k)): from_plain(v) for k, v in data["items"]}
    if tag == "rng":
        gen_state = from_plain(data["state"])
        bit_gen = getattr(np.random, gen_state["bit_generator"])()
        bit_gen.state = gen_state
        return np.random.Generator(bit_gen)
    if tag == "tensor":
        import torch

        return torch.from_numpy(np.array(data["a"]))
    if tag in ("module", "optim"):
        return data  # loaded in place by restore
    if tag == "dc":
        module, _, name = str(data["cls"]).partition(":")
        if not module.startswith("splitedge.") or not name.isidentifier():
            raise SnapshotError(f"a state file names class {data['cls']!r}, which is not splitedge's")
        cls = getattr(importlib.import_module(module), name, None)
        if cls is None or not dataclasses.is_dataclass(cls):
            raise SnapshotError(f"a state file names class {data['cls']!r}, which no longer exists")
        return cls(**{k: from_plain(v) for k, v in data["fields"].items()})
    raise SnapshotError(f"a state file holds an unknown tag {tag!r}")


def _hashable(key: Any) -> Any:
    return tuple(_hashable(k) for k in key) if isinstance(key, list) else key


def _optimizer_state(data: Any) -> Any:
    """An optimiser state dict read back: its tensors as tensors again."""
    import torch

    value = from_plain(data)

    def tensors(v: Any) -> Any:
        if isinstance(v, np.ndarray):
            return torch.from_numpy(np.array(v))
        if isinstance(v, dict):
            return {k: tensors(x) for k, x in v.items()}
        if isinstance(v, list):
            return [tensors(x) for x in v]
        return v

    return tensors(value)


# -- parts ----------------------------------------------------------------------------------

def capture(obj: Any, names: Sequence[str]) -> dict[str, Any]:
    """The attributes `names` of `obj` as tagged plain data. One that is not set, or whose
    value cannot be kept, is a SnapshotError naming it: a part that declared it needs it."""
    out = {}
    for name in names:
        where = f"{type(obj).__name__}.{name}"
        try:
            value = getattr(obj, name)
        except AttributeError:
            raise SnapshotError(f"{where} is declared in its state but not set") from None
        try:
            out[name] = to_plain(value)
        except SnapshotError as exc:
            raise SnapshotError(f"{where} ({type(value).__name__}) is declared in its state, but {exc}") from None
    return out


def restore(obj: Any, names: Sequence[str], state: Mapping[str, Any]) -> None:
    """Put `capture`d attributes `names` back into `obj`: modules and optimisers in place, the
    rest replaced. A saved attribute `obj` does not declare, or a declared one the state lacks,
    means the state is of another version of the part: SnapshotError naming them."""
    cls = type(obj).__name__
    unknown, missing = sorted(set(state) - set(names)), [n for n in names if n not in state]
    if unknown:
        raise SnapshotError(f"the saved state holds {', '.join(unknown)}, which {cls} does not declare; "
                            f"it is of another version of this method")
    if missing:
        raise SnapshotError(f"the saved state lacks {', '.join(missing)}, which {cls} declares; "
                            f"it is of another version of this method")
    for name in names:
        setattr(obj, name, _restore(getattr(obj, name, None), state[name], f"{cls}.{name}"))


def _restore(target: Any, data: Any, where: str) -> Any:
    tag = data.get("__t") if isinstance(data, dict) else None
    if tag == "module":
        if not _is_torch(target, "module"):
            raise SnapshotError(f"{where} is no longer a model; the state file is of another version of this method")
        import torch

        try:
            target.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in data["state"].items()})
        except RuntimeError as exc:
            raise SnapshotError(f"{where} does not fit the saved weights: {str(exc).splitlines()[0]}") from None
        return target
    if tag == "optim":  # (files of earlier versions tagged splitedge's own modules so: they load alike)
        if not callable(getattr(target, "load_state_dict", None)):
            raise SnapshotError(f"{where} is no longer an optimiser")
        try:
            # a numpy-only object (the thin trainer's, `numpy_state`) takes arrays, a torch one tensors
            numpy_only = getattr(target, "numpy_state", False)
            target.load_state_dict(from_plain(data["state"]) if numpy_only else _optimizer_state(data["state"]))
        except (ValueError, KeyError) as exc:
            raise SnapshotError(f"{where}: the saved optimiser state does not fit ({exc})") from None
        return target
    if tag is None and isinstance(data, dict) and isinstance(target, dict) and _holds_torch(data):
        return {k: _restore(target.get(k), v, f"{where}[{k!r}]") for k, v in data.items()}
    return from_plain(data)


def _holds_torch(data: dict) -> bool:
    return any(isinstance(v, dict) and v.get("__t") in ("module", "optim") for v in data.values())


def cast_floats(state: Any, dtype: str = "f2") -> Any:
    """`capture` data with the float arrays of its models and optimisers as `dtype` (e.g. f2:
    half the bytes of a parked model; loading casts them back to each parameter's own dtype)."""
    def cast(v: Any, inside: bool) -> Any:
        if isinstance(v, np.ndarray):
            return v.astype(dtype) if inside and v.dtype.kind == "f" else v
        if isinstance(v, dict):
            inside = inside or v.get("__t") in ("module", "optim")
            return {k: cast(x, inside) for k, x in v.items()}
        if isinstance(v, list):
            return [cast(x, inside) for x in v]
        return v

    return cast(state, False)


# -- bytes and files -----------------------------------------------------------------------

def _default(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        return msgpack.ExtType(_EXT_RAW, raw_array(obj))
    raise TypeError(f"cannot keep a {type(obj).__name__} in a state file")


def raw_array(a: np.ndarray) -> bytes:
    """`a` as its dtype string, its shape and its bytes in C order.

    A sim parks and takes back every virtual device's part each round. With np.save's form,
    each array's header is Python text that np.load parses with ast.literal_eval, under a lock
    that every device's thread queues on (_NPY_HEADER_LOCK); a `fedcnn` part's 22 arrays took
    2.5 ms to write and 3 to 6 ms to read, against 1 and 1.3 ms in this form."""
    if a.dtype.hasobject:
        raise TypeError("arrays of Python objects cannot be kept in a state file")
    dtype = a.dtype.str.encode("ascii")
    head = struct.pack(f"<B{len(dtype)}sB{a.ndim}Q", len(dtype), dtype, a.ndim, *a.shape)
    return head + a.tobytes()  # C order whatever a's layout


def _from_raw(data: bytes) -> np.ndarray:
    try:
        n = data[0]
        dtype = np.dtype(data[1:1 + n].decode("ascii"))
        ndim = data[1 + n]
        start = 2 + n + 8 * ndim
        shape = struct.unpack_from(f"<{ndim}Q", data, 2 + n)
    except (IndexError, TypeError, ValueError, UnicodeDecodeError, struct.error) as exc:
        raise SnapshotError(f"a state file holds an unreadable array ({exc})") from None
    if dtype.hasobject:
        raise SnapshotError("a state file holds an array of Python objects")
    items = math.prod(shape)
    if len(data) - start != items * dtype.itemsize:
        raise SnapshotError(f"a state file's array of shape {shape} ({dtype}) holds {len(data) - start} bytes, "
                            f"not {items * dtype.itemsize}")
    return np.frombuffer(data, dtype=dtype, offset=start, count=items).reshape(shape).copy()  # writable, as np.load's


_NPY_HEADER_LOCK = threading.Lock()
"""np.load reads an array's .npy header with ast.literal_eval, which CPython 3.11 cannot run in
two threads at once ("SystemError: AST constructor recursion depth mismatch", CPython issue
106905): a sim's devices restore parked parts in parallel, and one of them failed its round."""


def _ext_hook(code: int, data: bytes) -> Any:
    if code == _EXT_RAW:
        return _from_raw(data)
    if code != _EXT_NDARRAY:
        raise SnapshotError(f"a state file holds an unknown extension {code}")
    with _NPY_HEADER_LOCK:
        return np.load(io.BytesIO(data), allow_pickle=False)


def dumps(state: Any) -> bytes:
    return msgpack.packb(state, default=_default, use_bin_type=True, strict_types=False)


def loads(data: bytes) -> Any:
    try:
        return msgpack.unpackb(data, ext_hook=_ext_hook, raw=False, strict_map_key=False)
    except (ValueError, msgpack.exceptions.ExtraData, msgpack.exceptions.UnpackException) as exc:
        raise SnapshotError(f"not a readable state file ({exc})") from None


def write_atomic(path: Path, data: bytes) -> None:
    """Write, fsync, rename, fsync the folder: a crash leaves the old file or the new one."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    try:
        fd = os.open(path.parent, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


SEAL = b"SPLITEDGE-SEALED\x00"
"""A sealed file: this magic, the SHA-256 of the payload, the payload. A flipped byte in a state
file used to load silently and change a served weight."""


def seal(data: bytes) -> bytes:
    return SEAL + hashlib.sha256(data).digest() + data


def unseal(data: bytes, path: Path) -> bytes:
    """The payload of a sealed file, checked; an unsealed file (written before seals) as it is,
    with a warning. SnapshotError when the checksum does not match."""
    if not data.startswith(SEAL):
        log.warning("%s has no checksum (written by an older splitedge); read unchecked", path)
        return data
    digest, payload = data[len(SEAL):len(SEAL) + 32], data[len(SEAL) + 32:]
    if len(digest) < 32 or hashlib.sha256(payload).digest() != digest:
        raise SnapshotError(f"{path} is damaged (its checksum does not match its contents)")
    return payload


def fields_of(obj: Any) -> dict[str, Any]:
    """A dataclass's fields as a map, the values as they are: `dataclasses.asdict` deep-copies
    every model and array a state holds before it is written."""
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}


def write_sealed(path: Path, state: Any) -> None:
    """`state` written atomically with its checksum (read back by `read_sealed`)."""
    write_atomic(path, seal(dumps(state)))


def read_sealed(path: Path) -> Any:
    """The state `write_sealed` wrote at `path`, its checksum verified."""
    return loads(unseal(Path(path).read_bytes(), path))
