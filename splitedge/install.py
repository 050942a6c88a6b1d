"""Which commands this install holds. The thin device wheel (deploy/thin/) leaves out the roles
that need torch; naming one of them is a one-line answer with the install line, not a traceback."""

from __future__ import annotations

import importlib.util


def installed(module: str) -> bool:
    """Whether `module` (a command's, e.g. splitedge.cloud.cli) is in this install. A module that
    is there but fails to import (a missing dependency) counts as there: its import says why."""
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError as exc:  # its package is not installed either (splitedge.cloud)
        return not (exc.name and module.startswith(exc.name))


def missing_command(command: str, module: str) -> str | None:
    """The line to print when `command`'s module is not in this install, else None."""
    if installed(module):
        return None
    from importlib.metadata import PackageNotFoundError, version

    try:
        have = version("splitedge")
    except PackageNotFoundError:
        from splitedge import __version__ as have
    full = have.partition("+")[0]
    what = "the thin install (splitedge " + have + ", a device's: device, keys, data)" if have.endswith("+thin") \
        else f"splitedge {have}, which lacks {module}"
    return (f"splitedge {command}: not in this install: this is {what}; install the full wheel over it: "
            f"pip install 'splitedge-{full}-py3-none-any.whl[all]' (deploy/README.md, section 1)")
