"""Read the initializer table (name, shape, dtype, where the bytes are) of an ONNX model
without the `onnx` package, and rewrite initializer values in place.

onnxruntime does not list a model's initializers and `SessionOptions.add_initializer` accepts
a wrong shape or dtype without complaint, so the thin device checks incoming weights against
this table itself. Only the few protobuf fields needed are decoded; tensor payloads are
skipped, never copied, so this costs next to nothing even for large models. A new value of the
same shape and dtype has exactly as many bytes as the old one, so `patch_initializers` can
overwrite `raw_data` without touching any protobuf length prefix.

Field numbers (onnx.proto3): ModelProto.graph = 7; GraphProto.initializer = 5;
TensorProto.dims = 1, data_type = 2, name = 8, raw_data = 9, data_location = 14.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import numpy as np

# TensorProto.DataType -> numpy dtype (the types a W_c graph can hold)
ONNX_DTYPES: dict[int, np.dtype] = {
    1: np.dtype("float32"), 2: np.dtype("uint8"), 3: np.dtype("int8"), 6: np.dtype("int32"),
    7: np.dtype("int64"), 9: np.dtype("bool"), 10: np.dtype("float16"), 11: np.dtype("float64"),
}
_MODEL_GRAPH, _GRAPH_INITIALIZER = 7, 5
_T_DIMS, _T_TYPE, _T_NAME, _T_RAW, _T_LOCATION = 1, 2, 8, 9, 14


@dataclass(frozen=True)
class InitializerSpec:
    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    raw_offset: int = -1  # where raw_data starts in the model bytes (-1: stored another way)
    raw_size: int = 0

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


def _varint(buf: memoryview, pos: int) -> tuple[int, int]:
    result, shift = 0, 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise ValueError("onnx: truncated or overlong varint")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if b < 0x80:
            return result, pos
        shift += 7


def _fields(buf: memoryview) -> Iterator[tuple[int, int, int | memoryview, int]]:
    """(field number, wire type, value, value offset in buf) of one message.

    Length-delimited values are views into buf.
    """
    pos = 0
    while pos < len(buf):
        key, pos = _varint(buf, pos)
        field, wire, start = key >> 3, key & 7, pos
        if wire == 0:
            value, pos = _varint(buf, pos)
        elif wire == 1 or wire == 5:
            size = 8 if wire == 1 else 4
            value, pos = int.from_bytes(buf[pos:pos + size], "little"), pos + size
        elif wire == 2:
            size, pos = _varint(buf, pos)
            if pos + size > len(buf):
                raise ValueError("onnx: length-delimited field runs past the end")
            start = pos
            value, pos = buf[pos:pos + size], pos + size
        else:
            raise ValueError(f"onnx: unsupported protobuf wire type {wire}")
        yield field, wire, value, start


def _tensor_spec(buf: memoryview, base: int) -> InitializerSpec:
    dims: list[int] = []
    name, dtype_id, external, raw_offset, raw_size = "", 0, False, -1, 0
    for field, wire, value, start in _fields(buf):
        if field == _T_DIMS and wire == 0:
            dims.append(int(value))
        elif field == _T_DIMS and wire == 2:  # packed repeated int64
            pos = 0
            while pos < len(value):
                d, pos = _varint(value, pos)
                dims.append(d)
        elif field == _T_TYPE:
            dtype_id = int(value)
        elif field == _T_NAME:
            name = bytes(value).decode("utf-8")
        elif field == _T_RAW and wire == 2:
            raw_offset, raw_size = base + start, len(value)
        elif field == _T_LOCATION:
            external = int(value) == 1
    if external:
        raise ValueError(f"onnx: initializer {name!r} uses external data (not supported on a device)")
    if dtype_id not in ONNX_DTYPES:
        raise ValueError(f"onnx: initializer {name!r} has unsupported data type {dtype_id}")
    return InitializerSpec(name, tuple(dims), ONNX_DTYPES[dtype_id], raw_offset, raw_size)


def _graph(model: memoryview) -> tuple[memoryview, int]:
    for field, wire, value, start in _fields(model):
        if field == _MODEL_GRAPH and wire == 2:
            return value, start  # type: ignore[return-value]
    raise ValueError("onnx: model has no graph")


def initializer_specs(model: bytes) -> dict[str, InitializerSpec]:
    """name -> spec of every initializer in the model's main graph, in file order.

    Raises ValueError on bytes that are not a well-formed ONNX model.
    """
    try:
        graph, base = _graph(memoryview(model))
        return {spec.name: spec for spec in (_tensor_spec(v, base + s) for f, w, v, s in _fields(graph)
                                             if f == _GRAPH_INITIALIZER and w == 2)}
    except (IndexError, UnicodeDecodeError) as exc:
        raise ValueError(f"onnx: malformed model ({exc})") from exc


def patch_initializers(model: bytes, specs: dict[str, InitializerSpec],
                       arrays: dict[str, np.ndarray]) -> bytes:
    """A copy of `model` with the raw bytes of the named initializers replaced.

    Each array must already have its initializer's shape and dtype; ValueError for an
    initializer whose value is not stored as raw_data of exactly that size.
    """
    out = bytearray(model)
    for name, arr in arrays.items():
        spec = specs[name]
        data = np.ascontiguousarray(arr, dtype=spec.dtype.newbyteorder("<")).tobytes()
        if spec.raw_offset < 0 or spec.raw_size != len(data) or spec.nbytes != len(data):
            raise ValueError(f"onnx: initializer {name!r} is not stored as raw_data of {len(data)} bytes")
        out[spec.raw_offset:spec.raw_offset + len(data)] = data
    return bytes(out)


def initializer_values(model: bytes, specs: dict[str, InitializerSpec]) -> dict[str, np.ndarray]:
    """name -> a copy of each initializer stored as raw_data (little-endian, as ONNX stores it):
    the weights a graph holds, which a thin trainer starts its local W_c from."""
    return {name: np.frombuffer(model, dtype=spec.dtype.newbyteorder("<"), count=int(np.prod(spec.shape, dtype=np.int64)),
                                offset=spec.raw_offset).astype(spec.dtype).reshape(spec.shape)
            for name, spec in specs.items() if spec.raw_offset >= 0 and spec.raw_size == spec.nbytes}
