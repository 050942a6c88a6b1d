"""SplitFed's own message kinds, registered when the method is looked up (torch-free)."""

from __future__ import annotations

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

for _name, _schema in KINDS.items():
    register_kind(_name, _schema)
