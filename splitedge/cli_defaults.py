"""Where a role's flags come from when the command line does not give them: a SPLITEDGE_<FLAG>
environment variable (what the systemd units set), else the role's section of a TOML run config
(``--config FILE``: the settings a deployment repeats), else the flag's own default. A flag on
the command line always wins. A relative path in a config file is taken from the file's own
folder (a bundle of `splitedge provision` works wherever it is copied); one in a variable or on
the command line, from the working directory as usual. A setting the role does not have, or a value its flag would
refuse, is one line naming the file or variable, before any work starts.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

ROLES = ("cloud", "edge", "device")
"""The long-running roles a unit file starts: they read SPLITEDGE_* and --config."""
ENV_PREFIX = "SPLITEDGE_"
COMMON = "common"
"""The config section every role reads before its own."""
TRUE, FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off", "")
NOT_FLAGS = ("SPLITEDGE_CONFIG", "SPLITEDGE_ARGS", "SPLITEDGE_CRASH_AT", "SPLITEDGE_CACHE")
"""Variables that name no flag: the config file, the units' further flags (deploy/*.service
expand it), a test's crash point (runtime/faults.py), the data sets' cache."""
TEST_PREFIX = "SPLITEDGE_TEST_"
"""Test-only hooks, never a setting."""


def env_name(action: argparse.Action) -> str:
    """SPLITEDGE_BROKER for --broker, SPLITEDGE_STATE_DIR for --state-dir."""
    return ENV_PREFIX + action.dest.upper()


def settable(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """dest -> action of the options a config file or variable may give (not help or config)."""
    return {a.dest: a for a in parser._actions  # argparse keeps no public list of actions
            if a.option_strings and a.dest not in ("help", "config", "version", "verbose")}


def config_path(argv: Sequence[str], environ: Mapping[str, str]) -> Path | None:
    """--config FILE (or --config=FILE) from argv, else SPLITEDGE_CONFIG."""
    for i, arg in enumerate(argv):
        if arg == "--config" and i + 1 < len(argv):
            return Path(argv[i + 1])
        if arg.startswith("--config="):
            return Path(arg.split("=", 1)[1])
    value = environ.get(ENV_PREFIX + "CONFIG")
    return Path(value) if value else None


def read_config(path: Path, role: str) -> dict[str, Any]:
    """The [common] then [<role>] settings of a TOML file, keys as flag names (state-dir or state_dir)."""
    import tomllib

    try:
        doc = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"--config {path}: no such file") from None
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"--config {path}: not TOML ({exc})") from None
    unknown = sorted(set(doc) - {COMMON, *ROLES})
    if unknown:
        raise ValueError(f"--config {path}: unknown section [{unknown[0]}] (sections: {COMMON}, {', '.join(ROLES)})")
    merged: dict[str, Any] = {}
    for section in (COMMON, role):
        table = doc.get(section, {})
        if not isinstance(table, dict):
            raise ValueError(f"--config {path}: [{section}] must be a table of settings")
        merged.update({k.replace("-", "_"): v for k, v in table.items()})
    return merged


def from_folder(action: argparse.Action, value: Any, folder: Path) -> Any:
    """A path setting's relative value as a path below `folder` (the config file's); others as given."""
    if action.type is not Path or not isinstance(value, str) or not value or Path(value).expanduser().is_absolute():
        return value
    return str(folder / value)


def convert(action: argparse.Action, value: Any, where: str) -> Any:
    """A file's or variable's value as the flag would have parsed it."""
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text not in TRUE + FALSE:
            raise ValueError(f"{where}: {action.option_strings[-1]} is on or off (true/false), got {value!r}")
        on = text in TRUE
        return on if isinstance(action, argparse._StoreTrueAction) else not on
    if isinstance(value, list):
        return [convert_one(action, v, where) for v in value]
    return convert_one(action, value, where)


def convert_one(action: argparse.Action, value: Any, where: str) -> Any:
    try:
        out = action.type(str(value)) if callable(action.type) else str(value)
    except (TypeError, ValueError, argparse.ArgumentTypeError) as exc:
        raise ValueError(f"{where}: {action.option_strings[-1]} {value!r}: {exc}") from None
    if action.choices is not None and out not in action.choices:
        raise ValueError(f"{where}: {action.option_strings[-1]} {value!r} is not one of "
                         f"{', '.join(map(str, action.choices))}")
    return out


def check_variables(environ: Mapping[str, str], own: set[str], every_role: Callable[[], set[str]]) -> None:
    """A SPLITEDGE_* variable that no role reads is a misspelling a unit would otherwise ignore
    in silence: one line naming it (and the closest name). A variable of another role's flag is
    left alone, so one env file may serve several roles. `every_role` is called only when a
    variable is not this role's own."""
    import difflib

    strange = sorted(k for k in environ if k.startswith(ENV_PREFIX) and k not in own and k not in NOT_FLAGS
                     and not k.startswith(TEST_PREFIX))
    if not strange:
        return
    known = every_role() | set(NOT_FLAGS)
    for name in strange:
        if name not in known:
            close = difflib.get_close_matches(name, sorted(known), n=1)
            hint = f"did you mean {close[0]}? " if close else ""
            raise ValueError(f"{name}: no splitedge role reads this variable ({hint}each flag's is SPLITEDGE_<FLAG>, "
                             f"e.g. SPLITEDGE_BROKER for --broker)")


def apply(parser: argparse.ArgumentParser, role: str, argv: Sequence[str],
          environ: Mapping[str, str] | None = None, every_role: Callable[[], set[str]] | None = None) -> None:
    """Set the role's flag defaults from its variables and config file; a flag so given is no
    longer required on the command line. With `every_role` (the variables every role reads), a
    SPLITEDGE_* variable none reads is refused (check_variables)."""
    environ = os.environ if environ is None else environ
    actions = settable(parser)
    if every_role is not None:
        check_variables(environ, {env_name(a) for a in actions.values()}, every_role)
    path = config_path(argv, environ)
    values: dict[str, tuple[Any, str]] = {}
    if path is not None:
        for key, value in read_config(path, role).items():
            if key not in actions:
                raise ValueError(f"--config {path}: splitedge {role} has no setting {key!r} "
                                 f"(settings: {', '.join(sorted(k.replace('_', '-') for k in actions))})")
            values[key] = (from_folder(actions[key], value, path.parent), f"--config {path}")
    for dest, action in actions.items():
        if environ.get(env_name(action)):  # an empty variable (a unit's placeholder) gives nothing
            values[dest] = (environ[env_name(action)], env_name(action))
    for dest, (value, where) in values.items():
        action = actions[dest]
        action.default, action.required = convert(action, value, where), False
