"""Broker credentials for every role: TLS files and a password kept out of the command line.

`deploy/`'s cloud broker asks for mutual TLS, and a password in the broker URL is visible to
anyone who runs `ps`. Each role therefore takes ``--ca-file``, ``--cert-file``, ``--key-file``
and ``--password-file``, each also from an environment variable (a systemd unit's
``Environment=`` or ``EnvironmentFile=``). They are checked before any connection is tried:
a missing file, a certificate without its key, or TLS files for a broker URL that is not
``mqtts://`` are one-line errors. TLS files apply to every ``mqtts://`` URL a role uses (an
edge's ``--broker`` and ``--upstream``); a plain ``mqtt://`` URL ignores them.

The same goes for what a node trusts beyond the broker: ``--sign-key`` (this node's Ed25519
key) and ``--verify-keys`` (a folder of ``<node-id>.pub``) turn on message signatures
(signing.py), and ``--max-frame-bytes`` caps what a receiver parses. All three are checked
here, before any data is read or anything connects.

It also says what a broker URL may be (``PORTS``: ``mqtt://``, ``mqtts://``, ``ssl://``, as
PROTOCOL.md documents; ``tcp://`` or anything else is a one-line error) and keeps passwords out
of sight: every message or log line that shows a broker URL passes it through ``redact_url``.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from splitedge.protocol.codec import DEFAULT_MAX_BYTES

ENV = {
    "ca_file": "SPLITEDGE_CA_FILE",
    "cert_file": "SPLITEDGE_CERT_FILE",
    "key_file": "SPLITEDGE_KEY_FILE",
    "password_file": "SPLITEDGE_PASSWORD_FILE",
}
PORTS = {"mqtt": 1883, "mqtts": 8883, "ssl": 8883}
"""The broker URL schemes PROTOCOL.md documents, with their default ports; others (tcp://) are refused."""
TLS_SCHEMES = ("mqtts://", "ssl://")
SCHEMES_HINT = "mqtt:// (plain, port 1883) or mqtts:// / ssl:// (TLS, port 8883)"
SIGN_ENV = {"sign_key": "SPLITEDGE_SIGN_KEY", "verify_keys": "SPLITEDGE_VERIFY_KEYS"}
MAX_FRAME_ENV = "SPLITEDGE_MAX_FRAME_BYTES"
MIN_FRAME_BYTES = 1024  # below this not even a hello fits


def redact_url(url: str) -> str:
    """`url` with its password (if any) as ``***``: every message and log line that shows a broker
    URL goes through this, since terminals, log files and bug reports are read by others."""
    head, at, tail = url.rpartition("@")  # the last '@': a password may hold an unescaped one
    scheme, sep, login = head.rpartition("://")
    if not at or ":" not in login:
        return url
    return f"{scheme}{sep}{login.split(':', 1)[0]}:***@{tail}"


def check_scheme(url: str) -> str:
    """The URL's scheme, lower case, if it is one we speak; else a one-line ValueError naming them."""
    scheme, sep, _ = url.partition("://")
    if not sep:
        raise ValueError(f"broker URL {redact_url(url)!r} has no scheme: use {SCHEMES_HINT}")
    if scheme.lower() not in PORTS:
        raise ValueError(f"broker URL {redact_url(url)!r}: {scheme}:// is not supported; use {SCHEMES_HINT}")
    return scheme.lower()


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
    s = p.add_argument_group("message signing and limits (each also from its environment variable)")
    s.add_argument("--sign-key", type=Path, default=None, metavar="PEM",
                   help=f"this node's Ed25519 private key: sign every message (`splitedge keys generate`; env "
                        f"{SIGN_ENV['sign_key']})")
    s.add_argument("--verify-keys", type=Path, default=None, metavar="DIR",
                   help=f"folder of <node-id>.pub public keys: refuse messages not signed by their topic's node "
                        f"(needs --sign-key and this node's own .pub; env {SIGN_ENV['verify_keys']})")
    s.add_argument("--max-frame-bytes", type=int, default=None, metavar="N",
                   help=f"refuse received frames longer than N bytes (default {DEFAULT_MAX_BYTES}; env "
                        f"{MAX_FRAME_ENV})")


def _chosen(args: argparse.Namespace, name: str, env: dict[str, str] = ENV) -> Path | None:
    value = getattr(args, name, None)
    if value is None and os.environ.get(env[name]):
        value = Path(os.environ[env[name]])
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
    for url in given:  # an unsupported scheme: one line, before any data is read
        check_scheme(url)
    tls = [name for name in ("ca_file", "cert_file", "key_file") if chosen[name] is not None]
    if tls and not any(u.lower().startswith(TLS_SCHEMES) for u in given):
        raise ValueError(f"{_flag(tls[0])} is for TLS: use an mqtts:// broker URL (got "
                         f"{', '.join(map(redact_url, given))})")
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
    options["max_bytes"] = max_frame_bytes(args)
    options.update(signing_options(args))
    return options


def max_frame_bytes(args: argparse.Namespace) -> int:
    """--max-frame-bytes, else its environment variable, else the codec's default."""
    value: Any = getattr(args, "max_frame_bytes", None)
    where = "--max-frame-bytes"
    if value is None and os.environ.get(MAX_FRAME_ENV):
        value, where = os.environ[MAX_FRAME_ENV].strip(), MAX_FRAME_ENV
        try:
            value = int(value)
        except ValueError:
            raise ValueError(f"{where}={value!r}: not an integer number of bytes") from None
    if value is None:
        return DEFAULT_MAX_BYTES
    if value < MIN_FRAME_BYTES:
        raise ValueError(f"{where} {value}: must be at least {MIN_FRAME_BYTES} bytes (default {DEFAULT_MAX_BYTES})")
    return value


UNSIGNED = ("unsigned: this node signs nothing and verifies nothing, so anyone who can publish on its broker can "
            "speak as any node of the run (the cloud's plans, an edge's models); give --sign-key and --verify-keys "
            "(`splitedge keys generate`, deploy/README.md)")
"""What a role says once at start-up when it runs unsigned (the safe path is the signed one)."""


def unsigned(args: argparse.Namespace) -> bool:
    """Neither --sign-key nor --verify-keys (nor their environment variables) was given."""
    return _chosen(args, "sign_key", SIGN_ENV) is None and _chosen(args, "verify_keys", SIGN_ENV) is None


def signing_options(args: argparse.Namespace) -> dict[str, Any]:
    """`signer` and `keyring` for the transport from --sign-key/--verify-keys, checked against
    each other and this node's --id: ValueError naming the fix."""
    from splitedge.protocol import signing

    key, folder = _chosen(args, "sign_key", SIGN_ENV), _chosen(args, "verify_keys", SIGN_ENV)
    if key is None and folder is None:
        return {}
    if folder is not None and key is None:
        raise ValueError("--verify-keys without --sign-key: peers that verify would refuse this node's unsigned "
                         "messages; give this node's private key with --sign-key")
    signer = signing.load_signer(key)
    if folder is None:
        return {"signer": signer}
    keyring = signing.load_keyring(folder)
    node_id = getattr(args, "id", None)
    if node_id is not None and node_id not in keyring:
        raise ValueError(f"--verify-keys {folder} has no {node_id}.pub: copy this node's own public key there "
                         f"(a node reads its own retained status, and a keyring without it is the wrong folder)")
    if node_id is not None and not keyring.matches(node_id, signer):
        raise ValueError(f"--sign-key {key} is not the private key of {folder / (node_id + '.pub')}: give node "
                         f"{node_id}'s own key, or regenerate both with `splitedge keys generate`")
    return {"signer": signer, "keyring": keyring}
