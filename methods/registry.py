"""Methods found by name (timm-style registry), imported lazily so thin devices stay torch-free.

A method registers itself from its own package: `register_method("name", "pkg.module:Class")`
(or the class itself), in one line here for the methods we ship, or from anywhere else (a
test, a plug-in) for more. Variants are Method subclasses registered under their own name.
Plug-ins (protocol/plugins.py) join from the installed packages' `splitedge.methods` entry
points, or by an import path on the node's own command line (`use_method`); a name off the
wire only selects among them.
"""

from __future__ import annotations

import importlib
from typing import Any, Mapping

from splitedge.methods.config import RunConfig, from_wire
from splitedge.protocol import plugins

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
_BUILT_IN = frozenset(_METHODS)


def _read_entry_points() -> None:
    """The installed plug-ins' methods (protocol/plugins.py), once per process."""
    plugins.join_entry_points(plugins.METHODS_GROUP, _METHODS, _BUILT_IN, "method")


def register_method(name: str, target: Any) -> None:
    """Register a method by import path ("package.module:Class") or as the class itself."""
    if not isinstance(name, str) or not name or "/" in name or len(name) > 64:
        raise ValueError(f"method name {name!r} must be a non-empty string of at most 64 characters without '/'")
    if name in _METHODS and _METHODS[name] != target:
        raise ValueError(f"method {name!r} already registered as {_METHODS[name]}")
    _METHODS[name] = target


def list_methods() -> list[str]:
    _read_entry_points()
    return sorted(_METHODS)


def built_in(name: str) -> bool:
    """Whether `name` is a method splitedge ships (not a plug-in)."""
    return name in _BUILT_IN


def use_method(value: str) -> str:
    """The method a node's own command line names: a registered name, or an import path
    `package.module:Class` of a Method subclass, registered under that path (so a sim's
    devices and workers find it). ValueError in one line otherwise."""
    _read_entry_points()
    return plugins.use_named(value, _METHODS, get_method, "method", list_methods())


def get_method(name: str) -> Any:
    """The Method class registered as `name`; ValueError naming the choices otherwise.

    Importing its entry module registers the method's own message kinds, so a runtime that
    looked the method up can decode its messages.
    """
    _read_entry_points()
    if name not in _METHODS:
        raise plugins.NotInstalled(f"unknown method {name!r}; choose one of {list_methods()}")
    target = _METHODS[name]
    if name in _BUILT_IN and isinstance(target, str):
        module, attr = target.split(":")
        return getattr(importlib.import_module(module), attr)
    cls = plugins.load(target, "method") if isinstance(target, str) else target
    from splitedge.methods.contract import Method

    if not (isinstance(cls, type) and issubclass(cls, Method)):
        raise ValueError(f"method {name!r} ({target}) is not a splitedge Method subclass "
                         f"(splitedge.methods.contract.Method)")
    return cls


def create_method(name: str, config: Mapping[str, Any] | RunConfig) -> Any:
    """A Method instance for `name` with its config, parsed from the wire form when needed."""
    cls = get_method(name)
    if not isinstance(config, RunConfig):
        config = RunConfig.from_wire(cls.Config, config)
    return cls(config, name=name)


def settled(method: Any) -> dict[str, Any]:
    """`method.settle()` (what the cloud derives before round 1, and the run's settings checked),
    a setting the method has no form of naming the methods that have it: the contract names
    none (NotCovered), the registry knows them all."""
    from splitedge.methods.contract import NotCovered

    try:
        return method.settle()
    except NotCovered as exc:
        raise exc.naming(covering(exc.covers)) from None


def covering(covers: Any) -> list[str]:
    """The registered methods whose class `covers` accepts (one that cannot load is left out)."""
    out = []
    for name in list_methods():
        try:
            if covers(get_method(name)):
                out.append(name)
        except Exception:  # noqa: BLE001 - a broken plug-in is not a reason to hide the others
            continue
    return out


def default_config(name: str, model: Any, **settings: Any) -> RunConfig:
    """A RunConfig of `name`'s defaults with `settings` (typed values or command-line text)."""
    from splitedge.methods.config import parse_settings

    cls = get_method(name)
    return RunConfig(model, from_wire(cls.Config, parse_settings(cls.Config, settings)))
