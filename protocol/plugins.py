"""What this install provides beyond what splitedge ships: methods and models of one's own.

A plug-in is found two ways, both chosen by the node's owner, never by a peer:
- an entry point of an installed package (group `splitedge.methods` or `splitedge.models`:
  `name = "package.module:Attribute"`), which is how a plug-in ships to devices;
- an import path (`package.module:Attribute`) on the node's own command line (`--method`,
  `--model`, `--plugin`), for a sim or a cloud trying one out.
A name the wire carries only selects among what the process registered that way: an import
path that arrives in a round announcement is an unknown name, not something to import (the
device builds what it runs from its own install). This module sits in the lowest layer and
imports neither torch nor a method, because both registries read it.
"""

from __future__ import annotations

import importlib
import logging
import re
from importlib import metadata
from typing import Any, Callable, Container, Iterable, MutableMapping

log = logging.getLogger(__name__)

METHODS_GROUP = "splitedge.methods"
MODELS_GROUP = "splitedge.models"
THIN_MODELS_GROUP = "splitedge.thin_models"  # a model's numpy layers for thin devices (methods/thin/plugins.py)
_PATH = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


class NotInstalled(ValueError):
    """A method or model name this process has not registered: a node asked to run it can
    never take part (runtime/parts.py) until its owner installs or names the plug-in."""


HINT = "install the plug-in package that provides it on this node, or start the node with --plugin package.module:Attr"


def is_import_path(text: Any) -> bool:
    """Whether `text` reads `package.module:Attribute`."""
    return isinstance(text, str) and _PATH.fullmatch(text) is not None


def load(path: str, what: str) -> Any:
    """The object `package.module:Attribute` names; one-line ValueError when it is no import
    path, its module does not import, or it lacks the attribute (`what` names it: "method")."""
    if not is_import_path(path):
        raise ValueError(f"{what} {path!r} is neither a registered name nor an import path package.module:Attribute")
    module, _, attr = path.partition(":")
    try:
        obj: Any = importlib.import_module(module)
    except ImportError as exc:
        raise ValueError(f"{what} {path!r}: module {module!r} does not import ({exc}); install the package that "
                         f"provides it, or put its folder on PYTHONPATH") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{what} {path!r}: {module} has no {attr!r}")
        obj = getattr(obj, part)
    return obj


def entry_points(group: str) -> dict[str, str]:
    """`{name: "package.module:Attribute"}` the installed packages declare in `group` (first
    one wins a name two packages declare, with a warning); malformed ones are skipped, logged."""
    found: dict[str, str] = {}
    for ep in sorted(metadata.entry_points(group=group), key=lambda e: (e.name, e.value)):
        if not is_import_path(ep.value.replace(" ", "")):
            log.warning("entry point %s = %r (group %s) is no package.module:Attribute; ignored", ep.name, ep.value,
                        group)
        elif ep.name in found and found[ep.name] != ep.value:
            log.warning("entry point %s (group %s) is declared twice (%s, %s); %s is used", ep.name, group,
                        found[ep.name], ep.value, found[ep.name])
        else:
            found[ep.name] = ep.value.replace(" ", "")
    return found


_joined: set[str] = set()


def join_entry_points(group: str, into: MutableMapping[str, Any], shipped: Container[str], what: str) -> None:
    """The installed plug-ins of `group` added to a registry `into` as import paths, once per
    process; a name splitedge ships (`shipped`) keeps its documented meaning: the plug-in of
    that name is ignored, with a warning."""
    if group in _joined:
        return
    _joined.add(group)
    for name, path in entry_points(group).items():
        if name in shipped:
            log.warning("plug-in %s %s (%s) has the name of one splitedge ships; ignored", what, name, path)
        else:
            into.setdefault(name, path)


def use_named(value: str, into: MutableMapping[str, Any], build: Callable[[str], Any], what: str,
              choices: Iterable[str]) -> str:
    """What a node's own command line names: a name `into` has, or an import path registered
    there under itself; either is checked by `build` (which loads it). A path that does not
    load stays unregistered. ValueError in one line."""
    if value in into:
        build(value)
        return value
    if not is_import_path(value):
        raise ValueError(f"unknown {what} {value!r}; choose one of {', '.join(choices)}, or name one of your own as "
                         f"package.module:Attribute (docs/plugins.md)")
    into[value] = value
    try:
        build(value)
    except ValueError:
        del into[value]
        raise
    return value
