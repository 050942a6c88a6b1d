"""Model registry (timm style): networks are found by name, so tests and configs need no
if/elif over model names, and a new model is tested as soon as it is registered.

One's own network joins as a plug-in (protocol/plugins.py): an installed package's
`splitedge.models` entry point, or an import path `package.module:factory` on the node's own
command line (`use_model`). A factory takes `num_classes`, `in_channels` and `image_size` and
returns a SplitModel (models.split.split_module cuts any nn.Module into one by module names).
A name off the wire only selects among what this process registered."""
from __future__ import annotations

from typing import Any, Callable

from splitedge.models.split import SplitModel
from splitedge.protocol import plugins

ModelFn = Callable[..., SplitModel]
_REGISTRY: dict[str, ModelFn] = {}
_PLUGGED: dict[str, str] = {}  # name -> import path of a plug-in not imported yet


def _read_entry_points() -> None:
    """The installed plug-ins' models (protocol/plugins.py), once per process."""
    plugins.join_entry_points(plugins.MODELS_GROUP, _PLUGGED, _REGISTRY, "model")


def _factory(name: str) -> ModelFn:
    _read_entry_points()
    if name not in _REGISTRY and name in _PLUGGED:
        fn = plugins.load(_PLUGGED[name], "model")
        if not callable(fn):
            raise ValueError(f"model {name!r} ({_PLUGGED[name]}) is not a factory (a callable returning a SplitModel)")
        _REGISTRY[name] = fn
    if name not in _REGISTRY:
        raise plugins.NotInstalled(f"unknown model {name!r}; registered: {list_models()}")
    return _REGISTRY[name]


def use_model(value: str) -> str:
    """The model a node's own command line names: a registered name, or an import path
    `package.module:factory`, registered under that path. ValueError in one line otherwise."""
    _read_entry_points()
    if value in _REGISTRY:
        return value
    return plugins.use_named(value, _PLUGGED, _factory, "model", list_models())


def register_model(name: str) -> Callable[[ModelFn], ModelFn]:
    """Decorator registering a factory `fn(*, num_classes, in_channels, image_size, **kw)`."""
    def wrap(fn: ModelFn) -> ModelFn:
        if name in _REGISTRY and _REGISTRY[name] is not fn:
            raise ValueError(f"model {name!r} is already registered")
        _REGISTRY[name] = fn
        return fn
    return wrap


def list_models() -> list[str]:
    """Names of all registered models (plug-ins included), sorted."""
    _read_entry_points()
    return sorted(set(_REGISTRY) | set(_PLUGGED))


def create_split(name: str, *, num_classes: int, in_channels: int, image_size: int,
                 **kw: Any) -> SplitModel:
    """Build the registered model `name`; extra keywords go to its factory."""
    fn = _factory(name)
    if num_classes < 1 or in_channels < 1 or image_size < 1:
        raise ValueError("num_classes, in_channels and image_size must be >= 1")
    split = fn(num_classes=num_classes, in_channels=in_channels, image_size=image_size, **kw)
    if not isinstance(split, SplitModel):
        raise ValueError(f"model {name!r} returned {type(split).__name__}, not a SplitModel "
                         f"(models.split.split_module cuts an nn.Module into one)")
    return split
