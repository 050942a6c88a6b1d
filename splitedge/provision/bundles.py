"""The files of a provisioned fleet: the broker's, one bundle per node, the operator's secrets.

A node's bundle holds all it runs with and nothing of another node: its config (paths relative
to the config, so the folder works wherever it is copied), its login, its private key, every
node's public key and role, its data (a device) or the manifest (an edge), and its unit.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from splitedge.provision.units import CONFIG, unit_name, unit_text

BROKER = "broker"
OPERATOR = "operator"
RESERVED = (BROKER, OPERATOR)
"""Folders of the output that are not a node's bundle: no node may have these ids."""
KEY, LOGIN, KEYS, SHARD, MANIFEST = "node.key", "login.password", "keys", "shard.npz", "shards.json"


@dataclass
class Node:
    """One node of the fleet and what its config says beyond the common part."""

    id: str
    role: str
    settings: dict[str, Any] = field(default_factory=dict)
    shard: Path | None = None  # a device's shard, copied into its bundle


def toml_value(value: Any) -> str:
    """A TOML scalar: JSON's string escapes are TOML's basic-string escapes."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return str(value)
    return json.dumps(str(value))


def config_text(node: Node, common: dict[str, Any]) -> str:
    lines = [f"# The settings of {node.role} {node.id!r}, written by `splitedge provision`. A relative path is from",
             f"# this file's folder. Start it for run RUN: splitedge {node.role} --config {CONFIG} --run RUN",
             f"# (installed: systemctl enable --now {unit_name(node.role).replace('@.', '@RUN.')}). A flag on the",
             "# command line wins over this file.", "", "[common]"]
    lines += [f"{k} = {toml_value(v)}" for k, v in common.items()]
    lines += ["", f"[{node.role}]"] + [f"{k} = {toml_value(v)}" for k, v in node.settings.items()]
    return "\n".join(lines) + "\n"


def private_folder(path: Path) -> Path:
    """A folder only its owner can read: a bundle holds a private key and a password."""
    path.mkdir(parents=True, exist_ok=True)
    path.chmod(0o700)
    return path


def copy_private(src: Path, dst: Path) -> None:
    """`src` to `dst`, readable by the owner only from the moment it exists."""
    fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as out, open(src, "rb") as inp:
        shutil.copyfileobj(inp, out)
    dst.chmod(0o600)


def write_bundle(folder: Path, node: Node, common: dict[str, Any], keys: Path, logins: Path, home: str,
                 manifest: Path) -> Path:
    """`folder`/<id>: the node's bundle. `keys` holds every node's pair, `logins` every password."""
    bundle = private_folder(folder / node.id)
    copy_private(logins / f"{node.id}.password", bundle / LOGIN)
    copy_private(keys / f"{node.id}.key", bundle / KEY)
    public = bundle / KEYS
    if public.exists():
        shutil.rmtree(public)
    public.mkdir()
    for path in sorted(keys.iterdir()):
        if path.suffix in (".pub", ".role"):
            shutil.copyfile(path, public / path.name)
    if node.shard is not None:
        shutil.copyfile(node.shard, bundle / SHARD)
    if node.role == "edge":
        shutil.copyfile(manifest, bundle / MANIFEST)
    (bundle / CONFIG).write_text(config_text(node, common))
    (bundle / unit_name(node.role)).write_text(unit_text(node.role, home))
    return bundle
