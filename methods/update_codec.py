"""Compressed model updates on a device's uplink: int8 or top-k deltas with error feedback.

A FedAvg device's update is the model it trained minus the global model it trained from. With
`update_codec` "int8" each large float tensor's delta travels as int8 with one float32 scale
(stochastic rounding, so the rounding is unbiased: 4x fewer bytes); with "topk" only the
`update_topk` share of its entries largest in magnitude travel, as float32 values and int32
positions. What a device leaves out it keeps (error feedback, Seide et al. 2014; Stich et al.
2018) and adds to its next update, so nothing is lost, only late. Tensors under MIN_SIZE values
(biases, BatchNorm) and integer buffers travel whole.

The edge decodes an update against the global model it relayed (what the update was trained
from) and checks the result as any dense update; an update of a model the edge does not hold, or
whose arrays do not fit the model's tensors, is refused (ProtocolError) before it touches state.
numpy only: thin devices encode, numpy-only edges decode.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import numpy as np

from splitedge.protocol.errors import ProtocolError

CODECS = ("none", "int8", "topk")
MIN_SIZE = 1024
"""Tensors with fewer values travel whole (their bytes are negligible; BatchNorm variances stay exact)."""
WeightMap = Mapping[str, np.ndarray]


def compressed(name: str, value: np.ndarray) -> bool:
    """Whether a tensor travels as a compressed delta: float, at least MIN_SIZE values."""
    return value.dtype.kind == "f" and value.size >= MIN_SIZE


def _int8(delta: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(int8 codes, scale [1] f4) of `delta` with stochastic rounding: E[codes * scale] = delta."""
    top = float(np.abs(delta).max())
    scale = np.float32(top / 127.0) if top > 0 else np.float32(0.0)
    if scale == 0:
        return np.zeros(delta.shape, np.int8), np.array([0.0], np.float32)
    x = delta.astype(np.float64) / float(scale)
    low = np.floor(x)
    codes = low + (rng.random(x.shape) < (x - low))
    return np.clip(codes, -127, 127).astype(np.int8), np.array([scale], np.float32)


def _topk(delta: np.ndarray, share: float) -> tuple[np.ndarray, np.ndarray]:
    """(values f4, flat positions i4 ascending) of the `share` of entries largest in magnitude."""
    flat = delta.reshape(-1)
    k = max(1, min(flat.size, math.ceil(share * flat.size)))
    idx = np.sort(np.argpartition(np.abs(flat), flat.size - k)[flat.size - k:]).astype(np.int32)
    return flat[idx].astype(np.float32), idx


class UpdateEncoder:
    """A device's side: encodes each update against the model it was trained from and keeps
    what the codec left out (`residual`, part of the device's state) for the next one."""

    def __init__(self, codec: str, share: float) -> None:
        if codec not in CODECS:
            raise ValueError(f"update_codec must be one of {', '.join(CODECS)}, got {codec!r}")
        self.codec, self.share = codec, float(share)
        self.residual: dict[str, np.ndarray] = {}

    def encode(self, weights: WeightMap, start: WeightMap, rng: np.random.Generator) -> dict[str, Any]:
        """The `weights` body fields of the update `weights - start` (plus the residual): the
        packed `weights`, `codec`, `scales` (int8) or `indices` (topk)."""
        packed: dict[str, np.ndarray] = {}
        scales: dict[str, np.ndarray] = {}
        indices: dict[str, np.ndarray] = {}
        for name, value in weights.items():
            if not compressed(name, value):
                packed[name] = value
                continue
            delta = value.astype(np.float32) - start[name].astype(np.float32) + self.residual.get(name, 0.0)
            if self.codec == "int8":
                packed[name], scales[name] = _int8(delta, rng)
                sent = packed[name].astype(np.float32) * scales[name][0]
            else:
                packed[name], indices[name] = _topk(delta, self.share)
                sent = np.zeros(delta.size, np.float32)
                sent[indices[name]] = packed[name]
                sent = sent.reshape(delta.shape)
            self.residual[name] = (delta - sent).astype(np.float32)
        return {"weights": packed, "codec": self.codec, "scales": scales, "indices": indices}

    def state_dict(self) -> dict[str, Any]:
        return {"residual": {k: v.copy() for k, v in self.residual.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.residual = {k: np.array(v, dtype=np.float32) for k, v in dict(state["residual"]).items()}

    numpy_state = True


def decode_update(body: Mapping[str, Any], reference: WeightMap | None) -> dict[str, np.ndarray]:
    """The dense weights of a compressed update: `reference` (the model it was trained from)
    plus its decoded delta. ProtocolError naming the rule when the edge does not hold that
    model or an array does not fit its tensor."""
    codec = str(body.get("codec") or "dense")
    if reference is None:
        raise ProtocolError("state.reference", f"a {codec} update of {body.get('part')} v{body.get('version')}, "
                                               f"a model this node does not hold")
    packed, scales, indices = body["weights"], body.get("scales") or {}, body.get("indices") or {}
    if set(packed) != set(reference):
        raise ProtocolError("state.weights", f"the update's tensors {sorted(set(packed) ^ set(reference))[:4]} "
                                             f"do not match the model's")
    extra = set(scales if codec == "int8" else indices) - {n for n in reference if compressed(n, reference[n])}
    if (codec == "int8" and indices) or (codec == "topk" and scales) or extra:
        raise ProtocolError("state.weights", f"a {codec} update carries arrays it has no tensor or codec for")
    out: dict[str, np.ndarray] = {}
    for name, ref in reference.items():
        value = np.asarray(packed[name])
        if not compressed(name, ref):
            out[name] = value
            continue
        out[name] = ref.astype(np.float32) + _delta(name, codec, value, scales.get(name), indices.get(name), ref)
        out[name] = out[name].astype(ref.dtype)
    return out


def _delta(name: str, codec: str, value: np.ndarray, scale: Any, idx: Any, ref: np.ndarray) -> np.ndarray:
    if codec == "int8":
        if scale is None or value.dtype != np.int8 or value.shape != ref.shape or np.shape(scale) != (1,) \
                or not np.isfinite(scale).all() or float(scale[0]) < 0:
            raise ProtocolError("state.weights", f"{name}: an int8 delta is int8 {ref.shape} with one scale >= 0")
        return value.astype(np.float32) * np.float32(scale[0])
    if idx is None or idx.ndim != 1 or value.shape != idx.shape or value.dtype.kind != "f" or not len(idx) \
            or int(idx.min()) < 0 or int(idx.max()) >= ref.size or np.any(np.diff(idx) <= 0):
        raise ProtocolError("state.weights", f"{name}: a top-k delta is values and ascending distinct positions "
                                             f"below {ref.size}")
    delta = np.zeros(ref.size, np.float32)
    delta[idx] = value
    return delta.reshape(ref.shape)
