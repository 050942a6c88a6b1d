"""Small, valid, deterministic example messages for every built-in kind.

Used by PROTOCOL.md's worked example, the wire-overhead bench and the tests (which are
generated from this table, so a new built-in kind without an example fails a test).
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from .codec import Envelope

__all__ = ["EXAMPLE_MSG_ID", "example_body", "example_envelope", "worked_example", "EXAMPLES"]

EXAMPLE_MSG_ID = "0123456789abcdef0123456789abcdef"


def _moments(k: int = 2, d: int = 3, dtype: str = "f4") -> dict[str, Any]:
    rng = np.random.default_rng(0)
    return {
        "classes": np.arange(k, dtype="i8"), "counts": np.full(k, 4, dtype="i8"),
        "mean": rng.normal(size=(k, d)).astype(dtype), "var": rng.random((k, d)).astype(dtype),
        "space": "wc", "versions": {"wc": 1},
    }


def _weights() -> dict[str, Any]:
    rng = np.random.default_rng(1)
    weights = {"conv.weight": rng.normal(size=(4, 1, 3, 3)).astype("f4"),
               "bn.running_var": np.ones(4, dtype="f4"),
               "bn.num_batches_tracked": np.array(7, dtype="i8")}
    return {"part": "wc", "version": 2, "samples": 100, "weights": weights}


EXAMPLES: dict[str, Callable[[], dict[str, Any]]] = {
    "hello": lambda: {"role": "device", "parent": "e1", "samples": 10, "backend": "onnx",
                      "classes": np.array([0, 3], dtype="i8")},
    "status": lambda: {"state": "online", "role": "device"},
    "round": lambda: {"method": "hsfp", "session": "5e55", "deadline_s": 30.0, "versions": {"wc": 1, "we": 1},
                      "config": {"model": {"model": "cnn", "mean": [0.5], "std": [0.25]},
                                 "method": {"device_lr": 0.05, "local_epochs": 1, "mean_only": False}},
                      "directives": {"average": ["we"]}},
    "assign": lambda: {"edge": "e2", "groups": ["c1"], "peers": ["d4", "d7"]},
    "moments": _moments,
    "weights": _weights,
    "logits": lambda: {"classes": np.array([0, 1], dtype="i8"),
                       "counts": np.array([3, 5], dtype="i8"),
                       "logits": np.arange(6, dtype="f4").reshape(2, 3)},
    "arrays": lambda: {"name": "directions", "version": 0, "arrays": {"d": np.ones(4, dtype="f4")},
                       "scalars": {"alpha": 10.0}},
    "metrics": lambda: {"accuracy": 0.5, "loss": 1.25, "round": 3},
    "request": lambda: {"what": "moments"},
    "secagg": lambda: {"stage": "keys", "batch": 0, "sum": "moments.wc", "data": {"device": "d1", "c": bytes(32), "s": bytes(range(32))}},
    "done": lambda: {"phase": "train", "info": {"samples": 120, "loss": {"ce": 1.5}, "cost": {"cpu_s": 0.4}}},
}


def example_body(kind: str) -> dict[str, Any]:
    """A fresh valid body for built-in ``kind`` (KeyError for kinds without an example)."""
    return EXAMPLES[kind]()


def example_envelope(kind: str, *, round: int = 3) -> Envelope:
    return Envelope(kind=kind, run="demo", round=round, sender="d1",
                    body=example_body(kind), msg_id=EXAMPLE_MSG_ID)


def worked_example() -> Envelope:
    """PROTOCOL.md's worked example: a ``moments`` message with K=1, D=2 float32, W_c version 1."""
    body = {
        "classes": np.array([3], dtype="i8"), "counts": np.array([5], dtype="i8"),
        "mean": np.array([[1.0, 2.0]], dtype="f4"), "var": np.array([[0.5, 0.25]], dtype="f4"),
        "space": "wc", "versions": {"wc": 1},
    }
    return Envelope(kind="moments", run="demo", round=3, sender="d1", body=body,
                    msg_id=EXAMPLE_MSG_ID)
