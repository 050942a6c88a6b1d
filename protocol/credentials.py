"""Broker credentials for every role: TLS files and a password kept out of the command line.

`deploy/`'s cloud broker asks for mutual TLS, and a password in the broker URL is visible to
anyone who runs `ps`. Each role therefore takes ``--ca-file``, ``--cert-file``, ``--key-file``
and ``--password-file``, each also from an environment variable (a systemd unit's
``Environment=`` or ``EnvironmentFile=``). They are checked before any connection is tried:
a missing file, a certificate without its key, or TLS files for a broker URL that is not
``mqtts://`` are one-line errors. TLS files apply to every ``mqtts://`` URL a role uses (an
edge's ``--broker`` and ``--upstream``); a plain ``mqtt://`` URL ignores them.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

ENV = {
    "ca_file": "SPLITEDGE_CA_FILE",
    "cert_file": "SPLITEDGE_CERT_FILE",
    "key_file": "SPLITEDGE_KEY_FILE",
    "password_file": "SPLITEDGE_PASSWORD_FILE",
}
TLS_SCHEMES = ("mqtts://", "ssl://")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The credential flags, in their own help group."""
    g = p.add_argument_group("broker credentials (each also from its environment variable)")
    g.add_argument("--ca-file", type=Path, default=None, metavar="PEM",
                   help=f"CA certificate(s) that signed the broker's certificate, for mqtts:// (default: the "
                        f"system's CA store; env {ENV['ca_file']})")
    g.add_argument("--cert-file", type=Path, default=None, metavar="PEM",
                   help=f"this node's client certificate, for brokers that require one (mutual TLS; env "
                        f"{ENV['cert_file']})")
    g.add_argument("--key-file", type=Path, default=None, metavar="PEM",
                   help=f"the private key of --cert-file (env {ENV['key_file']})")
    g.add_argument("--password-file", type=Path, default=None, metavar="FILE",
                   help=f"read the broker password from the first line of FILE instead of the URL, where `ps` "
                        f"shows it (the user name stays in the URL: mqtt://name@host; env {ENV['password_file']})")


def _chosen(args: argparse.Namespace, name: str) -> Path | None:
    value = getattr(args, name, None)
    if value is None and os.environ.get(ENV[name]):
        value = Path(os.environ[ENV[name]])
    return value


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def connect_options(args: argparse.Namespace, *urls: str | None) -> dict[str, Any]:
    """Keyword arguments for `connect()` from the flags (or their environment variables),
    checked: ValueError naming the flag and what to do."""
    chosen = {name: _chosen(args, name) for name in ENV}
    for name, path in chosen.items():
        if path is not None and not path.is_file():
            raise ValueError(f"{_flag(name)} {path}: no such file")
    if (chosen["cert_file"] is None) != (chosen["key_file"] is None):
        raise ValueError("--cert-file and --key-file go together: give both (a client certificate and its key) "
                         "or neither")
    given = [u for u in urls if u]
    tls = [name for name in ("ca_file", "cert_file", "key_file") if chosen[name] is not None]
    if tls and not any(u.lower().startswith(TLS_SCHEMES) for u in given):
        raise ValueError(f"{_flag(tls[0])} is for TLS: use an mqtts:// broker URL (got {', '.join(given)})")
    options: dict[str, Any] = {}
    if chosen["ca_file"] is not None:
        options["ca_certs"] = str(chosen["ca_file"])
    if chosen["cert_file"] is not None:
        options["certfile"], options["keyfile"] = str(chosen["cert_file"]), str(chosen["key_file"])
    if chosen["password_file"] is not None:
        lines = chosen["password_file"].read_text().splitlines()
        password = lines[0].strip() if lines else ""
        if not password:
            raise ValueError(f"--password-file {chosen['password_file']}: the first line is empty")
        users = [u.split("://", 1)[-1].split("@", 1)[0] for u in given if "@" in u]
        if not users:
            raise ValueError("--password-file needs the user name in the broker URL: mqtt://NAME@host:port")
        if any(":" in user for user in users):
            raise ValueError("the broker URL already holds a password: drop it from the URL or drop --password-file")
        options["password"] = password
    return options
