"""The Ed25519 keys of a signed simulation (`splitedge sim --sign`): every node signs what it
sends and checks what it receives, as in a federation set up with `splitedge keys generate`.

Each key is derived from the run id and the node id, so worker processes (and workers on other
hosts) make the same keys without a file to share. Anyone who knows the run id can derive them:
a signed sim measures what signing costs and exercises what it changes (secure sums take their
authenticated form, runtime/secure_sum.py); it protects nothing. Real deployments use
`splitedge keys generate` and --sign-key / --verify-keys.
"""

from __future__ import annotations

import hashlib
from typing import Any

_DOMAIN = b"splitedge-sim-key-v1"


def _private(run: str, node_id: str) -> Any:
    from cryptography.hazmat.primitives.asymmetric import ed25519

    seed = hashlib.sha256(_DOMAIN + len(run).to_bytes(4, "big") + run.encode() + node_id.encode()).digest()
    return ed25519.Ed25519PrivateKey.from_private_bytes(seed)


class SimKeys:
    """Every node's key of one simulated run, and the keyring all of them share."""

    def __init__(self, run: str, edges: int, devices: int) -> None:
        from splitedge.protocol.signing import KeyRing

        self.run = run
        nodes = ["cloud", *(f"e{e}" for e in range(edges)), *(f"d{d}" for d in range(devices))]
        roles = {n: "cloud" if n == "cloud" else "edge" if n.startswith("e") else "device" for n in nodes}
        self.keyring = KeyRing({n: _private(run, n).public_key() for n in nodes}, roles)

    def options(self, node_id: str) -> dict[str, Any]:
        """The transport options of `node_id`: its signer and the shared keyring."""
        from splitedge.protocol.signing import Signer

        return {"signer": Signer(_private(self.run, node_id)), "keyring": self.keyring}
