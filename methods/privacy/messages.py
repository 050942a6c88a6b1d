"""The messages of secure aggregation as plain dataclasses, and their bodies for the wire.

A body holds only str keys, bytes, ints and numpy arrays, which the project's msgpack codec
carries (protocol/arrays.py); uint64 words travel as int64 (the wire whitelist has no u8) and
sets of devices as bool arrays over the sorted roster (a msgpack list is capped at 1,024 items,
a roster is not). ``from_body`` trusts nothing: every type and length is checked and a bad body
raises SecAggError naming the field. The messaging layer must also check that a body's
``device`` is the envelope's (signed) sender.

Rounds and directions (kinds are suggestions for the wiring)::

    0  device -> edge   AdvertiseKeys   secagg_keys
       edge -> devices  KeyRoster       secagg_roster
    1  device -> edge   EncryptedShares secagg_shares
       edge -> device   ShareInbox      secagg_inbox
    2  device -> edge   MaskedInput     secagg_masked
       edge -> devices  UnmaskRequest   secagg_unmask
   (3a, signed federations: the consistency round of identity.py)
       device -> edge   ConsistencySignature  secagg_signed
       edge -> devices  SignedSurvivors       secagg_signatures
    3  device -> edge   UnmaskShares    secagg_reveal
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Mapping

import numpy as np

from .crypto import KEY_BYTES
from .errors import SecAggError
from .identity import SIGNATURE_BYTES

MAX_ID_LEN = 128


def _field(body: Mapping[str, Any], key: str, kind: str) -> Any:
    if not isinstance(body, Mapping):
        raise SecAggError(f"{kind}: body must be a map, got {type(body).__name__}")
    if key not in body:
        raise SecAggError(f"{kind}: body has no {key!r}")
    return body[key]


def check_id(value: Any, what: str) -> str:
    if not isinstance(value, str) or not 0 < len(value) <= MAX_ID_LEN:
        raise SecAggError(f"{what}: a device id must be a str of 1..{MAX_ID_LEN} chars, got {value!r:.60}")
    return value


def _bytes(value: Any, what: str, length: int | None = None) -> bytes:
    if isinstance(value, (bytearray, memoryview)):
        value = bytes(value)
    if not isinstance(value, bytes):
        raise SecAggError(f"{what}: expected bytes, got {type(value).__name__}")
    if length is not None and len(value) != length:
        raise SecAggError(f"{what}: expected {length} bytes, got {len(value)}")
    return value


def _id_bytes(value: Any, what: str, length: int | None = None) -> dict[str, bytes]:
    """A map device id -> bytes (msgpack keeps a map's keys unique, so a duplicate cannot get through)."""
    if not isinstance(value, Mapping):
        raise SecAggError(f"{what}: expected a map of device id -> bytes, got {type(value).__name__}")
    return {check_id(k, what): _bytes(v, f"{what}[{k}]", length) for k, v in value.items()}


def _device_set(value: Any, what: str) -> np.ndarray:
    arr = np.asarray(value)
    if not isinstance(value, np.ndarray) or arr.dtype != np.bool_ or arr.ndim != 1:
        raise SecAggError(f"{what}: expected a 1-d bool array over the roster")
    return arr


def _signature(body: Mapping[str, Any], what: str) -> bytes | None:
    """The optional `sig` of a body (signed federations, identity.py)."""
    return _bytes(body["sig"], f"{what}.sig", SIGNATURE_BYTES) if "sig" in body else None


@dataclass(frozen=True)
class AdvertiseKeys:
    """Round 0, device -> edge: the public halves of the device's two fresh X25519 key pairs,
    c (encrypts the shares sent to it) and s (agrees its pairwise masks); in a signed federation
    with the device's long-term signature over both (identity.keys_digest)."""

    KIND: ClassVar[str] = "secagg_keys"
    device: str
    c_public: bytes
    s_public: bytes
    signature: bytes | None = None

    def to_body(self) -> dict[str, Any]:
        body = {"device": self.device, "c": self.c_public, "s": self.s_public}
        return body if self.signature is None else {**body, "sig": self.signature}

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> AdvertiseKeys:
        k = cls.KIND
        return cls(check_id(_field(body, "device", k), k), _bytes(_field(body, "c", k), f"{k}.c", KEY_BYTES),
                   _bytes(_field(body, "s", k), f"{k}.s", KEY_BYTES), _signature(body, k))


@dataclass(frozen=True)
class KeyRoster:
    """Edge -> devices after round 0: the public keys of the devices that advertised in time.
    Its sorted ids are the roster: share x-coordinates (index + 1), the graph and the bool
    arrays of UnmaskRequest all refer to that order.

    Two forms. The whole roster (``ids`` None): every device's keys, one message for all, as
    SecAgg's complete graph needs. A device's roster (``ids`` given, SecAgg+): every id with its
    x-coordinate, but the keys of the device and its neighbours only; at 1,000 devices that is
    about 10 kB for each device instead of 80 kB (a device derives its neighbours from the ids
    and the session, so it can check that the keys it got are theirs). In a signed federation
    ``signatures`` holds each listed device's signature over its keys, which devices check."""

    KIND: ClassVar[str] = "secagg_roster"
    c_public: Mapping[str, bytes]
    s_public: Mapping[str, bytes]
    ids: tuple[str, ...] | None = None
    signatures: Mapping[str, bytes] | None = None

    @property
    def devices(self) -> tuple[str, ...]:
        return self.ids if self.ids is not None else tuple(sorted(self.c_public))

    def to_body(self) -> dict[str, Any]:
        body: dict[str, Any] = {"c": dict(self.c_public), "s": dict(self.s_public)}
        if self.ids is not None:
            body["ids"] = {d: i + 1 for i, d in enumerate(self.ids)}
        if self.signatures is not None:
            body["sig"] = dict(self.signatures)
        return body

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> KeyRoster:
        k = cls.KIND
        c = _id_bytes(_field(body, "c", k), f"{k}.c", KEY_BYTES)
        s = _id_bytes(_field(body, "s", k), f"{k}.s", KEY_BYTES)
        if set(c) != set(s):
            raise SecAggError(f"{k}: the c and s key maps name different devices")
        ids = _roster_ids(body["ids"], f"{k}.ids") if "ids" in body else None  # _field checked it is a map
        if ids is not None and not set(c) <= set(ids):
            raise SecAggError(f"{k}: keys of devices not in its ids: {sorted(set(c) - set(ids))[:5]}")
        sigs = _id_bytes(body["sig"], f"{k}.sig", SIGNATURE_BYTES) if "sig" in body else None
        if sigs is not None and set(sigs) != set(c):
            raise SecAggError(f"{k}: the signatures and the keys name different devices")
        return cls(c, s, ids, sigs)


def _roster_ids(value: Any, what: str) -> tuple[str, ...]:
    """A map device id -> x-coordinate that must be 1..n in the ids' sorted order."""
    if not isinstance(value, Mapping) or not value:
        raise SecAggError(f"{what}: expected a non-empty map of device id -> x-coordinate")
    ids = tuple(sorted(check_id(d, what) for d in value))
    if [value[d] for d in ids] != list(range(1, len(ids) + 1)) or any(type(value[d]) is not int for d in ids):
        raise SecAggError(f"{what}: the x-coordinates must be 1..{len(ids)} in the ids' sorted order")
    return ids


@dataclass(frozen=True)
class EncryptedShares:
    """Round 1, device -> edge: for each neighbour, AES-GCM(its shares of b_u and of s_u's
    private key), which only that neighbour can open; the edge only routes them."""

    KIND: ClassVar[str] = "secagg_shares"
    device: str
    ciphertexts: Mapping[str, bytes]  # recipient -> ciphertext

    def to_body(self) -> dict[str, Any]:
        return {"device": self.device, "ct": dict(self.ciphertexts)}

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> EncryptedShares:
        k = cls.KIND
        return cls(check_id(_field(body, "device", k), k), _id_bytes(_field(body, "ct", k), f"{k}.ct"))


@dataclass(frozen=True)
class ShareInbox:
    """Edge -> one device after round 1: the ciphertexts its neighbours addressed to it. Its
    senders are the neighbours that completed round 1, the only ones the device masks with."""

    KIND: ClassVar[str] = "secagg_inbox"
    device: str
    ciphertexts: Mapping[str, bytes]  # sender -> ciphertext

    def to_body(self) -> dict[str, Any]:
        return {"device": self.device, "ct": dict(self.ciphertexts)}

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> ShareInbox:
        k = cls.KIND
        return cls(check_id(_field(body, "device", k), k), _id_bytes(_field(body, "ct", k), f"{k}.ct"))


@dataclass(frozen=True)
class MaskedInput:
    """Round 2, device -> edge: each named input as uint64 words (fixed-point encoding + self mask
    + pairwise masks, mod 2^64) and its scale bits (the fixed-point f for floats, 0 for ints)."""

    KIND: ClassVar[str] = "secagg_masked"
    device: str
    arrays: Mapping[str, np.ndarray]  # uint64
    scale_bits: Mapping[str, int]

    def to_body(self) -> dict[str, Any]:
        # reshape: np.ascontiguousarray makes a 0-d array (a BatchNorm batch counter) 1-d
        words = {n: np.ascontiguousarray(a).view(np.int64).reshape(np.shape(a)) for n, a in self.arrays.items()}
        return {"device": self.device, "arrays": words, "scale": dict(self.scale_bits)}

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> MaskedInput:
        k = cls.KIND
        arrays, scale = _field(body, "arrays", k), _field(body, "scale", k)
        if not isinstance(arrays, Mapping) or not isinstance(scale, Mapping) or set(arrays) != set(scale):
            raise SecAggError(f"{k}: 'arrays' and 'scale' must be maps over the same names")
        out = {}
        for name, a in arrays.items():
            if not isinstance(name, str) or not isinstance(a, np.ndarray) or a.dtype != np.int64:
                raise SecAggError(f"{k}.arrays[{name!r:.60}]: expected an int64 array (the uint64 words)")
            if type(scale[name]) is not int:
                raise SecAggError(f"{k}.scale[{name!r:.60}]: expected an int")
            out[name] = a.view(np.uint64)
        return cls(check_id(_field(body, "device", k), k), out, dict(scale))


@dataclass(frozen=True)
class UnmaskRequest:
    """Edge -> surviving devices after round 2: who is in the sum (``survivors``, U3: masked
    input arrived) and who dropped after round 1 (``dropped``): bool arrays over the sorted roster."""

    KIND: ClassVar[str] = "secagg_unmask"
    survivors: np.ndarray
    dropped: np.ndarray

    def ids(self, roster: tuple[str, ...]) -> tuple[frozenset[str], frozenset[str]]:
        """(survivors, dropped) as sets of ids; SecAggError if an array does not match the roster."""
        for name, arr in (("survivors", self.survivors), ("dropped", self.dropped)):
            if arr.dtype != np.bool_ or arr.shape != (len(roster),):
                raise SecAggError(f"{self.KIND}.{name}: expected a bool array of the roster's {len(roster)} "
                                  f"devices, got {arr.dtype} {arr.shape}")
        return (frozenset(d for d, on in zip(roster, self.survivors) if on),
                frozenset(d for d, on in zip(roster, self.dropped) if on))

    def to_body(self) -> dict[str, Any]:
        return {"survivors": self.survivors, "dropped": self.dropped}

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> UnmaskRequest:
        k = cls.KIND
        return cls(_device_set(_field(body, "survivors", k), f"{k}.survivors"),
                   _device_set(_field(body, "dropped", k), f"{k}.dropped"))


@dataclass(frozen=True)
class ConsistencySignature:
    """Round 3a (signed federations), device -> edge: the device's signature over the
    UnmaskRequest it got (identity.consistency_digest)."""

    KIND: ClassVar[str] = "secagg_signed"
    device: str
    signature: bytes

    def to_body(self) -> dict[str, Any]:
        return {"device": self.device, "sig": self.signature}

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> ConsistencySignature:
        k = cls.KIND
        return cls(check_id(_field(body, "device", k), k), _bytes(_field(body, "sig", k), f"{k}.sig", SIGNATURE_BYTES))


@dataclass(frozen=True)
class SignedSurvivors:
    """Edge -> surviving devices after round 3a: the survivors' signatures over the request, a
    quorum of which a device checks before it reveals anything."""

    KIND: ClassVar[str] = "secagg_signatures"
    signatures: Mapping[str, bytes]

    def to_body(self) -> dict[str, Any]:
        return {"sig": dict(self.signatures)}

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> SignedSurvivors:
        k = cls.KIND
        return cls(_id_bytes(_field(body, "sig", k), f"{k}.sig", SIGNATURE_BYTES))


@dataclass(frozen=True)
class UnmaskShares:
    """Round 3, device -> edge: its shares of b_v for surviving neighbours v and of s_v's private
    key for dropped neighbours v; never both for one v."""

    KIND: ClassVar[str] = "secagg_reveal"
    device: str
    b_shares: Mapping[str, bytes]
    s_shares: Mapping[str, bytes]

    def to_body(self) -> dict[str, Any]:
        return {"device": self.device, "b": dict(self.b_shares), "s": dict(self.s_shares)}

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> UnmaskShares:
        k = cls.KIND
        return cls(check_id(_field(body, "device", k), k), _id_bytes(_field(body, "b", k), f"{k}.b"),
                   _id_bytes(_field(body, "s", k), f"{k}.s"))
