"""Part state as typed fields: `model: Kept[nn.Module]` on a part class says the attribute carries
the part from one round to the next (what `Part.resume_state` keeps, methods/snapshot.py).

`Kept[T]` is `Annotated[T, KEPT]`: a type checker sees the field as a `T`, and `Part` reads the
marker when a subclass is made (`kept_fields`), base classes' fields first, so a subclass extends
its base's by declaring its own. Modules here postpone annotations (`from __future__ import
annotations`), so the marker is read from the annotation's text as `dataclasses` reads
`ClassVar`: the name it starts with, `Kept` or `<module>.Kept`, checked against the module's
globals. State that lives in a helper object is a property whose getter returns `Kept[T]`
(with a setter, which restoring calls). A declared field the part's constructor leaves unset is a TypeError when the part is
built (`unset_fields`), not a failed save rounds later.

This module is torch-free so that a thin device can import it.
"""

from __future__ import annotations

import re
import sys
from typing import Annotated, Any, Iterable, TypeVar

T = TypeVar("T")


class _Marker:
    """The one object in a `Kept` annotation's metadata."""

    def __repr__(self) -> str:
        return "KEPT"


KEPT = _Marker()
Kept = Annotated[T, KEPT]
"""`name: Kept[T]` on a part class: the attribute `name`, of type T, is the part's state."""

_HEAD = re.compile(r"^\s*(?:(\w+)\s*\.\s*)?(\w+)\s*(?:\[|$)")


def _names_kept(text: str, module: str) -> bool:
    """Whether a postponed annotation `text` of a class in `module` is `Kept[...]`: its leading
    name is Kept, and in the module's globals (when it is there yet) that name is this Kept."""
    match = _HEAD.match(text)
    if match is None or match.group(2) != "Kept":
        return False
    scope = vars(sys.modules[module]) if module in sys.modules else {}
    prefix = match.group(1)
    found = getattr(scope.get(prefix), "Kept", None) if prefix else scope.get("Kept")
    if found is not None and found is not Kept:
        raise TypeError(f"{text!r} in {module}: its Kept is not splitedge.methods.kept.Kept")
    return True


def _is_kept(annotation: Any, module: str) -> bool:
    if isinstance(annotation, str):
        return _names_kept(annotation, module)
    return any(m is KEPT for m in getattr(annotation, "__metadata__", ()))


def _kept_property(name: str, value: Any, cls: type) -> bool:
    """Whether `value` is a property whose getter returns `Kept[T]` (state kept elsewhere, e.g.
    in a helper object); restoring sets it, so it needs a setter."""
    if not isinstance(value, property) or value.fget is None:
        return False
    if not _is_kept(value.fget.__annotations__.get("return"), value.fget.__module__):
        return False
    if value.fset is None:
        raise TypeError(f"{cls.__name__}.{name} is a Kept property without a setter: restoring sets it")
    return True


def own_kept(cls: type) -> list[str]:
    """The fields `cls` itself (not a base) annotates as Kept, in the order it declares them, then
    its Kept properties in the order it defines them."""
    annotations = cls.__dict__.get("__annotations__", {})
    fields = [name for name, ann in annotations.items() if _is_kept(ann, cls.__module__)]
    properties = [name for name, value in vars(cls).items() if _kept_property(name, value, cls)]
    return fields + [name for name in properties if name not in fields]


def kept_fields(cls: type) -> tuple[str, ...]:
    """Every Kept field of `cls` and its bases (mixins too): the furthest base's first, each once."""
    names: dict[str, None] = {}
    for klass in reversed(cls.__mro__):
        names.update(dict.fromkeys(own_kept(klass)))
    return tuple(names)


def unset_fields(obj: Any, names: Iterable[str]) -> list[str]:
    """The fields of `names` that `obj` has no value for (neither set nor a class default)."""
    return [name for name in names if not hasattr(obj, name)]
