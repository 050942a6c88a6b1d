"""Optional per-node Ed25519 signatures, so that a party with broker access (a leaked login, the
broker's operator, a compromised bridge) can neither speak for a node nor replay what it said.

A broker ACL pins each login to its topics, but whoever controls the broker controls every topic.
A signature made with a key only the node holds closes that gap end to end: the bridge and the
broker forward the bytes unchanged and every receiver checks them against the operator's keys.

Carriage (PROTOCOL.md, "Signatures"): a signed payload is the unchanged envelope frame ``E``
followed by one msgpack ext value of type 2, :data:`TRAILER_LEN` bytes, so unsigned federations
are byte-for-byte unchanged and any msgpack reader still finds the envelope as the first object::

    c7 49 02 | flags (1) | seq (8, uint64 LE) | Ed25519 signature (64)

The signature is over ``SHA-512(DOMAIN || flags || seq || u16 LE len(topic) || topic || E)``,
so it binds the exact frame bytes (which hold the run, round, kind, sender and message id), the
topic it was published on and a per-sender sequence number. Hashing first lets a 64 MiB frame
be hashed in place instead of copied into one message.

Replay: ``seq`` starts at the sender's wall clock in microseconds and only grows, so a
restarted sender is never locked out (its clock has moved on), and a receiver refuses a frame
whose seq is below the last it accepted on that topic. A last will is signed when the node
connects but fired later, after newer frames on the same status topic, so wills (flag bit 0)
have a window of their own. A byte-exact copy of the newest frame on a topic is what the
broker itself re-sends (a QoS 1 retry, a retained message after a reconnect): it is a
duplicate, dropped, unless the topic was just subscribed again, which reopens it once.

``cryptography`` is imported only when a key is loaded or made: the wire layer must import in
the thin device install, where signing is an extra (``pip install 'splitedge[sign]'``).
"""

from __future__ import annotations

import hashlib
import struct
import threading
import time
from pathlib import Path
from typing import Any

from splitedge.protocol.errors import ProtocolError
from splitedge.protocol.topics import matches, parse

__all__ = ["TRAILER_LEN", "EXT_SIGNATURE", "Signer", "KeyRing", "Verifier", "signed_digest",
           "split_trailer", "generate_key", "load_signer", "load_keyring", "INSTALL_HINT"]

EXT_SIGNATURE = 2
DOMAIN = b"splitedge-sig-1\x00"
FLAG_WILL = 0x01
_SIG_LEN = 64
_BODY_LEN = 1 + 8 + _SIG_LEN
_MARKER = bytes([0xC7, _BODY_LEN, EXT_SIGNATURE])  # msgpack ext8, 73 bytes, type 2
TRAILER_LEN = len(_MARKER) + _BODY_LEN  # 76
INSTALL_HINT = "pip install 'splitedge[sign]'"


def _ed25519() -> Any:
    """The cryptography module, or a ModuleNotFoundError that names the install line."""
    try:
        from cryptography.hazmat.primitives.asymmetric import ed25519
    except ModuleNotFoundError:
        raise ModuleNotFoundError(f"message signing needs the cryptography package: {INSTALL_HINT}",
                                  name="cryptography") from None
    return ed25519


def _serialization() -> Any:
    _ed25519()
    from cryptography.hazmat.primitives import serialization

    return serialization


def signed_digest(topic: str, flags: int, seq: int, frame: bytes | memoryview) -> bytes:
    """The 64 bytes a node signs: everything a receiver must be sure of, hashed in one pass."""
    raw_topic = topic.encode()
    h = hashlib.sha512(DOMAIN)
    h.update(struct.pack("<BQH", flags, seq, len(raw_topic)))
    h.update(raw_topic)
    h.update(frame)
    return h.digest()


def split_trailer(payload: bytes | memoryview) -> tuple[memoryview, int, int, bytes] | None:
    """(frame, flags, seq, signature) when ``payload`` ends in a signature trailer, else None.

    Found by its fixed length and ext header, without parsing the frame: a verifying receiver
    needs the sender's key before it spends anything on a frame."""
    view = memoryview(payload)
    if len(view) <= TRAILER_LEN or bytes(view[-TRAILER_LEN:-_BODY_LEN]) != _MARKER:
        return None
    flags, seq = struct.unpack("<BQ", view[-_BODY_LEN:-_SIG_LEN])
    return view[:-TRAILER_LEN], flags, seq, bytes(view[-_SIG_LEN:])


def _now_us() -> int:
    return time.time_ns() // 1000


class Signer:
    """This node's private key and its sequence counter (thread-safe: an edge's two transports
    and paho's network thread may sign at once)."""

    def __init__(self, private_key: Any) -> None:
        self._key = private_key
        self._seq = 0
        self._lock = threading.Lock()

    def public_bytes(self) -> bytes:
        serialization = _serialization()
        return self._key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)

    def sign(self, message: bytes) -> bytes:
        """A raw Ed25519 signature of ``message`` (for protocols that carry their own, under a
        domain of their own: methods/privacy/identity.py)."""
        return self._key.sign(message)

    def next_seq(self) -> int:
        """Strictly increasing, and never below the wall clock in microseconds, so a restarted
        process continues above whatever its previous incarnation signed."""
        with self._lock:
            self._seq = max(self._seq + 1, _now_us())
            return self._seq

    def seal(self, topic: str, frame: bytes, *, will: bool = False) -> bytes:
        """``frame`` with its signature trailer for ``topic``."""
        flags, seq = (FLAG_WILL if will else 0), self.next_seq()
        signature = self._key.sign(signed_digest(topic, flags, seq, frame))
        return b"".join((frame, _MARKER, struct.pack("<BQ", flags, seq), signature))


ROLES = ("device", "edge", "cloud")


class KeyRing:
    """The public keys a receiver trusts, by node id (the id in a topic names the signer), and
    each key's role when known (``roles``: node id -> "device", "edge" or "cloud"). A secure sum
    takes only keys of role "device" and a membership signed by a key of role "cloud"
    (methods/privacy/roster.py): an edge's key cannot pass for a device's."""

    def __init__(self, keys: dict[str, Any], roles: dict[str, str] | None = None) -> None:
        self.keys = dict(keys)
        self.roles = {n: r for n, r in (roles or {}).items() if n in self.keys}
        bad = {r for r in self.roles.values() if r not in ROLES}
        if bad:
            raise ValueError(f"key roles must be one of {', '.join(ROLES)}, got {sorted(bad)[0]!r}")

    def __contains__(self, node_id: str) -> bool:
        return node_id in self.keys

    def role(self, node_id: str) -> str | None:
        """The role of ``node_id``'s key (None: not given, or no such key)."""
        return self.roles.get(node_id)

    def matches(self, node_id: str, signer: Signer) -> bool:
        """Whether ``signer`` holds the private half of ``node_id``'s public key."""
        serialization = _serialization()
        mine = self.keys[node_id].public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        return mine == signer.public_bytes()

    def verify(self, node_id: str, signature: bytes, digest: bytes) -> bool:
        from cryptography.exceptions import InvalidSignature

        try:
            self.keys[node_id].verify(signature, digest)
        except InvalidSignature:
            return False
        return True


class Verifier:
    """One receiver's check of signed frames: key, signature and replay window per topic.

    Each transport has its own (its subscriptions decide which copies are redeliveries); the
    keys may be shared."""

    def __init__(self, keyring: KeyRing) -> None:
        self.keyring = keyring
        self._last: dict[tuple[str, bool], int] = {}  # (topic, is will) -> newest accepted seq
        self._reopened: set[tuple[str, bool]] = set()
        self._lock = threading.Lock()

    def open(self, topic: str, payload: bytes | memoryview) -> memoryview | None:
        """The frame inside a verified ``payload``, or None for a copy of the newest frame on its
        topic (a duplicate). ProtocolError ``sig.*`` for anything that must be refused."""
        try:
            signer = parse(topic).node_id
        except ProtocolError:
            raise ProtocolError("sig.unknown_key", "the topic names no splitedge node, so no key") from None
        parts = split_trailer(payload)
        if parts is None:
            raise ProtocolError("sig.missing", f"no signature trailer from {signer!r}")
        frame, flags, seq, signature = parts
        if signer not in self.keyring:
            raise ProtocolError("sig.unknown_key", f"no public key for {signer!r} (add {signer}.pub to --verify-keys)")
        if not self.keyring.verify(signer, signature, signed_digest(topic, flags, seq, frame)):
            raise ProtocolError("sig.bad", f"signature does not verify with {signer!r}'s key")
        return frame if self._advance((topic, bool(flags & FLAG_WILL)), seq) else None

    def _advance(self, key: tuple[str, bool], seq: int) -> bool:
        with self._lock:
            last = self._last.get(key, -1)
            if seq > last:
                self._last[key] = seq
                self._reopened.discard(key)
                return True
            if seq == last and key in self._reopened:
                self._reopened.discard(key)
                return True
            if seq == last:
                return False
        raise ProtocolError("sig.replay", f"seq {seq} is older than {last}, the newest accepted on this topic")

    def reopen(self, pattern: str) -> None:
        """A new subscription to ``pattern``: the broker sends its retained messages again, and
        the newest frame of each matching topic may come through once more."""
        with self._lock:
            self._reopened.update(k for k in self._last if matches(pattern, k[0]))


# -- key files -------------------------------------------------------------------------------
def generate_key() -> tuple[bytes, bytes]:
    """(private PEM, public PEM) of a new Ed25519 key: PKCS#8 and SubjectPublicKeyInfo, the
    formats `openssl genpkey -algorithm ed25519` and `openssl pkey -pubout` write."""
    ed25519, serialization = _ed25519(), _serialization()
    key = ed25519.Ed25519PrivateKey.generate()
    private = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    public = key.public_key().public_bytes(serialization.Encoding.PEM,
                                           serialization.PublicFormat.SubjectPublicKeyInfo)
    return private, public


def _read(path: Path, what: str) -> bytes:
    if not path.is_file():
        raise ValueError(f"{what} {path}: no such file")
    return path.read_bytes()


def load_signer(path: Path, flag: str = "--sign-key") -> Signer:
    """This node's private key from a PEM file; ValueError naming the fix for anything else."""
    ed25519, serialization = _ed25519(), _serialization()
    data = _read(path, flag)
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError):
        raise ValueError(f"{flag} {path}: not an unencrypted PEM private key; make one with "
                         f"`splitedge keys generate`") from None
    if not isinstance(key, ed25519.Ed25519PrivateKey):
        kind = type(key).__name__.lstrip("_").replace("PrivateKey", "")
        raise ValueError(f"{flag} {path}: an {kind} key, not Ed25519; make one with `splitedge keys generate`")
    return Signer(key)


def load_public_key(path: Path) -> Any:
    ed25519, serialization = _ed25519(), _serialization()
    try:
        key = serialization.load_pem_public_key(_read(path, "public key"))
    except (ValueError, TypeError):
        raise ValueError(f"{path}: not a PEM public key; write it with `splitedge keys generate` or "
                         f"`openssl pkey -pubout`") from None
    if not isinstance(key, ed25519.Ed25519PublicKey):
        raise ValueError(f"{path}: not an Ed25519 public key")
    return key


def load_keyring(folder: Path, flag: str = "--verify-keys") -> KeyRing:
    """Every ``<node-id>.pub`` in ``folder``, each with the role its ``<node-id>.role`` names
    (one word: device, edge or cloud; `splitedge keys generate --role`); ValueError when there
    is no key or one is bad."""
    if not folder.is_dir():
        raise ValueError(f"{flag} {folder}: no such directory")
    files = sorted(folder.glob("*.pub"))
    if not files:
        raise ValueError(f"{flag} {folder}: no <node-id>.pub files in it")
    roles = {}
    for f in files:
        role_file = f.with_suffix(".role")
        if role_file.is_file():
            role = role_file.read_text().strip()
            if role not in ROLES:
                raise ValueError(f"{flag} {role_file}: the role must be one of {', '.join(ROLES)}, got {role!r}")
            roles[f.stem] = role
    return KeyRing({f.stem: load_public_key(f) for f in files}, roles)
