"""Methods found by name (timm-style registry), imported lazily so thin devices stay torch-free.

A method registers itself from its own package: `register_method("name", "pkg.module:Class")`
(or the class itself), in one line here for the methods we ship, or from anywhere else (a
test, a plug-in) for more. Variants are Method subclasses registered under their own name.
"""

from __future__ import annotations

import importlib
from typing import Any, Mapping

from splitedge.methods.config import RunConfig, from_wire

# name -> "module:attribute" of a Method subclass (or the class); importing it must not import torch.
_METHODS: dict[str, Any] = {
    "hsfp": "splitedge.methods.hsfp.method:HSFP",
    "hsfp-cal": "splitedge.methods.hsfp.method:HSFPCalibrated",
    "fedavg": "splitedge.methods.fedavg.method:FedAvg",
    "fedprox": "splitedge.methods.fedprox.method:FedProx",
    "scaffold": "splitedge.methods.scaffold.method:Scaffold",
    "fedavgm": "splitedge.methods.fedopt.method:FedAvgM",
    "fedadam": "splitedge.methods.fedopt.method:FedAdam",
    "fedyogi": "splitedge.methods.fedopt.method:FedYogi",
    "splitfed": "splitedge.methods.splitfed.method:SplitFed",
    "fedproto": "splitedge.methods.fedproto.method:FedProto",
    "simsiam": "splitedge.methods.ssl.method:SimSiam",
    "align-uniform": "splitedge.methods.ssl.method:AlignUniform",
    "ssd": "splitedge.methods.ssl.method:SSD",
    "cflhkd": "splitedge.methods.cflhkd.method:CFLHKD",
    "fedmar": "splitedge.methods.mar.method:FedMAR",
    "decmar": "splitedge.methods.mar.method:DecMAR",
}


def register_method(name: str, target: Any) -> None:
    """Register a method by import path ("package.module:Class") or as the class itself."""
    if not isinstance(name, str) or not name or "/" in name or len(name) > 64:
        raise ValueError(f"method name {name!r} must be a non-empty string of at most 64 characters without '/'")
    if name in _METHODS and _METHODS[name] != target:
        raise ValueError(f"method {name!r} already registered as {_METHODS[name]}")
    _METHODS[name] = target


def list_methods() -> list[str]:
    return sorted(_METHODS)


def get_method(name: str) -> Any:
    """The Method class registered as `name`; ValueError naming the choices otherwise.

    Importing its entry module registers the method's own message kinds, so a runtime that
    looked the method up can decode its messages.
    """
    if name not in _METHODS:
        raise ValueError(f"unknown method {name!r}; choose one of {list_methods()}")
    target = _METHODS[name]
    if not isinstance(target, str):
        return target
    module, attr = target.split(":")
    return getattr(importlib.import_module(module), attr)


def create_method(name: str, config: Mapping[str, Any] | RunConfig) -> Any:
    """A Method instance for `name` with its config, parsed from the wire form when needed."""
    cls = get_method(name)
    if not isinstance(config, RunConfig):
        config = RunConfig.from_wire(cls.Config, config)
    return cls(config, name=name)


def default_config(name: str, model: Any, **settings: Any) -> RunConfig:
    """A RunConfig of `name`'s defaults with `settings` (typed values or command-line text)."""
    from splitedge.methods.config import parse_settings

    cls = get_method(name)
    return RunConfig(model, from_wire(cls.Config, parse_settings(cls.Config, settings)))
