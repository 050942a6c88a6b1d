"""Secure-aggregation messages through the wire as the codec packs them, and the statistics a
device sums: shared by the SecAgg tests, signed and unsigned."""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np

from splitedge.protocol.arrays import ext_default, ext_hook


def wire(msg: Any) -> Any:
    """``msg`` through to_body, msgpack (as the codec packs arrays) and from_body."""
    data = msgpack.packb(msg.to_body(), default=ext_default, use_bin_type=True)
    return type(msg).from_body(msgpack.unpackb(data, ext_hook=ext_hook, raw=False))


def make_inputs(rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {"sum": (rng.normal(size=(10, 16)) * 50).astype(np.float32), "sumsq": rng.random((10, 16)) * 1e4,
            "count": rng.integers(0, 1000, 10), "flag": rng.random(3) < 0.5}
