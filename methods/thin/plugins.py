"""Networks of one's own for thin devices: the numpy layers (methods/thin/layers.py) a device
without torch builds for a model the cloud runs as a torch plug-in (models/registry.py).

A thin device runs only what its own install defines. For a model of one's own, its owner
installs (or names with `--plugin`) a `ThinModel`: the model's name as the cloud announces it,
and builders of W_c (trainable: H-SFP's moments and SupCon, SplitFed) and, optionally, of W_e
and W_g's trunk (head calibration, FedAvg on thin devices), with the torch split's state names,
so the weights the cloud sends load as they are after the usual checks. It ships in a module
that imports no torch, declared under the entry point group `splitedge.thin_models` with the
model's name (the same name as its `splitedge.models` entry), or named on the node's command
line: `splitedge device --backend onnx --plugin package.thin_module:THIN`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from splitedge.methods.thin.layers import Sequential
from splitedge.protocol import plugins


@dataclass(frozen=True)
class ThinModel:
    """A model's thin builders. `wc(in_channels)` returns W_c; `calib(in_channels, image_size,
    classes)` returns Sequential([("we", W_e), ("wg", W_g without its classifier)]), or None when
    thin devices of this model do not calibrate or run FedAvg."""

    name: str
    wc: Callable[[int], Sequential]
    calib: Callable[[int, int, int], Sequential] | None = None


_REGISTRY: dict[str, ThinModel] = {}
_PLUGGED: dict[str, str] = {}  # name -> import path of an installed plug-in not loaded yet


def register_thin_model(model: ThinModel, shipped: tuple[str, ...] = ()) -> None:
    """Register `model` under its name; ValueError for a name splitedge ships or another model
    already registered under it."""
    if not isinstance(model, ThinModel):
        raise ValueError(f"a thin model is a ThinModel, got {type(model).__name__}")
    if model.name in shipped:
        raise ValueError(f"thin model {model.name!r} has the name of a network splitedge ships")
    if _REGISTRY.get(model.name, model) is not model:
        raise ValueError(f"thin model {model.name!r} is already registered")
    _REGISTRY[model.name] = model


def thin_plugin(name: str) -> ThinModel | None:
    """The thin model registered (or installed) under `name`, or None."""
    plugins.join_entry_points(plugins.THIN_MODELS_GROUP, _PLUGGED, (), "thin model")
    if name not in _REGISTRY and name in _PLUGGED:
        model = plugins.load(_PLUGGED[name], "thin model")
        if not isinstance(model, ThinModel) or model.name != name:
            raise ValueError(f"thin model {name!r} ({_PLUGGED[name]}) is not a ThinModel named {name!r}")
        _REGISTRY[name] = model
    return _REGISTRY.get(name)


def thin_plugins() -> list[str]:
    """Names of the thin models of one's own this process can build."""
    plugins.join_entry_points(plugins.THIN_MODELS_GROUP, _PLUGGED, (), "thin model")
    return sorted(set(_REGISTRY) | set(_PLUGGED))
