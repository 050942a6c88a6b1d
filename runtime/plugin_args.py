"""`--plugin package.module:Attribute` on every role: a method, model or mod of one's own, named
by the node's owner (protocol/plugins.py), registered before the node hears any name off the wire.

A device or edge that should run a plug-in not installed as a package (no entry point) is
started with it: then a round announcement that names it finds it; one that names anything
else this install lacks is refused as ever.
"""

from __future__ import annotations

import argparse
from typing import Sequence

from splitedge.protocol import plugins


def add_plugin_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--plugin", action="append", default=[], metavar="PACKAGE.MODULE:ATTR",
                   help="a method (a Method subclass), a model (a factory returning a SplitModel), a thin model "
                        "(a ThinModel: its numpy layers for devices without torch) or a mod (a Mod subclass: a "
                        "handler around the part's work on the tiers it names) of one's own for this node to run, "
                        "by import path (repeatable; an installed plug-in package needs none: docs/plugins.md)")


def use_plugins(paths: Sequence[str]) -> list[str]:
    """Register each import path as the method, model or mod it names; ValueError in one line
    for one that loads as none of them."""
    if not paths:
        return []
    from splitedge.methods.contract import Method
    from splitedge.methods.registry import use_method
    from splitedge.methods.thin.graphs import CALIB_BUILDERS
    from splitedge.methods.thin.plugins import ThinModel, register_thin_model
    from splitedge.runtime.mods import Mod, use_mod

    for path in paths:
        obj = plugins.load(path, "--plugin")
        if isinstance(obj, type) and issubclass(obj, Method):
            use_method(path)
        elif isinstance(obj, type) and issubclass(obj, Mod):
            use_mod(obj)
        elif isinstance(obj, ThinModel):  # numpy only: a thin device stays torch-free
            register_thin_model(obj, shipped=tuple(CALIB_BUILDERS))
        elif callable(obj):
            from splitedge.models import use_model  # torch: a model plug-in needs it anyway

            use_model(path)
        else:
            raise ValueError(f"--plugin {path}: neither a Method subclass, a model factory, a ThinModel nor a Mod "
                             f"subclass")
    return list(paths)
