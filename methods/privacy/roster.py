"""Who a secure sum may be over, decided by the cloud, and what one device value may be summed into.

An edge runs its devices' secure sums, so an edge that lies (rather than only looks) could pick
their membership: tell one device that the roster is {that device, the edge itself} and the
threshold falls to 1, which makes a share the secret (issue 53). Three checks close that, each
made by the device BEFORE it sends any secret (its shares in round 1):

- **membership**: the cloud names, per edge, the devices of each round's secure sums and signs
  that statement (`sign_members`, under a domain of its own, with the cloud's Ed25519 key); the
  edge relays it inside the round plan (`directives[ROSTER]`) and cannot change it. A device
  checks the cloud's signature (`verify_members`: a key of role "cloud" in its keyring,
  protocol/signing.py), that it is a member, that the roster it is given is a subset of the
  membership (a member whose keys never arrived is a dropout), and the threshold and signature
  quorum follow from the membership's size, not the roster's (secagg.SecAggConfig.members);
- **roles**: every id of the roster and of the membership is a device's: in a signed federation
  its key has role "device" in the device's keyring; in any run no id is its edge's or another
  edge named by the plan;
- **size**: the membership and the roster hold at least `minimum` devices: the run's
  `secagg_min_devices` (default 3) and `dp_devices`, whichever is larger, and the value the
  cloud signed.

And one check against differencing: a device contributes one value (the exact arrays it masks:
statistics of one W_c version, one round's update) to at most one secure sum, or to a second
only over the same member set (`Contributions`): a resend over another set is refused before
the device reveals anything, so the difference of two sums never isolates a device. Under DP a
resend is computed afresh with fresh noise: another value, so it passes, and another release,
counted in the device's `dp_releases` like the first (tests/privacy/test_dp_resend.py).

An unsigned federation cannot authenticate the cloud: its edge can rewrite the membership and
make up keys for devices that do not exist, so there only the size, role (no edge id) and
difference checks hold, against an edge that follows the protocol (docs/privacy.md).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from .labels import label
from .errors import SecAggError

ROSTER = "secagg_members"
"""The round plan's directive that carries the cloud's signed membership."""
MIN_DEVICES = 3
"""The default `secagg_min_devices`: the fewest devices any secure sum may be over."""
DEVICE, EDGE, CLOUD = "device", "edge", "cloud"
ROLES = (DEVICE, EDGE, CLOUD)
_DOMAIN = b"splitedge-secagg-members-v1"
_SEP = "\x00"  # no node id holds it (protocol/topics.py): one string per edge, however many devices


def minimum(cfg: Any) -> int:
    """The fewest devices a secure sum of this run may be over: `secagg_min_devices` and
    `dp_devices`, whichever is larger (never below 2: the protocol needs a pair)."""
    return max(2, int(getattr(cfg, "secagg_min_devices", MIN_DEVICES)), int(getattr(cfg, "dp_devices", 1)))


def encode_members(members: Mapping[str, Iterable[str]]) -> dict[str, str]:
    """edge -> its devices as one string (a msgpack list is capped at 1,024 items; an edge is not)."""
    return {e: _SEP.join(sorted(set(ds))) for e, ds in sorted(members.items())}


def decode_members(wire: Any) -> dict[str, tuple[str, ...]]:
    if not isinstance(wire, Mapping) or not all(isinstance(e, str) and isinstance(v, str) for e, v in wire.items()):
        raise SecAggError("the round plan's membership must map each edge to a string of device ids")
    return {e: tuple(sorted(v.split(_SEP))) if v else () for e, v in wire.items()}


def config_digest(config: Any) -> str:
    """The run's config as the plan carries it (a nested map of plain values), hashed in a form
    that survives the wire (sorted keys; a tuple and a list alike)."""
    def plain(v: Any) -> Any:
        if isinstance(v, np.ndarray):
            return {"$array": v.dtype.str, "v": v.tolist()}
        if isinstance(v, np.generic):
            return v.item()
        if isinstance(v, (bytes, bytearray, memoryview)):
            return {"$bytes": bytes(v).hex()}
        raise TypeError(f"{type(v).__name__} in the run's config")

    return hashlib.sha256(json.dumps(config, sort_keys=True, separators=(",", ":"), default=plain,
                                     allow_nan=True).encode()).hexdigest()


def members_digest(run: str, session: str, attempt: int, round_: int, phase: str, mode: str, least: int,
                   members: Mapping[str, Iterable[str]], config: str = "") -> bytes:
    """What the cloud signs: the round it is for, the secure-sum mode, the minimum size, the
    run's config (its `config_digest`: an edge that relays the plan cannot change a device's
    settings, its DP noise among them) and every edge's devices (sorted), length-prefixed under a
    domain of its own."""
    parts: list[str] = [run, session, str(int(attempt)), str(int(round_)), phase, mode, str(int(least)), config]
    for edge, devices in sorted(members.items()):
        ids = sorted(set(devices))
        parts += [edge, str(len(ids)), *ids]
    return hashlib.sha512(_DOMAIN + label(*parts)).digest()


def directive(run: str, plan: Any, mode: str, least: int, members: Mapping[str, Iterable[str]],
              signer: Any = None) -> dict[str, Any]:
    """The plan's ROSTER directive: the membership, the minimum, and (with the cloud's `signer`)
    its signature in hex."""
    members = {e: tuple(sorted(set(ds))) for e, ds in members.items()}
    out: dict[str, Any] = {"members": encode_members(members), "min": int(least), "mode": mode}
    if signer is not None:
        digest = members_digest(run, plan.session, plan.attempt, plan.round, plan.phase, mode, least, members,
                                config_digest(plan.config))
        out["sig"] = signer.sign(digest).hex()
    return out


class Membership:
    """The membership a device reads off its round plan (not yet checked: `check`)."""

    def __init__(self, members: Mapping[str, tuple[str, ...]], least: int, mode: str, sig: bytes | None) -> None:
        self.members, self.least, self.mode, self.sig = dict(members), least, mode, sig

    @classmethod
    def of_plan(cls, plan: Any) -> Membership | None:
        raw = (plan.directives or {}).get(ROSTER)
        if raw is None:
            return None
        if not isinstance(raw, Mapping) or not isinstance(raw.get("min"), int) or not isinstance(raw.get("mode"), str):
            raise SecAggError("the round plan's secure-sum membership is malformed")
        sig = raw.get("sig")
        try:
            sig = None if sig is None else bytes.fromhex(sig)
        except (TypeError, ValueError):
            raise SecAggError("the round plan's membership signature is not hex") from None
        return cls(decode_members(raw.get("members")), int(raw["min"]), raw["mode"], sig)

    def of(self, edge: str) -> tuple[str, ...]:
        return self.members.get(edge, ())

    def verify(self, identity: Any, run: str, plan: Any) -> str:
        """The id of the cloud whose key signed this membership for `plan`; SecAggError when no
        key of role "cloud" in the device's keyring did (the edge relays the plan, and re-signs
        its envelope: only this signature is the cloud's)."""
        if self.sig is None:
            raise SecAggError("the round plan's secure-sum membership is unsigned, and this device is in a signed "
                              "federation: its cloud must sign it (--sign-key)")
        try:
            config = config_digest(plan.config)
        except (TypeError, ValueError) as exc:
            raise SecAggError(f"the round plan's config cannot be checked: {exc}") from None
        digest = members_digest(run, plan.session, plan.attempt, plan.round, plan.phase, self.mode, self.least,
                                self.members, config)
        clouds = [n for n in identity.nodes() if identity.role(n) == CLOUD]
        if not clouds:
            raise SecAggError("this device's keyring holds no key of role cloud, so it cannot check the membership "
                              "the edge relays: give the cloud's key its role (splitedge keys generate --role cloud)")
        for cloud in clouds:
            if identity.verify(cloud, self.sig, digest):
                return cloud
        raise SecAggError(f"the round plan's secure-sum membership is not signed by the cloud "
                          f"({', '.join(clouds[:3])}): the edge changed it, or the run's config beside it")


def check_members(me: str, edge: str, devices: Iterable[str], least: int, *, identity: Any = None,
                  not_devices: Iterable[str] = ()) -> tuple[str, ...]:
    """A set of ids this device may sum with (`devices`: the membership or the roster it got):
    it holds this device, at least `least` ids, no id of `not_devices` or of this device's edge,
    and (with an `identity`) only ids whose key has role "device". SecAggError otherwise."""
    ids = tuple(sorted(set(devices)))
    if me not in ids:
        raise SecAggError(f"device {me}: refused: it is not in the secure sum's devices")
    others = ({edge} | set(not_devices)) & set(ids)
    if others:
        raise SecAggError(f"device {me}: refused: the secure sum's devices hold {sorted(others)[0]}, not a device "
                          f"(the edge itself would hold a share)")
    if identity is not None:
        for d in ids:
            role = identity.role(d)
            if role != DEVICE:
                raise SecAggError(f"device {me}: refused: the secure sum's devices hold {d}, whose key is "
                                  f"{'not in this keyring' if not identity.knows(d) else f'of role {role}'}"
                                  f"{'' if role is not None or not identity.knows(d) else ' (none given)'}, "
                                  f"not a device's")
    if len(ids) < least:
        raise SecAggError(f"device {me}: refused: the secure sum is over {len(ids)} devices, fewer than the "
                          f"{least} this run requires (secagg_min_devices, dp_devices)")
    return ids


def check_roster(me: str, roster: Iterable[str], members: Iterable[str]) -> None:
    """The roster the edge sent (the devices whose keys arrived) within the signed membership."""
    strangers = set(roster) - set(members)
    if strangers:
        raise SecAggError(f"device {me}: refused: the roster holds {sorted(strangers)[0]} (and "
                          f"{len(strangers) - 1} more), not in the membership the cloud signed")


# -- differencing -----------------------------------------------------------------------------

def value_digest(name: str, meta: Mapping[str, Any], values: Mapping[str, np.ndarray]) -> bytes:
    """The identity of one value a device sums: what it is of and its exact arrays."""
    h = hashlib.sha256(label(name, repr(sorted((k, repr(v)) for k, v in meta.items() if k != "dp"))))
    for key in sorted(values):
        a = np.ascontiguousarray(values[key])
        h.update(label(key, a.dtype.str, repr(a.shape)))
        h.update(a.tobytes())
    return h.digest()


def _set_digest(ids: Iterable[str]) -> bytes:
    return hashlib.sha256(label(*sorted(ids))).digest()


class Contributions:
    """One device's ledger: each value it revealed into a secure sum, and the devices that sum
    was over (their digest; the ids themselves for the latest sums, for the early check). A
    value goes into a second sum only over the same set."""

    MAX = 4096  # values remembered (oldest forgotten first): 64 bytes each, a round adds a few
    KEEP_IDS = 16  # the latest sums whose ids are kept too (a roster may hold thousands)

    def __init__(self) -> None:
        self.sums: dict[bytes, tuple[bytes, int]] = {}  # value -> (digest of its sum's devices, their number)
        self.ids: dict[bytes, frozenset[str]] = {}

    def before_keys(self, me: str, value: bytes, members: Iterable[str]) -> None:
        """Refuse at once a sum whose devices cannot include the earlier sum's (when its ids are
        still kept; `before_reveal` decides in any case)."""
        earlier = self.ids.get(value)
        if earlier is not None and not earlier <= set(members):
            missing = sorted(earlier - set(members))
            raise SecAggError(f"device {me}: refused: this value went into a secure sum over {len(earlier)} devices "
                              f"already, and this one cannot hold {missing[0]} (and {len(missing) - 1} more): the "
                              f"difference of the two sums would isolate them")

    def before_reveal(self, me: str, value: bytes, survivors: Iterable[str]) -> None:
        """Record the sum's survivors, or refuse a second sum of the value over another set."""
        now = frozenset(survivors)
        earlier = self.sums.get(value)
        if earlier is not None and earlier[0] != _set_digest(now):
            raise SecAggError(f"device {me}: refused: this value went into a secure sum over {earlier[1]} devices "
                              f"already, and this one is over another set of {len(now)}: the difference of the two "
                              f"sums would isolate the devices in one and not the other")
        self.sums[value] = (_set_digest(now), len(now))
        self.ids[value] = now
        while len(self.sums) > self.MAX:
            self.sums.pop(next(iter(self.sums)))
        while len(self.ids) > self.KEEP_IDS:
            self.ids.pop(next(iter(self.ids)))
