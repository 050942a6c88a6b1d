"""Typed run configuration that travels in the round announcement (a flat map of scalars).

Devices and edges are started with only a broker URL and an id; they learn the method, the
model and its normalisation from the cloud's `round` message. Every config class here is a
frozen dataclass of scalars so it maps onto that flat map and back without loss.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping, TypeVar

T = TypeVar("T")


def to_config(obj: Any) -> dict[str, Any]:
    """Dataclass -> flat map of scalars (tuples of floats become comma-separated strings)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if isinstance(value, tuple):
            value = ",".join(repr(float(v)) for v in value)
        if value is None:
            continue
        out[f.name] = value
    return out


def from_config(cls: type[T], config: Mapping[str, Any]) -> T:
    """Pick `cls`'s fields out of a flat map, converting types; unknown keys are ignored."""
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if f.name not in config:
            continue
        value = config[f.name]
        default = f.default if f.default is not dataclasses.MISSING else None
        if isinstance(default, tuple) or f.type in ("tuple[float, ...]",):
            value = tuple(float(v) for v in str(value).split(",") if v)
        elif isinstance(default, bool):
            value = _to_bool(value)
        elif isinstance(default, int) and not isinstance(value, bool):
            value = int(value)
        elif isinstance(default, float):
            value = float(value)
        kwargs[f.name] = value
    return cls(**kwargs)


def _to_bool(value: Any) -> bool:
    if isinstance(value, str):
        if value.lower() not in ("1", "0", "true", "false", "yes", "no"):
            raise ValueError(f"not a boolean: {value!r}")
        return value.lower() in ("1", "true", "yes")
    return bool(value)


@dataclass(frozen=True)
class ModelSpec:
    """The network every tier builds and how its input is normalised."""

    model: str = "cnn"
    num_classes: int = 10
    channels: int = 1
    image_size: int = 8
    mean: tuple[float, ...] = (0.5,)
    std: tuple[float, ...] = (0.25,)
    seed: int = 0

    def __post_init__(self) -> None:
        if len(self.mean) != self.channels or len(self.std) != self.channels:
            raise ValueError(f"mean/std need {self.channels} values, got {self.mean} / {self.std}")
        if self.num_classes < 2 or self.image_size < 4:
            raise ValueError(f"bad model spec: {self}")
