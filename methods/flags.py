"""Command-line flags of method settings, generated from the methods' own config fields.

A setting gets a flag of its own (`--ic 2`, `--mean-only`, `--no-slow-averaging`) when its
Config field is declared with `methods.config.flag`; every setting, flagged or not, is reached by
`--set NAME=VALUE`. The flags of all registered methods form one argument group, each storing
the text it was given under the setting's name; the chosen method's Config then parses and
checks the lot (a flag of a setting the method does not have is refused by name). So a method
adds a flag in its own config, and no role runtime holds a table of them.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

from splitedge.methods.registry import built_in, get_method, list_methods

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Flag:
    name: str  # the setting
    help: str
    default: Any
    choices: tuple[str, ...] | None

    @property
    def option(self) -> str:
        dashed = self.name.replace("_", "-")
        return f"--no-{dashed}" if self.default is True else f"--{dashed}"


def method_flags() -> dict[str, Flag]:
    """Every flagged setting of the registered methods, by name. Two methods flagging one name
    must agree on what the flag is (a boolean switch or a value, and its choices)."""
    out: dict[str, Flag] = {}
    for method in list_methods():
        plugin = not built_in(method)
        try:
            config = get_method(method).Config
        except ValueError as exc:  # a plug-in that does not load costs its own flags, not the command line
            if not plugin:
                raise
            log.warning("%s; its settings get no flags", exc)
            continue
        for f in dataclasses.fields(config):
            if "flag" not in f.metadata:
                continue
            new = Flag(f.name, f.metadata["flag"], f.default, f.metadata.get("choices"))
            old = out.setdefault(f.name, new)
            if (isinstance(old.default, bool), old.option, old.choices) != (isinstance(new.default, bool), new.option,
                                                                             new.choices):
                if not plugin:
                    raise ValueError(f"{method} flags setting {f.name!r} unlike another method does ({old} vs {new})")
                log.warning("plug-in %s flags setting %r unlike another method does; set it with --set %s=VALUE",
                            method, f.name, f.name)
    return out


def add_method_flags(p: argparse.ArgumentParser) -> None:
    """The "method settings" group: one option per flagged setting, and `--set`."""
    g = p.add_argument_group("method settings", "a flag sets the chosen method's setting of its name "
                             "(docs/methods.md lists every method's settings)")
    for flag in sorted(method_flags().values(), key=lambda f: f.name):
        # absent unless given: the method's own default applies (and --help shows that one)
        if isinstance(flag.default, bool):
            g.add_argument(flag.option, dest=flag.name, action="store_const", const=not flag.default,
                           default=argparse.SUPPRESS, help=flag.help)
        else:
            g.add_argument(flag.option, dest=flag.name, default=argparse.SUPPRESS, choices=flag.choices,
                           metavar=None if flag.choices else "VALUE", help=f"{flag.help} (default {flag.default})")
    g.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="any method setting by name (repeatable), e.g. --set edge_samples=4096")


def method_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The method settings a command line gave: flags, then `--set` (text, typed later by the
    method's Config)."""
    out = {name: getattr(args, name) for name in method_flags() if getattr(args, name, None) is not None}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--set expects KEY=VALUE, got {item!r}")
        out[key] = value
    return out
