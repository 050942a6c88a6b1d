"""Per-node broker logins: a random password for every node id and the Mosquitto
`password_file` that checks them, so no two nodes share a login and no password is typed.

The file uses Mosquitto 2's `$7$` format (PBKDF2-HMAC-SHA512, 101 iterations, 12-byte salt,
exactly what `mosquitto_passwd` writes), so it is made without the Mosquitto tools. Each
node's password goes in its own file (mode 600) for `--password-file`; copy each to its node
only, like its shard.
"""

from __future__ import annotations

import base64
import hashlib
import os
import secrets
from pathlib import Path
from typing import Iterable

ITERATIONS = 101
PASSWD = "broker.passwd"
LOGINS = "logins"


def hash_password(password: str, *, salt: bytes | None = None, iterations: int = ITERATIONS) -> str:
    """A Mosquitto `$7$` password hash of `password`."""
    salt = os.urandom(12) if salt is None else salt
    digest = hashlib.pbkdf2_hmac("sha512", password.encode(), salt, iterations)
    return f"$7${iterations}${base64.b64encode(salt).decode()}${base64.b64encode(digest).decode()}"


def write_logins(folder: Path, users: Iterable[str], *, probes: Iterable[str] = ()) -> dict[str, Path]:
    """Write `folder/broker.passwd` (every user) and `folder/logins/<user>.password` (one
    fresh random password each, readable by the owner only); returns user -> password file.
    An existing password file of a user is kept (re-running a split does not lock nodes out).

    Each user in `probes` also gets its probe login (acl.probe_login, ``<user>.probe``) in
    broker.passwd, with the user's own password: the node's start-up check reads its own status
    with it, from the one password file the node already has. The broker reads broker.passwd as
    its own user: `chown mosquitto:` it (the broker.conf beside it says so)."""
    from splitedge.protocol.acl import probe_login

    with_probe = set(probes)
    folder = Path(folder)
    (folder / LOGINS).mkdir(parents=True, exist_ok=True)
    files, lines = {}, []
    for user in users:
        path = folder / LOGINS / f"{user}.password"
        if path.exists():
            password = path.read_text().strip()
        else:
            password = secrets.token_urlsafe(18)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as fh:
                fh.write(password + "\n")
        files[user] = path
        lines.append(f"{user}:{hash_password(password)}")
        if user in with_probe:
            lines.append(f"{probe_login(user)}:{hash_password(password)}")
    tmp = folder / f".{PASSWD}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write("\n".join(lines) + "\n")
    os.replace(tmp, folder / PASSWD)
    return files
