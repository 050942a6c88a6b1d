"""SplitFed's own message kinds, registered when the method is looked up (torch-free)."""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from splitedge.protocol.schema import Array, Int, Schema, register_kind

KINDS = {
    "activations": Schema({
        "batch": Int(ge=0),
        "x": Array(dtypes=("f2", "f4"), shape=("B", "..."), finite=True),
        "y": Array(dtypes="i8", shape=("B",), ge=0),
    }, doc="device -> edge (SplitFed): W_c activations of one batch and its labels"),
    "gradients": Schema({
        "batch": Int(ge=0),
        "grad": Array(dtypes="f4", shape=("B", "..."), finite=True),
    }, doc="edge -> one device (SplitFed): the loss gradient of that batch's activations"),
}

EXAMPLES: dict[str, Callable[[], dict[str, Any]]] = {
    "activations": lambda: {"batch": 0, "x": np.zeros((2, 4), np.float32), "y": np.arange(2, dtype=np.int64)},
    "gradients": lambda: {"batch": 0, "grad": np.zeros((2, 4), np.float32)},
}
"""A valid body of each kind (tests/protocol/test_codec.py round-trips every kind a shipped method registers)."""

for _name, _schema in KINDS.items():
    register_kind(_name, _schema)
