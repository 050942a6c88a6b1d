"""Methods found by name (timm-style registry), imported lazily so thin devices stay torch-free."""

from __future__ import annotations

import importlib
from typing import Any

# name -> "module:attribute" of a Method subclass; importing the module must not import torch.
_METHODS: dict[str, str] = {
    "hsfp": "splitedge.methods.hsfp.method:HSFP",
    "fedavg": "splitedge.methods.fedavg.method:FedAvg",
    "splitfed": "splitedge.methods.splitfed.method:SplitFed",
    "fedproto": "splitedge.methods.fedproto.method:FedProto",
}


def register_method(name: str, target: str) -> None:
    """Register a method by import path ("package.module:Class")."""
    if name in _METHODS and _METHODS[name] != target:
        raise ValueError(f"method {name!r} already registered as {_METHODS[name]}")
    _METHODS[name] = target


def list_methods() -> list[str]:
    return sorted(_METHODS)


def get_method(name: str) -> Any:
    """The Method class registered as `name`; ValueError naming the choices otherwise."""
    if name not in _METHODS:
        raise ValueError(f"unknown method {name!r}; choose one of {list_methods()}")
    module, attr = _METHODS[name].split(":")
    return getattr(importlib.import_module(module), attr)
