"""Long-term identities in secure aggregation, against an edge that deviates from the protocol.

Without them an edge that lies (rather than only looks) can learn one device's input: it can
hand a device keys of its own in place of the neighbours' (and open the shares meant for them),
or tell some neighbours of u that u survived (getting shares of b_u) and the others that u
dropped (getting shares of s_u's key), which together unmask u alone. Bonawitz et al. 2017 close
both with signatures under each device's long-term key, the ones a signed federation already has
(protocol/signing.py, `splitedge keys generate`):

- round 0: a device signs its two fresh public keys for this session; every device checks the
  signatures of the keys it is given, so no key can be swapped;
- a consistency round between masking and unmasking: each survivor signs what it was told
  (the roster's ids, who survived, who dropped), the edge forwards the signatures, and a device
  reveals shares only when a quorum of the roster signed that same statement. Two conflicting
  statements cannot both collect a quorum q of n devices unless 2q - n devices signed both: the
  default q = ceil(2n/3) holds against fewer than n/3 devices colluding with the edge.

What is signed is a SHA-512 digest of length-prefixed fields under a domain of its own, so a
signature here can never pass for an envelope signature (protocol/signing.py) or the reverse.
"""

from __future__ import annotations

import hashlib
import math
from typing import Any, Protocol

import numpy as np

from .crypto import label
from .errors import SecAggError

SIGNATURE_BYTES = 64
DEFAULT_QUORUM = 2 / 3
_KEYS = b"splitedge-secagg-keys-v1"
_CONSISTENCY = b"splitedge-secagg-consistency-v1"


class Identity(Protocol):
    """A party's long-term key and the public keys of the others (the federation's keyring)."""

    def sign(self, message: bytes) -> bytes: ...

    def verify(self, node: str, signature: bytes, message: bytes) -> bool: ...

    def knows(self, node: str) -> bool: ...

    def role(self, node: str) -> str | None: ...

    def nodes(self) -> list[str]: ...


class Keyring:
    """An Identity from a node's envelope signer and keyring (protocol/signing.py): the same
    Ed25519 keys, a different domain."""

    def __init__(self, signer: Any, keyring: Any) -> None:
        self.signer, self.keyring = signer, keyring

    def sign(self, message: bytes) -> bytes:
        return self.signer.sign(message)

    def verify(self, node: str, signature: bytes, message: bytes) -> bool:
        return node in self.keyring and self.keyring.verify(node, signature, message)

    def knows(self, node: str) -> bool:
        return node in self.keyring

    def role(self, node: str) -> str | None:
        """The role of `node`'s key ("device", "edge", "cloud"; None: unknown)."""
        return getattr(self.keyring, "role", lambda n: None)(node)

    def nodes(self) -> list[str]:
        return sorted(self.keyring.keys)


def of_transport(transport: Any) -> Keyring | None:
    """The identity of a node whose transport signs and verifies (None: an unsigned federation,
    whose secure sums trust the edge to follow the protocol)."""
    verifier = getattr(transport, "verifier", None)
    signer = getattr(transport, "signer", None)
    return Keyring(signer, verifier.keyring) if signer is not None and verifier is not None else None


def keys_digest(session: bytes, device: str, c_public: bytes, s_public: bytes) -> bytes:
    """What a device signs in round 0: its two fresh keys, for this session."""
    return hashlib.sha512(_KEYS + label(session, device, c_public, s_public)).digest()


def consistency_digest(session: bytes, roster: tuple[str, ...], survivors: np.ndarray, dropped: np.ndarray) -> bytes:
    """What a survivor signs before it unmasks: the roster's ids and the two sets over it."""
    ids = label(*roster)
    return hashlib.sha512(_CONSISTENCY + label(session, ids, np.packbits(survivors).tobytes(),
                                                np.packbits(dropped).tobytes(), len(roster).to_bytes(4, "big"))).digest()


def quorum(devices: int, fraction: float, threshold: int) -> int:
    """Signatures a consistency statement needs: ceil(fraction * roster), at least the threshold."""
    return max(threshold, math.ceil(fraction * devices - 1e-9))


def check_fraction(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.5 < value <= 1:
        raise SecAggError(f"config: quorum must be a fraction in (0.5, 1] of the roster, got {value!r}")
    return float(value)


def require_known(identity: Identity, nodes: list[str], who: str) -> None:
    """SecAggError naming the first device whose public key this party lacks."""
    unknown = [d for d in nodes if not identity.knows(d)]
    if unknown:
        raise SecAggError(f"{who}: no public key for {unknown[0]} (and {len(unknown) - 1} more): a signed "
                          f"federation's secure sums need every device's .pub in every node's --verify-keys")
