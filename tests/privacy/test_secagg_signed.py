"""Secure aggregation against an edge that deviates (methods/privacy/identity.py): with the
devices' long-term Ed25519 keys the edge cannot swap a device's keys, and cannot tell some
neighbours of a device that it survived and the others that it dropped, which without them
unmasks that device's input alone (shown first, so the defence is tested against a real attack)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from splitedge.methods.privacy import crypto, fixedpoint, identity, shamir
from splitedge.methods.privacy.secagg import (
    SECRET_BYTES, AdvertiseKeys, ConsistencySignature, Device, KeyRoster, SecAggConfig, SecAggError, Server,
    SignedSurvivors, UnmaskRequest, UnmaskShares, _sign_towards,
)
from splitedge.bench.secagg_cost import identities  # each node's signer, one keyring of every node's key

from secagg_wire import make_inputs, wire


class Signed:
    """n signed devices and their edge (which holds the keyring too), driven round by round."""

    def __init__(self, n: int, config: SecAggConfig, seed: int = 0, signed: bool = True) -> None:
        rng = np.random.default_rng(seed)
        self.n, self.config = n, config
        self.ids = [f"d{i:02d}" for i in range(n)]
        self.who = identities([*self.ids, "e0"]) if signed else {}
        self.devices = {d: Device(d, config, self.who.get(d)) for d in self.ids}
        self.server = Server(config, self.ids, self.who.get("e0"))
        self.inputs = {d: make_inputs(rng) for d in self.ids}

    def to_masking(self) -> dict[str, Any]:
        """Rounds 0 to 2; the devices' masked inputs, not yet given to the edge."""
        for d in self.ids:
            self.server.receive_keys(wire(self.devices[d].advertise_keys()))
        self.whole = whole = wire(self.server.roster())  # closes round 0; SecAgg+ gives each device its own
        rosters = {d: (whole if self.server.graph.complete else self.server.roster(d)) for d in self.ids}
        for d in self.ids:
            self.server.receive_shares(wire(self.devices[d].share_keys(rosters[d])))
        inboxes = {d: wire(m) for d, m in self.server.route_shares().items()}
        return {d: self.devices[d].masked_input(inboxes[d], self.inputs[d]) for d in self.ids}

    def expected(self, devices: list[str]) -> dict[str, np.ndarray]:
        return {name: sum(fixedpoint.encode(name, self.inputs[d][name], self.config.frac_bits, self.n)[0]
                          .view(np.int64) for d in devices) for name in self.inputs[self.ids[0]]}


def test_a_signed_federation_sums_exactly_through_the_consistency_round_with_dropouts():
    # Prepare: 12 devices, SecAgg+; d03 drops before its masked input arrives, d07 after
    fed = Signed(12, SecAggConfig(b"run/1/e0", neighbours=6))
    masked = fed.to_masking()
    for d in fed.ids:
        if d != "d03":
            fed.server.receive_masked(wire(masked[d]))
    request = wire(fed.server.unmask_request())
    # Execute: the consistency round, then unmasking
    with pytest.raises(SecAggError, match="consistency round is still open"):
        fed.server.receive_unmask(UnmaskShares("d00", {}, {}))
    for d in sorted(fed.server.survivors):
        fed.server.receive_signature(wire(fed.devices[d].sign_request(request)))
    signed = wire(fed.server.signed_survivors())
    for d in sorted(fed.server.survivors - {"d07"}):
        fed.server.receive_unmask(wire(fed.devices[d].unmask(request, signed)))
    result = fed.server.finish()
    # Assert
    survivors = [d for d in fed.ids if d != "d03"]
    assert result.devices == tuple(survivors) and result.dropped == ("d03",)
    for name, enc in fed.expected(survivors).items():
        np.testing.assert_array_equal(result.encoded[name], enc)
    # a quorum of signatures goes down (ceil(2/3 * 12) = 8); every signer may reveal
    assert len(signed.signatures) == 8 and fed.server.signers == frozenset(survivors)


def test_the_full_graph_form_signs_too_and_the_roster_carries_every_signature():
    # Prepare
    fed = Signed(6, SecAggConfig(b"run/2/e0"), seed=1)
    masked = fed.to_masking()
    for d in fed.ids:
        fed.server.receive_masked(wire(masked[d]))
    request = wire(fed.server.unmask_request())
    # Execute
    for d in fed.ids:
        fed.server.receive_signature(wire(fed.devices[d].sign_request(request)))
    signed = wire(fed.server.signed_survivors())
    for d in fed.ids:
        fed.server.receive_unmask(wire(fed.devices[d].unmask(request, signed)))
    result = fed.server.finish()
    # Assert
    for name, enc in fed.expected(fed.ids).items():
        np.testing.assert_array_equal(result.encoded[name], enc)
    assert set(fed.whole.signatures) == set(fed.ids) and fed.whole.ids is None


def split_view(fed: Any, victim: str) -> tuple[UnmaskRequest, UnmaskRequest, list[str], list[str]]:
    """An edge's lie: to one half of the others the victim survived, to the other half it dropped."""
    others = [d for d in fed.ids if d != victim]
    told_alive, told_dropped = others[:len(others) // 2], others[len(others) // 2:]
    alive = UnmaskRequest(np.ones(fed.n, bool), np.zeros(fed.n, bool))
    gone = UnmaskRequest(np.array([d != victim for d in fed.ids]), np.array([d == victim for d in fed.ids]))
    return alive, gone, told_alive, told_dropped


def unmask_alone(fed: Any, victim: str, masked: Any, b_shares: dict[int, bytes], s_shares: dict[int, bytes],
                 roster: KeyRoster) -> dict[str, np.ndarray]:
    """What an edge holding t shares of both b_victim and s_victim's key computes: the victim's input."""
    t = fed.server.threshold
    b = shamir.combine(b_shares, t, SECRET_BYTES, "b")
    key = crypto.private_from_bytes(shamir.combine(s_shares, t, SECRET_BYTES, "s"))
    words = np.concatenate([masked.arrays[n].ravel() for n in sorted(masked.arrays)])
    words = words - crypto.prg(b, words.size)
    for w in sorted(set(fed.ids) - {victim}):
        pad = crypto.prg(crypto.mask_seed(key, roster.s_public[w], fed.config.session, victim, w, "w"), words.size)
        words = words - pad if _sign_towards(victim, w) > 0 else words + pad
    out, start = {}, 0
    for n in sorted(masked.arrays):
        size = masked.arrays[n].size
        out[n] = words[start:start + size].view(np.int64).reshape(masked.arrays[n].shape)
        start += size
    return out


def test_without_identities_a_split_view_unmasks_one_device_alone():
    # Prepare: 11 devices (t = 6 of each device's 10 neighbours); the edge follows rounds 0 to 2
    fed = Signed(11, SecAggConfig(b"run/3/e0", threshold=5), seed=2, signed=False)
    masked = fed.to_masking()
    for d in fed.ids:
        fed.server.receive_masked(masked[d])
    alive, gone, told_alive, told_dropped = split_view(fed, "d04")
    x = {d: i + 1 for i, d in enumerate(fed.ids)}
    # Execute: each half answers the request it was given
    b_shares = {x[d]: fed.devices[d].unmask(alive).b_shares["d04"] for d in told_alive}
    s_shares = {x[d]: fed.devices[d].unmask(gone).s_shares["d04"] for d in told_dropped}
    got = unmask_alone(fed, "d04", masked["d04"], b_shares, s_shares, fed.whole)
    # Assert: d04's own fixed-point input, exactly
    for name in fed.inputs["d04"]:
        want = fixedpoint.encode(name, fed.inputs["d04"][name], fed.config.frac_bits, fed.n)[0].view(np.int64)
        np.testing.assert_array_equal(got[name], want)


def test_with_identities_neither_half_of_a_split_view_reaches_the_quorum_so_nobody_reveals():
    # Prepare: the same lie in a signed federation
    fed = Signed(11, SecAggConfig(b"run/4/e0", threshold=5), seed=3)
    masked = fed.to_masking()
    for d in fed.ids:
        fed.server.receive_masked(wire(masked[d]))
    fed.server.unmask_request()
    alive, gone, told_alive, told_dropped = split_view(fed, "d04")
    # Execute: every device signs what it was told; the edge forwards each half's signatures (and
    # the victim's, who was told it survived) to that half
    sigs_alive = {d: fed.devices[d].sign_request(alive).signature for d in [*told_alive, "d04"]}
    sigs_gone = {d: fed.devices[d].sign_request(gone).signature for d in told_dropped}
    # Assert: neither reaches ceil(2/3 * 11) = 8 signatures; a device will not take the other half's
    assert identity.quorum(11, identity.DEFAULT_QUORUM, 5) == 8
    for d in told_alive:
        with pytest.raises(SecAggError, match=r"refused: 6 valid survivor signatures .* quorum 8"):
            fed.devices[d].unmask(alive, SignedSurvivors(sigs_alive))
        with pytest.raises(SecAggError, match="another request than the one it signed"):
            fed.devices[d].unmask(gone, SignedSurvivors({**sigs_alive, **sigs_gone}))
    for d in told_dropped:
        with pytest.raises(SecAggError, match=r"refused: \d valid survivor signatures"):
            fed.devices[d].unmask(gone, SignedSurvivors({**sigs_gone, **sigs_alive}))
    # a device signs one request only
    with pytest.raises(SecAggError, match="out of order"):
        fed.devices[told_alive[0]].sign_request(gone)


def test_an_edge_cannot_swap_a_devices_keys():
    # Prepare
    fed = Signed(6, SecAggConfig(b"run/5/e0"), seed=4)
    for d in fed.ids:
        fed.server.receive_keys(fed.devices[d].advertise_keys())
    roster = fed.server.roster()
    mine = crypto.new_private_key()  # the edge's own key, passed off as d01's
    swapped = KeyRoster({**roster.c_public, "d01": crypto.public_bytes(mine)}, roster.s_public, None,
                        roster.signatures)
    unsigned = KeyRoster(roster.c_public, roster.s_public)
    # Execute / Assert
    with pytest.raises(SecAggError, match="the keys given for d01 are not signed by d01: refused"):
        fed.devices["d00"].share_keys(swapped)
    with pytest.raises(SecAggError, match="roster's keys are unsigned.*--sign-key and --verify-keys"):
        fed.devices["d00"].share_keys(unsigned)
    fed.devices["d00"].share_keys(roster)  # the refusals changed nothing


def test_the_edge_refuses_unsigned_forged_and_unknown_keys_and_bad_consistency_signatures():
    # Prepare
    cfg = SecAggConfig(b"run/6/e0")
    fed = Signed(6, cfg, seed=5)
    keys = {d: fed.devices[d].advertise_keys() for d in fed.ids}
    stranger = identities(["zz"])["zz"]
    server = Server(cfg, [*fed.ids, "zz"], fed.who["e0"])
    # Execute / Assert: round 0
    with pytest.raises(SecAggError, match="keys from d00: unsigned"):
        server.receive_keys(AdvertiseKeys("d00", keys["d00"].c_public, keys["d00"].s_public))
    with pytest.raises(SecAggError, match="keys from d00: a bad signature"):
        server.receive_keys(AdvertiseKeys("d00", keys["d00"].c_public, keys["d00"].s_public, keys["d01"].signature))
    with pytest.raises(SecAggError, match="no public key for zz.*every device's .pub"):
        server.receive_keys(Device("zz", cfg, stranger).advertise_keys())
    # the consistency round: d05 dropped before masking
    fed2 = Signed(6, SecAggConfig(b"run/7/e0"), seed=6)
    m = fed2.to_masking()
    for d in fed2.ids[:5]:
        fed2.server.receive_masked(m[d])
    request = fed2.server.unmask_request()
    s0 = fed2.devices["d00"].sign_request(request)
    with pytest.raises(SecAggError, match="consistency signature from d05: not a survivor"):
        fed2.server.receive_signature(ConsistencySignature("d05", s0.signature))
    with pytest.raises(SecAggError, match="does not verify over this round's request"):
        fed2.server.receive_signature(ConsistencySignature("d01", s0.signature))
    fed2.server.receive_signature(s0)
    with pytest.raises(SecAggError, match="duplicate"):
        fed2.server.receive_signature(s0)
    with pytest.raises(SecAggError, match=r"1 survivors signed the request, fewer than the quorum 4"):
        fed2.server.signed_survivors()
