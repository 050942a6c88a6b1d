"""`splitedge keys generate --out DIR NODE...`: the Ed25519 key pairs of a signed federation.

Writes ``DIR/<node>.key`` (the private key, mode 600: it goes to that node only, as its
``--sign-key``) and ``DIR/<node>.pub`` (copied to every node's ``--verify-keys`` folder). The
files are plain PEM, the same as `openssl genpkey -algorithm ed25519` and `openssl pkey -pubout`
write, so an operator may make them either way. With ``--role`` each key also gets
``DIR/<node>.role`` (device, edge or cloud), copied beside its .pub: a secure sum takes only keys
of role device, and a membership signed by a key of role cloud (methods/privacy/roster.py), so
an edge's key cannot pass for a device's. Existing keys are never replaced: a new key
for a running node would lock it out of every receiver still holding the old one.
"""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path

_NODE_ID = re.compile(r"[^/+#\x00@.][^/+#\x00]{0,127}")


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="keys_command", required=True, metavar="ACTION", help="generate: make key pairs")
    g = sub.add_parser("generate", allow_abbrev=False, help="write <node>.key and <node>.pub for each node id",
                       description="write DIR/<node>.key (private, mode 600) and DIR/<node>.pub for each node id")
    g.add_argument("--out", required=True, type=Path, metavar="DIR", help="folder for the key files")
    g.add_argument("--role", choices=("device", "edge", "cloud"), default=None,
                   help="the role of these nodes' keys, written to <node>.role beside each .pub (secure sums need "
                        "it: make each role's keys with one call)")
    g.add_argument("nodes", nargs="+", metavar="NODE", help="node ids (device, edge and cloud ids, e.g. cloud e0 d0)")


def check_nodes(out: Path, nodes: list[str]) -> None:
    """Every id usable as a topic segment and a file name, none twice, no key already there."""
    for node in nodes:
        if _NODE_ID.fullmatch(node) is None:
            raise ValueError(f"{node!r} is not a node id: 1..128 characters, no '/', '+', '#', and not starting "
                             f"with '@' or '.'")
    if len(set(nodes)) != len(nodes):
        raise ValueError(f"node ids given twice: {sorted({n for n in nodes if nodes.count(n) > 1})}")
    taken = [str(out / f"{n}{ext}") for n in nodes for ext in (".key", ".pub") if (out / f"{n}{ext}").exists()]
    if taken:
        raise ValueError(f"{taken[0]} exists: keys are never replaced (a node keeps its key; delete the files "
                         f"first to make new ones)")


def write_key_pair(out: Path, node: str, role: str | None) -> Path:
    """DIR/<node>.key (mode 600, never over an existing file), DIR/<node>.pub and, with a role,
    DIR/<node>.role; the private key's path."""
    from splitedge.protocol.signing import generate_key

    private, public = generate_key()
    key_path = out / f"{node}.key"
    fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(private)
    (out / f"{node}.pub").write_bytes(public)
    if role:
        (out / f"{node}.role").write_text(role + "\n")
    return key_path


def run(args: argparse.Namespace) -> int:
    check_nodes(args.out, args.nodes)
    args.out.mkdir(parents=True, exist_ok=True)
    for node in args.nodes:
        key_path = write_key_pair(args.out, node, getattr(args, "role", None))
        print(f"{node}: {key_path} (private: this node's --sign-key), {args.out / (node + '.pub')}")
    print("copy every .pub into each node's --verify-keys folder; each .key only to its own node")
    return 0
