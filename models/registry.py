"""Model registry (timm style): networks are found by name, so tests and configs need no
if/elif over model names, and a new model is tested as soon as it is registered."""
from __future__ import annotations

from typing import Any, Callable

from splitedge.models.split import SplitModel

ModelFn = Callable[..., SplitModel]
_REGISTRY: dict[str, ModelFn] = {}


def register_model(name: str) -> Callable[[ModelFn], ModelFn]:
    """Decorator registering a factory `fn(*, num_classes, in_channels, image_size, **kw)`."""
    def wrap(fn: ModelFn) -> ModelFn:
        if name in _REGISTRY and _REGISTRY[name] is not fn:
            raise ValueError(f"model {name!r} is already registered")
        _REGISTRY[name] = fn
        return fn
    return wrap


def list_models() -> list[str]:
    """Names of all registered models, sorted."""
    return sorted(_REGISTRY)


def create_split(name: str, *, num_classes: int, in_channels: int, image_size: int,
                 **kw: Any) -> SplitModel:
    """Build the registered model `name`; extra keywords go to its factory."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown model {name!r}; registered: {list_models()}")
    if num_classes < 1 or in_channels < 1 or image_size < 1:
        raise ValueError("num_classes, in_channels and image_size must be >= 1")
    return _REGISTRY[name](num_classes=num_classes, in_channels=in_channels,
                           image_size=image_size, **kw)
