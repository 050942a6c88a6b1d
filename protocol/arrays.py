"""numpy arrays <-> one msgpack ext type (``EXT_ARRAY = 1``).

Payload layout (all little-endian; PROTOCOL.md documents it byte by byte)::

    offset 0        1 byte   dtype code (see DTYPE_CODES)
    offset 1        1 byte   ndim (0..MAX_NDIM)
    offset 2        ndim x uint32 LE   dims
    offset 2+4*ndim raw element bytes, C order, little-endian

Decoding trusts nothing: only whitelisted dtypes, bounded ndim, and the byte count must equal
prod(dims) * itemsize exactly (computed with Python ints, so no overflow). The result is a
read-only zero-copy ``np.frombuffer`` view over the ext payload.
"""

from __future__ import annotations

import math
import struct
from typing import Any

import msgpack
import numpy as np

from .errors import ProtocolError

__all__ = [
    "EXT_ARRAY",
    "MAX_NDIM",
    "DTYPE_CODES",
    "DTYPE_NAMES",
    "dtype_name",
    "pack_array",
    "unpack_array",
    "ext_default",
    "ext_hook",
]

EXT_ARRAY = 1
MAX_NDIM = 8
MAX_DIM = 2**32 - 1

# Short name -> (wire code, little-endian numpy dtype). Codes are part of the wire format:
# never renumber, only append.
_WHITELIST: dict[str, tuple[int, np.dtype]] = {
    "bool": (1, np.dtype("|b1")),
    "u1": (2, np.dtype("|u1")),
    "i1": (3, np.dtype("|i1")),
    "i2": (4, np.dtype("<i2")),
    "i4": (5, np.dtype("<i4")),
    "i8": (6, np.dtype("<i8")),
    "f2": (7, np.dtype("<f2")),
    "f4": (8, np.dtype("<f4")),
    "f8": (9, np.dtype("<f8")),
}
DTYPE_CODES: dict[str, int] = {name: code for name, (code, _) in _WHITELIST.items()}
DTYPE_NAMES: dict[int, str] = {code: name for name, code in DTYPE_CODES.items()}
_BY_CODE: dict[int, np.dtype] = {code: dt for code, dt in _WHITELIST.values()}
_BY_KIND_SIZE: dict[tuple[str, int], str] = {
    (dt.kind, dt.itemsize): name for name, (_, dt) in _WHITELIST.items()
}


def dtype_name(dtype: Any) -> str | None:
    """Short whitelist name of ``dtype`` ignoring byte order, or None when off the whitelist."""
    try:
        dt = np.dtype(dtype)
    except TypeError:
        return None
    if dt.fields is not None or dt.subdtype is not None:
        return None
    return _BY_KIND_SIZE.get((dt.kind, dt.itemsize))


def pack_array(arr: np.ndarray) -> msgpack.ExtType:
    """Encode ``arr`` as the array ext type; big-endian or strided input is normalised."""
    name = dtype_name(arr.dtype)
    if name is None:
        raise ProtocolError("array.dtype", f"dtype {arr.dtype} is not on the wire whitelist")
    if arr.ndim > MAX_NDIM:
        raise ProtocolError("array.ndim", f"ndim {arr.ndim} > {MAX_NDIM}")
    if any(d > MAX_DIM for d in arr.shape):
        raise ProtocolError("array.shape", f"dimension in {arr.shape} does not fit uint32")
    code, wire_dtype = _WHITELIST[name]
    data = np.ascontiguousarray(arr, dtype=wire_dtype)
    header = struct.pack(f"<BB{arr.ndim}I", code, arr.ndim, *arr.shape)
    return msgpack.ExtType(EXT_ARRAY, header + data.tobytes())


def unpack_array(payload: bytes) -> np.ndarray:
    """Decode an array ext payload into a read-only view; ProtocolError on any mismatch."""
    if len(payload) < 2:
        raise ProtocolError("array.header", f"ext payload of {len(payload)} bytes has no header")
    code, ndim = payload[0], payload[1]
    if code not in _BY_CODE:
        raise ProtocolError("array.dtype", f"dtype code {code} is not on the wire whitelist")
    if ndim > MAX_NDIM:
        raise ProtocolError("array.ndim", f"ndim {ndim} > {MAX_NDIM}")
    offset = 2 + 4 * ndim
    if len(payload) < offset:
        raise ProtocolError("array.header", f"header needs {offset} bytes, got {len(payload)}")
    shape = struct.unpack_from(f"<{ndim}I", payload, 2)
    dtype = _BY_CODE[code]
    expected = math.prod(shape) * dtype.itemsize  # Python ints: cannot overflow
    if expected != len(payload) - offset:
        raise ProtocolError(
            "array.size",
            f"shape {shape} x {dtype.itemsize} B = {expected} B but {len(payload) - offset} B follow",
        )
    return np.frombuffer(payload, dtype=dtype, offset=offset).reshape(shape)


def ext_default(obj: Any) -> Any:
    """msgpack ``default`` hook: arrays become the ext type, numpy scalars plain Python values."""
    if isinstance(obj, np.ndarray):
        return pack_array(obj)
    if isinstance(obj, np.generic) and dtype_name(obj.dtype) is not None:
        return obj.item()
    raise ProtocolError("encode.type", f"cannot encode a {type(obj).__name__}")


def ext_hook(code: int, payload: bytes) -> np.ndarray:
    """msgpack ``ext_hook``: only the array ext type exists on this wire."""
    if code != EXT_ARRAY:
        raise ProtocolError("frame.ext_type", f"unknown msgpack ext type {code}")
    return unpack_array(payload)
