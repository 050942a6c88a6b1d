"""Secure aggregation of the devices of one edge: the edge learns the sum of their inputs only.

The protocol of Bonawitz et al. 2017 ("Practical Secure Aggregation for Privacy-Preserving
Machine Learning", semi-honest edge; the stack already signs messages, so nothing is signed
here), with the SecAgg+ option of Bell et al. 2020 (each device masks with k neighbours of a
graph instead of all n - 1). Pure state machines, no I/O: the messaging layer carries the
dataclasses of messages.py and calls one method per message.

    round 0  Device.advertise_keys()         -> Server.receive_keys()   ; Server.roster()
    round 1  Device.share_keys(roster)       -> Server.receive_shares() ; Server.route_shares()
    round 2  Device.masked_input(inbox, x)   -> Server.receive_masked() ; Server.unmask_request()
    round 3  Device.unmask(request)          -> Server.receive_unmask() ; Server.finish()

In a signed federation (an ``identity`` on both sides, identity.py) round 0's keys are signed
and checked, and a consistency round comes before round 3:

    round 3a Device.sign_request(request)    -> Server.receive_signature() ; Server.signed_survivors()
    round 3  Device.unmask(request, signed)

Device u sends  y_u = enc(x_u) + PRG(b_u) + sum_{v in N(u) and U2} sign(u, v) PRG(s_uv)  mod 2^64,
sign +1 towards larger ids and -1 towards smaller ones, so each pairwise mask cancels in a sum
over both ends (N(u): u's neighbours; U2: the devices whose shares went out in round 1). The
edge removes PRG(b_u) of every survivor u (b_u rebuilt from t shares) and, for a device v that
dropped after round 1, the masks its surviving neighbours added towards it (s_v's private key
rebuilt from t shares). No device reveals both shares of one peer, so the
edge never holds both masks of anyone. Keys are fresh per Device object: one object, one round.

Threat model: an honest-but-curious edge plus fewer than t colluding devices learn nothing but
the sum. Without identities the edge must also follow the protocol (send every device the same
roster and UnmaskRequest); with them (Bonawitz et al.'s signed keys and consistency round) an
edge that deviates cannot swap keys, and cannot get both shares of one device unless 2q - n of
the n devices sign two conflicting requests (q: the quorum, ceil(2n/3) by default).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

import numpy as np

from . import crypto, fixedpoint, identity, shamir
from .errors import SecAggError
from .graph import Graph, default_threshold, degree
from .identity import Identity
from .messages import (AdvertiseKeys, ConsistencySignature, EncryptedShares, KeyRoster, MaskedInput, ShareInbox,
                       SignedSurvivors, UnmaskRequest, UnmaskShares, check_id)

SECRET_BYTES = 32
SHARE_BYTES = shamir.share_len(SECRET_BYTES)
"""One Shamir share of a 32-byte secret (48 bytes)."""
CIPHERTEXT_BYTES = crypto.NONCE_BYTES + 2 * SHARE_BYTES + crypto.TAG_BYTES
"""nonce + the shares of b_u and of s_u's private key + GCM tag (124 bytes)."""

__all__ = ["SecAggConfig", "SecAggResult", "Device", "Server", "SecAggError", "AdvertiseKeys", "KeyRoster",
           "EncryptedShares", "ShareInbox", "MaskedInput", "UnmaskRequest", "ConsistencySignature",
           "SignedSurvivors", "UnmaskShares"]


@dataclass(frozen=True)
class SecAggConfig:
    """What every party of one aggregation agrees on before it starts (the round announcement).

    ``session`` binds every key, ciphertext, mask and the graph to this aggregation (e.g.
    b"run/round/edge"): never reuse one. ``neighbours``: None for SecAgg (all pairs), an int k or
    "log" (2 * ceil(log2 n)) for SecAgg+. ``threshold``: shares needed to rebuild a secret,
    default floor(k/2) + 1 of a device's k neighbours. ``frac_bits``: fixed-point bits of floats.
    ``min_survivors``: the fewest inputs the sum may hold (distributed DP: the devices whose noise
    adds up to one release's, distributed.py); the server refuses to ask for, and every device to
    reveal, the shares that would unmask a smaller sum. ``quorum``: in a signed federation, the
    share of the roster whose signatures a consistency statement needs (identity.py).
    ``members``: the devices the cloud named for this sum (roster.py; empty: whoever sends keys):
    the roster must be within them, and the threshold and quorum follow from their number, not
    from the roster's, so an edge that leaves devices out of a roster cannot lower either.
    ``min_devices``: the fewest devices a roster may hold; a device refuses a smaller one before
    it sends any share, the server before it asks for them.
    """

    session: bytes
    neighbours: int | str | None = None
    threshold: int | None = None
    frac_bits: int = fixedpoint.FRAC_BITS
    min_survivors: int = 1
    quorum: float = identity.DEFAULT_QUORUM
    members: tuple[str, ...] = ()
    min_devices: int = 2

    def __post_init__(self) -> None:
        if not isinstance(self.session, bytes) or not self.session:
            raise SecAggError("config: session must be non-empty bytes")
        if not 0 <= self.frac_bits <= fixedpoint.MAX_FRAC_BITS:
            raise SecAggError(f"config: frac_bits must be in 0..{fixedpoint.MAX_FRAC_BITS}")
        degree(self.neighbours, 2)  # validates the value
        if self.threshold is not None and (type(self.threshold) is not int or self.threshold < 1):
            raise SecAggError(f"config: threshold must be a positive int, got {self.threshold!r}")
        if type(self.min_survivors) is not int or self.min_survivors < 1:
            raise SecAggError(f"config: min_survivors must be a positive int, got {self.min_survivors!r}")
        identity.check_fraction(self.quorum)
        if type(self.min_devices) is not int or self.min_devices < 2:
            raise SecAggError(f"config: min_devices must be an int >= 2, got {self.min_devices!r}")
        if not isinstance(self.members, tuple) or len(set(self.members)) != len(self.members):
            raise SecAggError("config: members must be a tuple of distinct device ids")

    def base(self, devices: int) -> int:
        """The number the threshold and quorum are computed from: the members the cloud named
        (when it named them), never fewer than the roster's ``devices``."""
        return max(devices, len(self.members))

    def plan(self, devices: int) -> tuple[int, int]:
        """(k, t) for a roster of ``devices``: each device's neighbour count and the threshold
        (of the membership's degree, when the cloud named the members)."""
        if devices < self.min_devices:
            raise SecAggError(f"{devices} devices advertised keys, fewer than the {self.min_devices} a secure sum "
                              f"of this run must hold (secagg_min_devices, dp_devices)")
        k = degree(self.neighbours, devices)
        t = self.threshold if self.threshold is not None else default_threshold(degree(self.neighbours,
                                                                                        self.base(devices)))
        if devices < 2 or t > k:
            fix = (f"needs at least {t + 1} devices" if k == devices - 1 else
                   "raise the neighbour count or lower the threshold")
            raise SecAggError(f"{devices} devices advertised keys: each has {k} neighbours, fewer than the "
                              f"threshold {t}; secure aggregation {fix}")
        return k, t


@dataclass
class SecAggResult:
    """The edge's output: the decoded sums (float64 for float inputs, int64 for int inputs), the
    exact integer sums of the fixed-point encodings, and who is in the sum."""

    sums: dict[str, np.ndarray]
    encoded: dict[str, np.ndarray]  # int64: sum of round(x * 2^scale) over `devices`
    scale_bits: dict[str, int]
    devices: tuple[str, ...]  # U3: whose inputs are summed
    dropped: tuple[str, ...]  # shared keys in round 1 but sent no masked input
    responders: tuple[str, ...]  # U4: sent their shares in round 3


@dataclass
class _Layout:
    """Names, shapes and scale bits of the inputs, in sorted-name order: one flat word vector."""

    shapes: dict[str, tuple[int, ...]]
    scale_bits: dict[str, int]
    size: int = field(init=False)

    def __post_init__(self) -> None:
        self.size = sum(int(np.prod(s, dtype=np.int64)) for s in self.shapes.values())

    def flatten(self, arrays: Mapping[str, np.ndarray]) -> np.ndarray:
        if not self.shapes:
            return np.zeros(0, np.uint64)
        return np.concatenate([np.asarray(arrays[n], dtype=np.uint64).ravel() for n in sorted(self.shapes)])

    def unflatten(self, flat: np.ndarray) -> dict[str, np.ndarray]:
        out, start = {}, 0
        for n in sorted(self.shapes):
            size = int(np.prod(self.shapes[n], dtype=np.int64))
            out[n] = flat[start:start + size].reshape(self.shapes[n])
            start += size
        return out


def _sign_towards(u: str, v: str) -> int:
    """+1 if u adds PRG(s_uv), -1 if it subtracts it: by id order, so the pair cancels."""
    return 1 if u < v else -1


class Device:
    """One device's side of one aggregation; call the four rounds in order, each once (five with
    an ``identity``: sign_request between masked_input and unmask)."""

    def __init__(self, device_id: str, config: SecAggConfig, identity: Identity | None = None) -> None:
        self.id = check_id(device_id, "device")
        self.config = config
        self.identity = identity
        self._signed_digest = b""  # the consistency statement this device signed
        self._c: Any = None  # X25519 private keys, fresh in advertise_keys
        self._s: Any = None
        self._stage = 0
        self._roster: tuple[str, ...] = ()
        self._keys: KeyRoster | None = None
        self._neighbours: frozenset[str] = frozenset()
        self._threshold = 0
        self._b = b""
        self._held: dict[str, tuple[bytes, bytes]] = {}  # sender -> (share of b, share of s key)
        self._c_shared: dict[str, bytes] = {}  # neighbour -> X25519(c) secret: agreed once, used both ways

    def _step(self, stage: int, name: str) -> None:
        """Refuse a call out of order. A step that raises does not advance, so it may be retried
        with corrected input; one that returned never runs again (unmask would reveal twice)."""
        if self._stage != stage:
            raise SecAggError(f"device {self.id}: {name} called out of order (at step {self._stage}, expected {stage})")

    def advertise_keys(self) -> AdvertiseKeys:
        """Round 0: the two fresh public keys."""
        self._step(0, "advertise_keys")
        self._c, self._s = crypto.new_private_key(), crypto.new_private_key()
        self._stage = 1
        c, s = crypto.public_bytes(self._c), crypto.public_bytes(self._s)
        signature = None if self.identity is None else self.identity.sign(
            identity.keys_digest(self.config.session, self.id, c, s))
        return AdvertiseKeys(self.id, c, s, signature)

    def share_keys(self, roster: KeyRoster) -> EncryptedShares:
        """Round 1: draw b_u, Shamir-share b_u and s_u's private key among the neighbours, each
        neighbour's pair of shares encrypted for it alone."""
        self._step(1, "share_keys")
        devices = roster.devices
        if self.config.members:
            strangers = set(devices) - set(self.config.members)
            if strangers:
                raise SecAggError(f"device {self.id}: refused: the roster holds {sorted(strangers)[0]} (and "
                                  f"{len(strangers) - 1} more), not in the membership the cloud named")
        if self.identity is not None:
            wrong = [d for d in devices if self.identity.role(d) != "device"]
            if wrong:
                raise SecAggError(f"device {self.id}: refused: the roster holds {wrong[0]}, whose key is of role "
                                  f"{self.identity.role(wrong[0])}, not a device's")
        if set(roster.s_public) != set(roster.c_public) or not set(roster.c_public) <= set(devices):
            raise SecAggError(f"device {self.id}: the roster's c and s key maps name different devices or ones "
                              f"outside its ids")
        if (roster.c_public.get(self.id), roster.s_public.get(self.id)) != (crypto.public_bytes(self._c),
                                                                             crypto.public_bytes(self._s)):
            raise SecAggError(f"device {self.id}: the roster does not hold this device's own keys")
        keys = [*roster.c_public.values(), *roster.s_public.values()]
        if any(len(k) != crypto.KEY_BYTES for k in keys) or len(set(keys)) != len(keys):
            raise SecAggError(f"device {self.id}: the roster's public keys must be distinct "
                              f"{crypto.KEY_BYTES}-byte keys")
        k, self._threshold = self.config.plan(len(devices))
        self._roster, self._keys = devices, roster
        self._neighbours = Graph(devices, k, self.config.session).of(self.id)
        lacking = self._neighbours - set(roster.c_public)
        if lacking:
            raise SecAggError(f"device {self.id}: the roster lacks the keys of neighbours {sorted(lacking)[:5]}")
        if self.identity is not None:
            self._check_key_signatures(roster)
        xs = {d: i + 1 for i, d in enumerate(devices)}
        order = sorted(self._neighbours)
        self._b = os.urandom(SECRET_BYTES)
        b_shares = shamir.split(self._b, self._threshold, [xs[v] for v in order])
        s_shares = shamir.split(crypto.private_bytes(self._s), self._threshold, [xs[v] for v in order])
        session, out = self.config.session, {}
        for v in order:
            self._c_shared[v] = crypto.agree(self._c, roster.c_public[v], f"{v}'s encryption key")
            key = crypto.share_key(self._c_shared[v], session, self.id, v)
            out[v] = crypto.seal(key, b_shares[xs[v]] + s_shares[xs[v]], crypto.share_aad(session, self.id, v))
        self._stage = 2
        return EncryptedShares(self.id, out)

    def _check_key_signatures(self, roster: KeyRoster) -> None:
        """Every neighbour's keys signed by that neighbour's long-term key: no key of the edge's."""
        assert self.identity is not None
        sigs = roster.signatures
        if sigs is None:
            raise SecAggError(f"device {self.id}: the roster's keys are unsigned, and this device is in a signed "
                              f"federation (its edge needs --sign-key and --verify-keys)")
        identity.require_known(self.identity, sorted(self._neighbours), f"device {self.id}")
        for v in sorted(self._neighbours):
            digest = identity.keys_digest(self.config.session, v, roster.c_public[v], roster.s_public[v])
            if v not in sigs or not self.identity.verify(v, sigs[v], digest):
                raise SecAggError(f"device {self.id}: the keys given for {v} are not signed by {v}: refused")

    def masked_input(self, inbox: ShareInbox, values: Mapping[str, np.ndarray]) -> MaskedInput:
        """Round 2: open the neighbours' shares, then send the inputs encoded in fixed point plus the
        self mask and the pairwise masks towards the neighbours that completed round 1."""
        self._step(2, "masked_input")
        assert self._keys is not None
        if inbox.device != self.id:
            raise SecAggError(f"device {self.id}: got the share inbox of {inbox.device}")
        strangers = set(inbox.ciphertexts) - self._neighbours
        if strangers:
            raise SecAggError(f"device {self.id}: shares from non-neighbours {sorted(strangers)[:5]}")
        if len(inbox.ciphertexts) < self._threshold:
            raise SecAggError(f"device {self.id}: only {len(inbox.ciphertexts)} neighbours completed round 1, fewer "
                              f"than the threshold {self._threshold}: its secrets could not be rebuilt")
        session, held = self.config.session, {}
        for v, blob in sorted(inbox.ciphertexts.items()):
            if len(blob) != CIPHERTEXT_BYTES:
                raise SecAggError(f"device {self.id}: the ciphertext from {v} has {len(blob)} bytes, "
                                  f"expected {CIPHERTEXT_BYTES}")
            key = crypto.share_key(self._c_shared[v], session, v, self.id)
            plain = crypto.open_sealed(key, blob, crypto.share_aad(session, v, self.id),
                                       f"device {self.id}: shares from {v}")
            held[v] = (plain[:SHARE_BYTES], plain[SHARE_BYTES:])
        if not values:
            raise SecAggError(f"device {self.id}: no input arrays to aggregate")
        n, encoded, scale = len(self._roster), {}, {}
        for name in sorted(values):
            if not isinstance(name, str):
                raise SecAggError(f"device {self.id}: input names must be str, got {name!r}")
            encoded[name], scale[name] = fixedpoint.encode(name, values[name], self.config.frac_bits, n)
        layout = _Layout({m: a.shape for m, a in encoded.items()}, scale)
        masked = layout.flatten(encoded) + crypto.prg(self._b, layout.size)
        for v in sorted(held):
            seed = crypto.mask_seed(self._s, self._keys.s_public[v], session, self.id, v, f"{v}'s mask key")
            pad = crypto.prg(seed, layout.size)
            masked = masked + pad if _sign_towards(self.id, v) > 0 else masked - pad
        self._held, self._stage = held, 3
        return MaskedInput(self.id, layout.unflatten(masked), scale)

    def sign_request(self, request: UnmaskRequest) -> ConsistencySignature:
        """Round 3a (with an identity): this device's signature over the request it got, once it
        passes the checks unmask makes; a device signs one request only."""
        self._step(3, "sign_request")
        if self.identity is None:
            raise SecAggError(f"device {self.id}: sign_request needs an identity (a signed federation)")
        self._check_request(request)
        self._signed_digest = identity.consistency_digest(self.config.session, self._roster, request.survivors,
                                                          request.dropped)
        self._stage = 4
        return ConsistencySignature(self.id, self.identity.sign(self._signed_digest))

    def unmask(self, request: UnmaskRequest, signed: SignedSurvivors | None = None) -> UnmaskShares:
        """Round 3: shares of b_v for surviving neighbours, of s_v's key for dropped ones; refuses a
        request that would reveal both of one peer or that contradicts what this device saw, and
        (with an identity) one that is not the request it signed, signed by a quorum of survivors."""
        self._step(3 if self.identity is None else 4, "unmask")
        survivors, dropped = self._check_request(request)
        if self.identity is not None:
            self._check_quorum(request, survivors, signed)
        self._stage = 5
        return UnmaskShares(self.id, {v: b for v, (b, _) in self._held.items() if v in survivors},
                            {v: s for v, (_, s) in self._held.items() if v in dropped})

    def _check_quorum(self, request: UnmaskRequest, survivors: frozenset[str], signed: SignedSurvivors | None) -> None:
        assert self.identity is not None
        digest = identity.consistency_digest(self.config.session, self._roster, request.survivors, request.dropped)
        if digest != self._signed_digest:
            raise SecAggError(f"device {self.id}: refused: asked to unmask for another request than the one it signed")
        need = identity.quorum(self.config.base(len(self._roster)), self.config.quorum, self._threshold)
        sigs = {} if signed is None else signed.signatures
        valid = [v for v, sig in sorted(sigs.items())
                 if v in survivors and self.identity.knows(v) and self.identity.verify(v, sig, digest)]
        if len(valid) < need:
            raise SecAggError(f"device {self.id}: refused: {len(valid)} valid survivor signatures on the request "
                              f"({len(sigs)} given), fewer than the quorum {need} of the roster's {len(self._roster)}")

    def _check_request(self, request: UnmaskRequest) -> tuple[frozenset[str], frozenset[str]]:
        """(survivors, dropped) of a request this device may answer; SecAggError (refused) otherwise."""
        survivors, dropped = request.ids(self._roster)
        both = survivors & dropped
        if both:
            raise SecAggError(f"device {self.id}: refused: asked for both shares of {sorted(both)[:5]} "
                              f"(listed as survivors and dropped)")
        if self.id not in survivors:
            raise SecAggError(f"device {self.id}: refused: not listed as a survivor although it is asked to unmask")
        if len(survivors) < self._threshold:
            raise SecAggError(f"device {self.id}: refused: {len(survivors)} survivors, fewer than the threshold "
                              f"{self._threshold}")
        if len(survivors) < self.config.min_survivors:
            raise SecAggError(f"device {self.id}: refused: {len(survivors)} survivors, fewer than the "
                              f"{self.config.min_survivors} the sum must hold")
        unknown = (survivors | dropped) & (self._neighbours - set(self._held))
        if unknown:
            raise SecAggError(f"device {self.id}: refused: {sorted(unknown)[:5]} listed although they never sent "
                              f"this device their shares")
        unlisted = set(self._held) - survivors - dropped
        if unlisted:
            raise SecAggError(f"device {self.id}: refused: neighbours {sorted(unlisted)[:5]} sent shares but are "
                              f"neither survivors nor dropped")
        return survivors, dropped


class Server:
    """The edge's side of one aggregation. ``receive_*`` take one message each (SecAggError on a
    bad one, which leaves the state unchanged); ``roster``, ``route_shares``, ``unmask_request``
    and ``finish`` close a round with the messages that arrived by then. With an ``identity``
    (a signed federation) it takes signed keys only, and round 3 opens with the consistency
    round: ``receive_signature`` from survivors, closed by ``signed_survivors``."""

    def __init__(self, config: SecAggConfig, devices: Iterable[str] | None = None,
                 identity: Identity | None = None) -> None:
        self.config = config
        self.identity = identity
        self.allowed = None if devices is None else frozenset(devices)
        self.stage = 0
        self._keys: dict[str, AdvertiseKeys] = {}
        self._seen_keys: set[bytes] = set()
        self.devices: tuple[str, ...] = ()  # the roster, U1
        self.k = self.threshold = 0
        self.graph: Graph | None = None
        self._ciphertexts: dict[str, Mapping[str, bytes]] = {}
        self.shared: frozenset[str] = frozenset()  # U2
        self.pruned: tuple[str, ...] = ()  # in U2's messages but left out: too few live neighbours
        self._layout: _Layout | None = None
        self._total: np.ndarray | None = None
        self._masked: set[str] = set()
        self.survivors: frozenset[str] = frozenset()  # U3
        self.dropped: frozenset[str] = frozenset()
        self._b_shares: dict[str, dict[int, bytes]] = {}  # owner -> x -> share
        self._s_shares: dict[str, dict[int, bytes]] = {}
        self._responders: set[str] = set()
        self._x: dict[str, int] = {}
        self.signing = False  # round 3a open: collecting survivors' signatures
        self._consistency: dict[str, bytes] = {}
        self._request_digest = b""
        self.signers: frozenset[str] = frozenset()  # U4: signed the request (signed federations)

    # -- round 0 ---------------------------------------------------------------------------------
    def receive_keys(self, msg: AdvertiseKeys) -> None:
        self._expect(0, "keys")
        d = check_id(msg.device, "keys")
        if self.allowed is not None and d not in self.allowed or self.config.members and d not in self.config.members:
            raise SecAggError(f"keys from {d}: not a device of this aggregation")
        if d in self._keys:
            raise SecAggError(f"keys from {d}: duplicate")
        for name, key in (("c", msg.c_public), ("s", msg.s_public)):
            if not isinstance(key, bytes) or len(key) != crypto.KEY_BYTES:
                raise SecAggError(f"keys from {d}: the {name} key must be {crypto.KEY_BYTES} bytes")
        if msg.c_public == msg.s_public or {msg.c_public, msg.s_public} & self._seen_keys:
            raise SecAggError(f"keys from {d}: a public key repeats (its own other key or another device's)")
        if self.identity is not None:
            identity.require_known(self.identity, [d], f"keys from {d}")
            digest = identity.keys_digest(self.config.session, d, msg.c_public, msg.s_public)
            if msg.signature is None or not self.identity.verify(d, msg.signature, digest):
                raise SecAggError(f"keys from {d}: {'unsigned' if msg.signature is None else 'a bad signature'}, "
                                  f"in a signed federation")
        self._keys[d] = msg
        self._seen_keys |= {msg.c_public, msg.s_public}

    def roster(self, device: str | None = None) -> KeyRoster:
        """Close round 0: the roster of every device whose keys arrived, for all of them, or
        `device`'s: every id, the keys of the device and its neighbours only (SecAgg+)."""
        if self.stage == 0:
            self.devices = tuple(sorted(self._keys))
            self.k, self.threshold = self.config.plan(len(self.devices))
            self.graph = Graph(self.devices, self.k, self.config.session)
            self._x = {d: i + 1 for i, d in enumerate(self.devices)}
            self.stage = 1
        self._expect(1, "roster")
        keys = self._keys if device is None else \
            {d: self._keys[d] for d in sorted(self._neighbours(self._known(device, "roster")) | {device})}
        sigs = None if self.identity is None else {d: m.signature for d, m in keys.items()}
        return KeyRoster({d: m.c_public for d, m in keys.items()}, {d: m.s_public for d, m in keys.items()},
                         None if device is None else self.devices, sigs)

    # -- round 1 ---------------------------------------------------------------------------------
    def receive_shares(self, msg: EncryptedShares) -> None:
        self._expect(1, "shares")
        d = self._known(msg.device, "shares")
        if d in self._ciphertexts:
            raise SecAggError(f"shares from {d}: duplicate")
        want = self._neighbours(d)
        if set(msg.ciphertexts) != want:
            missing, extra = sorted(want - set(msg.ciphertexts)), sorted(set(msg.ciphertexts) - want)
            raise SecAggError(f"shares from {d}: must address exactly its {len(want)} neighbours "
                              f"(missing {missing[:5]}, not neighbours {extra[:5]})")
        bad = [v for v, c in msg.ciphertexts.items() if not isinstance(c, bytes) or len(c) != CIPHERTEXT_BYTES]
        if bad:
            raise SecAggError(f"shares from {d}: ciphertexts for {bad[:5]} are not {CIPHERTEXT_BYTES} bytes")
        self._ciphertexts[d] = dict(msg.ciphertexts)

    def route_shares(self) -> dict[str, ShareInbox]:
        """Close round 1: each device that sent shares gets the ciphertexts its neighbours (that
        also sent) addressed to it. A device with fewer than t such neighbours could never have its
        secrets rebuilt, so it is left out (``pruned``), repeatedly, since leaving one out thins the
        others' neighbourhoods."""
        self._expect(1, "route_shares")
        live = set(self._ciphertexts)
        while True:
            thin = {d for d in live if len(self._neighbours(d) & live) < self.threshold}
            if not thin:
                break
            live -= thin
        if len(live) < self.threshold + 1:
            raise SecAggError(f"round 1: {len(self._ciphertexts)} devices sent their shares, {len(live)} with at "
                              f"least {self.threshold} neighbours that also did; the threshold {self.threshold} "
                              f"needs at least {self.threshold + 1}")
        self.shared = frozenset(live)
        self.pruned = tuple(sorted(set(self._ciphertexts) - live))
        self.stage = 2
        return {v: ShareInbox(v, {u: self._ciphertexts[u][v] for u in sorted(self._neighbours(v) & live)})
                for v in sorted(live)}

    # -- round 2 ---------------------------------------------------------------------------------
    def receive_masked(self, msg: MaskedInput) -> None:
        self._expect(2, "masked input")
        d = self._known(msg.device, "masked input")
        if d not in self.shared:
            raise SecAggError(f"masked input from {d}: it is not among the devices that completed round 1")
        if d in self._masked:
            raise SecAggError(f"masked input from {d}: duplicate")
        if set(msg.arrays) != set(msg.scale_bits):
            raise SecAggError(f"masked input from {d}: arrays and scale bits name different inputs")
        for name, a in msg.arrays.items():
            if not isinstance(a, np.ndarray) or a.dtype != np.uint64:
                raise SecAggError(f"masked input from {d}: {name!r} must be a uint64 array")
            if msg.scale_bits[name] not in (0, self.config.frac_bits):
                raise SecAggError(f"masked input from {d}: {name!r} has scale {msg.scale_bits[name]}, expected 0 "
                                  f"(int) or {self.config.frac_bits} (float)")
        layout = _Layout({n: tuple(a.shape) for n, a in msg.arrays.items()}, dict(msg.scale_bits))
        if self._layout is None:
            if not layout.shapes:
                raise SecAggError(f"masked input from {d}: no arrays")
            self._layout, self._total = layout, np.zeros(layout.size, np.uint64)
        elif (layout.shapes, layout.scale_bits) != (self._layout.shapes, self._layout.scale_bits):
            raise SecAggError(f"masked input from {d}: names, shapes or int/float kinds differ from the first "
                              f"device's ({_describe(self._layout)} vs {_describe(layout)})")
        self._total = self._total + layout.flatten(msg.arrays)
        self._masked.add(d)

    def unmask_request(self) -> UnmaskRequest:
        """Close round 2: survivors (masked input arrived) and dropped (shared, then went silent).
        Raises before anyone reveals a share when the round cannot complete."""
        self._expect(2, "unmask_request")
        t, live = self.threshold, frozenset(self._masked)
        if len(live) < t:
            raise SecAggError(f"round 2: {len(live)} masked inputs arrived, fewer than the threshold {t}: too few "
                              f"survivors to unmask")
        if len(live) < self.config.min_survivors:
            raise SecAggError(f"round 2: {len(live)} masked inputs arrived, fewer than the {self.config.min_survivors} "
                              f"the sum must hold (min_survivors)")
        for u in sorted(live):
            if len(self._neighbours(u) & live) < t:
                raise SecAggError(f"round 2: survivor {u} has {len(self._neighbours(u) & live)} surviving neighbours, "
                                  f"fewer than the threshold {t}: its self mask could not be removed")
        dropped = self.shared - live
        for v in sorted(dropped):
            holders = self._neighbours(v) & live
            if holders and len(holders) < t:
                raise SecAggError(f"round 2: dropped {v} has {len(holders)} surviving neighbours, fewer than the "
                                  f"threshold {t}: its pairwise masks could not be removed")
        if self.identity is not None and len(live) < self._quorum():
            raise SecAggError(f"round 2: {len(live)} masked inputs arrived, fewer than the consistency quorum "
                              f"{self._quorum()} of the roster's {len(self.devices)}")
        self.survivors, self.dropped, self.stage = live, dropped, 3
        request = UnmaskRequest(np.array([d in live for d in self.devices], dtype=bool),
                                np.array([d in dropped for d in self.devices], dtype=bool))
        if self.identity is not None:
            self.signing = True
            self._request_digest = identity.consistency_digest(self.config.session, self.devices, request.survivors,
                                                               request.dropped)
        return request

    # -- round 3a (signed federations) -----------------------------------------------------------
    def _quorum(self) -> int:
        return identity.quorum(self.config.base(len(self.devices)), self.config.quorum, self.threshold)

    def receive_signature(self, msg: ConsistencySignature) -> None:
        """A survivor's signature over the request (checked here too, so one bad signature does
        not reach the others)."""
        self._expect(3, "consistency signature")
        d = self._known(msg.device, "consistency signature")
        if not self.signing or self.identity is None:
            raise SecAggError(f"consistency signature from {d}: no consistency round is open")
        if d not in self.survivors:
            raise SecAggError(f"consistency signature from {d}: not a survivor")
        if d in self._consistency:
            raise SecAggError(f"consistency signature from {d}: duplicate")
        if not self.identity.verify(d, msg.signature, self._request_digest):
            raise SecAggError(f"consistency signature from {d}: does not verify over this round's request")
        self._consistency[d] = msg.signature

    def signed_survivors(self) -> SignedSurvivors:
        """Close round 3a: a quorum of signatures (all were checked here; more would only cost each
        device bytes and checks) for every survivor to check; SecAggError below the quorum."""
        self._expect(3, "signed_survivors")
        if not self.signing:
            raise SecAggError("signed_survivors: no consistency round is open")
        if len(self._consistency) < self._quorum():
            raise SecAggError(f"round 3a: {len(self._consistency)} survivors signed the request, fewer than the "
                              f"quorum {self._quorum()} of the roster's {len(self.devices)}")
        self.signing, self.signers = False, frozenset(self._consistency)
        return SignedSurvivors(dict(sorted(self._consistency.items())[:self._quorum()]))

    # -- round 3 ---------------------------------------------------------------------------------
    def receive_unmask(self, msg: UnmaskShares) -> None:
        self._expect(3, "unmask shares")
        d = self._known(msg.device, "unmask shares")
        if d not in self.survivors:
            raise SecAggError(f"unmask shares from {d}: not a survivor, it was not asked")
        if self.signing:
            raise SecAggError(f"unmask shares from {d}: the consistency round is still open")
        if self.identity is not None and d not in self.signers:
            raise SecAggError(f"unmask shares from {d}: it did not sign the request")
        if d in self._responders:
            raise SecAggError(f"unmask shares from {d}: duplicate")
        both = set(msg.b_shares) & set(msg.s_shares)
        if both:
            raise SecAggError(f"unmask shares from {d}: holds both shares of {sorted(both)[:5]}; refused")
        held = self._neighbours(d) & self.shared
        for name, got, want in (("b", msg.b_shares, held & self.survivors), ("s", msg.s_shares, held & self.dropped)):
            if set(got) != want:
                raise SecAggError(f"unmask shares from {d}: {name} shares for {sorted(set(got))[:5]}..., expected "
                                  f"exactly its neighbours {sorted(want)[:5]}... ({len(want)})")
            bad = [v for v, s in got.items() if not isinstance(s, bytes) or len(s) != SHARE_BYTES]
            if bad:
                raise SecAggError(f"unmask shares from {d}: {name} shares of {bad[:5]} are not {SHARE_BYTES} bytes")
        x = self._x[d]
        for v, s in msg.b_shares.items():
            self._b_shares.setdefault(v, {})[x] = s
        for v, s in msg.s_shares.items():
            self._s_shares.setdefault(v, {})[x] = s
        self._responders.add(d)

    def missing(self) -> list[str]:
        """What ``finish`` still lacks: secrets with fewer than t shares (empty: it can finish)."""
        if self.stage != 3 or self.signing:
            return [f"round {self.stage}{'a' if self.signing else ''} is open"]
        t = self.threshold
        out = [f"b_{u}: {len(self._b_shares.get(u, {}))}/{t} shares" for u in sorted(self.survivors)
               if len(self._b_shares.get(u, {})) < t]
        out += [f"s_{v}: {len(self._s_shares.get(v, {}))}/{t} shares" for v in sorted(self.dropped)
                if self._neighbours(v) & self.survivors and len(self._s_shares.get(v, {})) < t]
        return out

    def finish(self) -> SecAggResult:
        """Rebuild the secrets, remove the masks and decode the sum; SecAggError if any secret has
        fewer than t shares or its shares disagree."""
        self._expect(3, "finish")
        lacking = self.missing()
        if lacking:
            raise SecAggError(f"round 3: cannot unmask, {len(lacking)} secrets lack shares from the "
                              f"{len(self._responders)} responders: {', '.join(lacking[:5])}")
        assert self._layout is not None and self._total is not None
        t, size, total = self.threshold, self._layout.size, self._total.copy()
        for u in sorted(self.survivors):
            b = shamir.combine(self._b_shares[u], t, SECRET_BYTES, f"b_{u}")
            total -= crypto.prg(b, size)
        for v in sorted(self.dropped):
            towards = sorted(self._neighbours(v) & self.survivors)
            if not towards:
                continue
            raw = shamir.combine(self._s_shares[v], t, SECRET_BYTES, f"s_{v}'s private key")
            key = crypto.private_from_bytes(raw)
            if crypto.public_bytes(key) != self._keys[v].s_public:
                raise SecAggError(f"round 3: the private key rebuilt for dropped {v} does not match its public key: "
                                  f"a share is wrong")
            for w in towards:  # w added sign(w, v) * PRG(s_wv): take it out
                pad = crypto.prg(crypto.mask_seed(key, self._keys[w].s_public, self.config.session, v, w,
                                                  f"{w}'s mask key"), size)
                total = total - pad if _sign_towards(w, v) > 0 else total + pad
        self.stage = 4
        encoded = self._layout.unflatten(total)
        scale = self._layout.scale_bits
        return SecAggResult(sums={n: fixedpoint.decode(a, scale[n]) for n, a in encoded.items()},
                            encoded={n: a.view(np.int64).copy() for n, a in encoded.items()}, scale_bits=dict(scale),
                            devices=tuple(sorted(self.survivors)), dropped=tuple(sorted(self.dropped)),
                            responders=tuple(sorted(self._responders)))

    def waiting_for(self) -> frozenset[str]:
        """The devices whose message of the open round has not arrived (what the edge waits for,
        up to its deadline; round 3 may close earlier, as soon as ``missing()`` is empty)."""
        if self.stage == 0:
            return (self.allowed or frozenset()) - set(self._keys)
        if self.stage == 1:
            return frozenset(self.devices) - set(self._ciphertexts)
        if self.stage == 2:
            return self.shared - self._masked
        if self.stage == 3:
            return self.survivors - set(self._consistency) if self.signing else \
                (self.signers if self.identity is not None else self.survivors) - self._responders
        return frozenset()

    # -- helpers ---------------------------------------------------------------------------------
    def _expect(self, stage: int, what: str) -> None:
        if self.stage != stage:
            raise SecAggError(f"{what}: round {stage} is {'closed' if self.stage > stage else 'not open yet'} "
                              f"(the aggregation is at round {self.stage})")

    def _known(self, device: str, what: str) -> str:
        if device not in self._x:
            raise SecAggError(f"{what} from {device!r:.60}: not in the roster")
        return device

    def _neighbours(self, device: str) -> frozenset[str]:
        assert self.graph is not None
        return self.graph.of(device)


def _describe(layout: _Layout) -> str:
    return ", ".join(f"{n}{list(s)}/{'f' if layout.scale_bits[n] else 'i'}" for n, s in sorted(layout.shapes.items()))
