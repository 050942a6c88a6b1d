"""Secure aggregation (methods/privacy): the edge gets exactly the sum of the fixed-point
encodings, through dropouts before and after masking, and refuses every bad piece with a clear
error instead of a wrong sum. Every message crosses msgpack with the project's array ext type."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass, field

import msgpack
import numpy as np
import pytest

from secagg_wire import make_inputs, wire
from splitedge.methods.privacy import crypto, fixedpoint, shamir
from splitedge.methods.privacy.secagg import (
    AdvertiseKeys, Device, EncryptedShares, KeyRoster, MaskedInput, SecAggConfig, SecAggError, Server, ShareInbox,
    UnmaskRequest, UnmaskShares,
)

F = fixedpoint.FRAC_BITS


@dataclass
class Federation:
    """n devices and their edge, driven round by round."""

    n: int
    config: SecAggConfig
    seed: int = 0
    ids: list[str] = field(init=False)
    devices: dict[str, Device] = field(init=False)
    server: Server = field(init=False)
    inputs: dict[str, dict[str, np.ndarray]] = field(init=False)

    def __post_init__(self) -> None:
        rng = np.random.default_rng(self.seed)
        self.ids = [f"d{i:02d}" for i in range(self.n)]
        self.devices = {d: Device(d, self.config) for d in self.ids}
        self.server = Server(self.config, self.ids)
        self.inputs = {d: make_inputs(rng) for d in self.ids}

    def keys(self) -> KeyRoster:
        for d in self.ids:
            self.server.receive_keys(wire(self.devices[d].advertise_keys()))
        return wire(self.server.roster())

    def shares(self, roster: KeyRoster, silent: set[str] = frozenset()) -> dict[str, ShareInbox]:
        for d in self.ids:
            msg = self.devices[d].share_keys(roster)
            if d not in silent:
                self.server.receive_shares(wire(msg))
        return {d: wire(m) for d, m in self.server.route_shares().items()}

    def masked(self, inboxes: dict[str, ShareInbox], silent: set[str] = frozenset()) -> UnmaskRequest:
        for d in sorted(inboxes):
            msg = self.devices[d].masked_input(inboxes[d], self.inputs[d])
            if d not in silent:
                self.server.receive_masked(wire(msg))
        return wire(self.server.unmask_request())

    def unmask(self, request: UnmaskRequest, silent: set[str] = frozenset()) -> None:
        for d in sorted(self.server.survivors - silent):
            self.server.receive_unmask(wire(self.devices[d].unmask(request)))

    def run(self, before: set[str] = frozenset(), after: set[str] = frozenset()):
        """The whole aggregation; ``before`` drop before their masked input arrives, ``after`` once it did."""
        request = self.masked(self.shares(self.keys()), silent=before)
        self.unmask(request, silent=after)
        return self.server.finish()

    def expected(self, devices: list[str]) -> dict[str, np.ndarray]:
        """The exact int64 sum of the fixed-point encodings of ``devices``' inputs."""
        out = {}
        for name in self.inputs[self.ids[0]]:
            out[name] = sum(fixedpoint.encode(name, self.inputs[d][name], self.config.frac_bits, self.n)[0]
                            .view(np.int64) for d in devices)
        return out


def assert_exact(fed: Federation, result, devices: list[str]) -> None:
    assert result.devices == tuple(sorted(devices))
    expected = fed.expected(devices)
    for name, enc in expected.items():
        np.testing.assert_array_equal(result.encoded[name], enc)
    # ints (and bools) exactly, floats exactly the encodings' sum * 2^-f, within n * 2^-(f+1) of the true sum
    np.testing.assert_array_equal(result.sums["count"], sum(fed.inputs[d]["count"] for d in devices))
    np.testing.assert_array_equal(result.sums["flag"], sum(fed.inputs[d]["flag"].astype(int) for d in devices))
    assert result.sums["count"].dtype == np.int64
    for name in ("sum", "sumsq"):
        np.testing.assert_array_equal(result.sums[name], expected[name].astype(np.float64) * 2.0**-F)
        true = sum(fed.inputs[d][name].astype(np.float64) for d in devices)
        assert np.max(np.abs(result.sums[name] - true)) <= len(devices) * 2.0**-(F + 1)


def test_ten_devices_sum_exactly():
    # Prepare
    fed = Federation(10, SecAggConfig(b"run/1/e0"))
    # Execute
    result = fed.run()
    # Assert
    assert_exact(fed, result, fed.ids)
    assert fed.server.k == 9 and fed.server.threshold == 5 and result.dropped == ()


def test_two_of_ten_drop_before_their_masked_input_arrives_the_other_eight_sum_exactly():
    # Prepare
    fed = Federation(10, SecAggConfig(b"run/2/e0"), seed=1)
    gone = {"d03", "d07"}
    # Execute
    result = fed.run(before=gone)
    # Assert: their pairwise masks were rebuilt from their s keys and removed
    assert_exact(fed, result, [d for d in fed.ids if d not in gone])
    assert result.dropped == ("d03", "d07") and len(result.responders) == 8


def test_two_of_ten_leave_after_masking_their_inputs_stay_in_the_sum_the_other_eight_unmask_it():
    # Prepare
    fed = Federation(10, SecAggConfig(b"run/3/e0"), seed=2)
    # Execute
    result = fed.run(after={"d00", "d09"})
    # Assert
    assert_exact(fed, result, fed.ids)
    assert result.dropped == () and result.responders == tuple(d for d in fed.ids if d not in {"d00", "d09"})


@pytest.mark.parametrize("neighbours", [4, 6, "log"])
def test_secagg_plus_with_k_neighbours_gives_the_same_exact_sum(neighbours):
    # Prepare
    fed = Federation(20, SecAggConfig(b"run/4/e0", neighbours=neighbours), seed=3)
    # Execute
    roster = fed.keys()
    sent = [fed.devices[d].share_keys(roster) for d in fed.ids]
    for msg in sent:
        fed.server.receive_shares(msg)
    request = fed.masked({d: wire(m) for d, m in fed.server.route_shares().items()})
    fed.unmask(request)
    result = fed.server.finish()
    # Assert
    k = {4: 4, 6: 6, "log": 10}[neighbours]
    assert fed.server.k == k and fed.server.threshold == k // 2 + 1
    assert all(len(m.ciphertexts) == k for m in sent)
    assert_exact(fed, result, fed.ids)


def test_secagg_plus_sends_each_device_its_own_roster_and_the_sum_stays_exact():
    """A device's roster (every id, the keys of the device and its k neighbours) is all SecAgg+
    needs: the sum is the same, at a fraction of the whole roster's bytes."""
    fed = Federation(40, SecAggConfig(b"run/4b/e0", neighbours="log"), seed=5)
    for d in fed.ids:
        fed.server.receive_keys(wire(fed.devices[d].advertise_keys()))
    whole = fed.server.roster()
    own = {d: wire(fed.server.roster(d)) for d in fed.ids}
    for d in fed.ids:
        assert own[d].devices == whole.devices and set(own[d].c_public) == fed.server.graph.of(d) | {d}
        fed.server.receive_shares(wire(fed.devices[d].share_keys(own[d])))
    fed.unmask(fed.masked({d: wire(m) for d, m in fed.server.route_shares().items()}))
    assert_exact(fed, fed.server.finish(), fed.ids)
    size = len(msgpack.packb(own["d00"].to_body(), use_bin_type=True))
    assert size < len(msgpack.packb(whole.to_body(), use_bin_type=True)) / 2  # 12 of 39 peers' keys


def test_a_device_roster_without_a_neighbours_keys_or_with_bad_ids_is_refused():
    fed = Federation(12, SecAggConfig(b"run/4c/e0", neighbours=4), seed=6)
    for d in fed.ids:
        fed.server.receive_keys(wire(fed.devices[d].advertise_keys()))
    fed.server.roster()
    mine = fed.server.roster("d00")
    gone = sorted(fed.server.graph.of("d00"))[0]
    short = KeyRoster({d: k for d, k in mine.c_public.items() if d != gone},
                      {d: k for d, k in mine.s_public.items() if d != gone}, mine.ids)
    with pytest.raises(SecAggError, match=f"lacks the keys of neighbours \\['{gone}'\\]"):
        fed.devices["d00"].share_keys(wire(short))
    body = mine.to_body()
    for ids, why in (({**body["ids"], "d01": 7}, "x-coordinates must be 1..12"),
                     ({d: i + 1 for i, d in enumerate(x for x in mine.ids if x != gone)}, "keys of devices not in"),
                     ({}, "non-empty map")):
        with pytest.raises(SecAggError, match=why):
            KeyRoster.from_body({**body, "ids": ids})
    fed.devices["d00"].share_keys(wire(mine))  # refusals changed nothing: the right roster still works


def test_secagg_plus_survives_dropouts_on_both_sides_of_masking():
    # Prepare
    fed = Federation(20, SecAggConfig(b"run/5/e0", neighbours=8), seed=4)
    # Execute
    result = fed.run(before={"d02", "d11"}, after={"d05"})
    # Assert
    assert_exact(fed, result, [d for d in fed.ids if d not in {"d02", "d11"}])


def test_too_few_survivors_is_a_clear_error_before_anyone_reveals_a_share():
    # Prepare: t = 5 of 10; only 4 masked inputs arrive
    fed = Federation(10, SecAggConfig(b"run/6/e0"))
    inboxes = fed.shares(fed.keys())
    for d in fed.ids[:4]:
        fed.server.receive_masked(fed.devices[d].masked_input(inboxes[d], fed.inputs[d]))
    # Execute / Assert
    with pytest.raises(SecAggError, match="4 masked inputs arrived, fewer than the threshold 5"):
        fed.server.unmask_request()


def test_too_few_unmask_replies_is_a_clear_error_not_a_wrong_sum():
    # Prepare: all 10 masked, only 4 answer the unmask request (t = 5)
    fed = Federation(10, SecAggConfig(b"run/7/e0"))
    request = fed.masked(fed.shares(fed.keys()))
    fed.unmask(request, silent=set(fed.ids[4:]))
    # Execute / Assert
    assert fed.server.missing()
    with pytest.raises(SecAggError, match=r"cannot unmask.*b_d\d\d: 3/5 shares"):
        fed.server.finish()


def test_too_few_devices_for_the_threshold_is_refused_at_the_roster():
    # Prepare
    server = Server(SecAggConfig(b"run/8/e0", threshold=4))
    for d in ("a", "b", "c"):
        server.receive_keys(Device(d, server.config).advertise_keys())
    # Execute / Assert
    with pytest.raises(SecAggError, match="fewer than the threshold 4"):
        server.roster()


@pytest.mark.parametrize("how", ["flip", "swap-recipient", "other-session"])
def test_a_tampered_or_misrouted_ciphertext_is_rejected(how):
    # Prepare
    fed = Federation(6, SecAggConfig(b"run/9/e0"))
    inboxes = fed.shares(fed.keys())
    ct = dict(inboxes["d00"].ciphertexts)
    if how == "flip":
        blob = bytearray(ct["d01"])
        blob[40] ^= 1
        ct["d01"] = bytes(blob)
    elif how == "swap-recipient":  # d01's ciphertext for d02, handed to d00
        ct["d01"] = fed.server._ciphertexts["d01"]["d02"]
    else:  # the same pair's ciphertext from another aggregation
        other = Federation(6, SecAggConfig(b"run/9/e1"))
        ct["d01"] = other.shares(other.keys())["d00"].ciphertexts["d01"]
    # Execute / Assert
    with pytest.raises(SecAggError, match="shares from d01: the ciphertext failed authentication"):
        fed.devices["d00"].masked_input(ShareInbox("d00", ct), fed.inputs["d00"])


def test_a_device_refuses_to_reveal_both_shares_of_one_peer():
    # Prepare
    fed = Federation(6, SecAggConfig(b"run/10/e0"))
    request = fed.masked(fed.shares(fed.keys()))
    both = request.dropped.copy()
    both[1] = True  # d01 listed as survivor and dropped
    # Execute / Assert
    with pytest.raises(SecAggError, match=r"refused: asked for both shares of \['d01'\]"):
        fed.devices["d00"].unmask(UnmaskRequest(request.survivors, both))
    reply = fed.devices["d00"].unmask(request)  # a refused request revealed nothing; the right one works once
    with pytest.raises(SecAggError, match="out of order"):
        fed.devices["d00"].unmask(request)
    # the edge refuses a reply carrying both shares of one peer
    bad = UnmaskShares("d00", reply.b_shares, {"d01": reply.b_shares["d01"]})
    with pytest.raises(SecAggError, match="both shares of"):
        fed.server.receive_unmask(bad)


def test_a_wrong_share_is_caught_not_summed():
    # Prepare
    fed = Federation(10, SecAggConfig(b"run/11/e0"), seed=5)
    request = fed.masked(fed.shares(fed.keys()))
    for d in fed.ids:
        reply = fed.devices[d].unmask(request)
        if d == "d01":
            share = bytearray(reply.b_shares["d02"])
            share[5] ^= 0x10
            reply = UnmaskShares(d, {**reply.b_shares, "d02": bytes(share)}, reply.s_shares)
        fed.server.receive_unmask(reply)
    # Execute / Assert
    with pytest.raises(SecAggError, match="b_d02"):
        fed.server.finish()


def test_every_inbound_piece_is_validated():
    # Prepare
    cfg = SecAggConfig(b"run/12/e0")
    fed = Federation(6, cfg)
    keys = {d: fed.devices[d].advertise_keys() for d in fed.ids}
    server = fed.server
    # Assert: round 0
    with pytest.raises(SecAggError, match="not a device of this aggregation"):
        server.receive_keys(Device("stranger", cfg).advertise_keys())
    with pytest.raises(SecAggError, match="c key must be 32 bytes"):
        server.receive_keys(AdvertiseKeys("d00", keys["d00"].c_public[:31], keys["d00"].s_public))
    server.receive_keys(keys["d00"])
    with pytest.raises(SecAggError, match="duplicate"):
        server.receive_keys(keys["d00"])
    with pytest.raises(SecAggError, match="repeats"):
        server.receive_keys(AdvertiseKeys("d01", keys["d00"].c_public, keys["d01"].s_public))
    for d in fed.ids[1:]:
        server.receive_keys(keys[d])
    roster = server.roster()
    with pytest.raises(SecAggError, match="round 0 is closed"):
        server.receive_keys(keys["d01"])
    # round 1
    sent = {d: fed.devices[d].share_keys(roster) for d in fed.ids}
    with pytest.raises(SecAggError, match="not in the roster"):
        server.receive_shares(EncryptedShares("zz", sent["d00"].ciphertexts))
    with pytest.raises(SecAggError, match="must address exactly its 5 neighbours"):
        server.receive_shares(EncryptedShares("d00", {v: c for v, c in sent["d00"].ciphertexts.items() if v != "d01"}))
    with pytest.raises(SecAggError, match="not 124 bytes"):
        server.receive_shares(EncryptedShares("d00", {**sent["d00"].ciphertexts, "d01": b"x" * 10}))
    for d in fed.ids:
        server.receive_shares(sent[d])
    with pytest.raises(SecAggError, match="duplicate"):
        server.receive_shares(sent["d00"])
    inboxes = server.route_shares()
    with pytest.raises(SecAggError, match="got the share inbox of d01"):
        fed.devices["d00"].masked_input(inboxes["d01"], fed.inputs["d00"])
    # round 2
    masked = {d: fed.devices[d].masked_input(inboxes[d], fed.inputs[d]) for d in fed.ids}
    server.receive_masked(masked["d00"])
    with pytest.raises(SecAggError, match="duplicate"):
        server.receive_masked(masked["d00"])
    reshaped = {**masked["d01"].arrays, "count": masked["d01"].arrays["count"][:5]}
    with pytest.raises(SecAggError, match="shapes or int/float kinds differ"):
        server.receive_masked(MaskedInput("d01", reshaped, masked["d01"].scale_bits))
    with pytest.raises(SecAggError, match="scale 7"):
        server.receive_masked(MaskedInput("d01", masked["d01"].arrays, {**masked["d01"].scale_bits, "sum": 7}))
    # bodies: wrong types and lengths
    with pytest.raises(SecAggError, match="secagg_keys.s: expected 32 bytes"):
        AdvertiseKeys.from_body({"device": "d00", "c": bytes(32), "s": bytes(3)})
    with pytest.raises(SecAggError, match="has no 'ct'"):
        EncryptedShares.from_body({"device": "d00"})
    with pytest.raises(SecAggError, match="expected an int64 array"):
        MaskedInput.from_body({"device": "d00", "arrays": {"a": np.zeros(3, np.float32)}, "scale": {"a": 0}})
    with pytest.raises(SecAggError, match="bool array of the roster's 6 devices"):
        UnmaskRequest(np.ones(5, bool), np.zeros(5, bool)).ids(roster.devices)


def test_a_value_beyond_the_fixed_point_headroom_is_a_clear_error():
    # Prepare: at f = 24 and 10 devices a float may reach (2^63 - 1) / (10 * 2^24) ~ 5.5e10
    fed = Federation(10, SecAggConfig(b"run/13/e0"))
    inboxes = fed.shares(fed.keys())
    # Execute / Assert
    with pytest.raises(SecAggError, match=r"'sum' has \|value\| 1e\+11, over the range 5.49756e\+10 of 10 devices"):
        fed.devices["d00"].masked_input(inboxes["d00"], {"sum": np.array([1e11])})
    with pytest.raises(SecAggError, match="NaN or inf"):
        fed.devices["d00"].masked_input(inboxes["d00"], {"sum": np.array([np.nan])})
    # a refused input did not consume the round: the device can still send a valid one
    assert fed.devices["d00"].masked_input(inboxes["d00"], {"sum": np.array([5e10])}).arrays["sum"].shape == (1,)


def test_a_masked_input_alone_looks_uniform():
    # Prepare: an input far from uniform (small non-negative counts)
    fed = Federation(10, SecAggConfig(b"run/14/e0"))
    inboxes = fed.shares(fed.keys())
    x = np.arange(20_000) % 7
    # Execute
    words = fed.devices["d00"].masked_input(inboxes["d00"], {"count": x}).arrays["count"]
    # Assert: Kolmogorov-Smirnov against U[0, 1) (2.5 / sqrt(n): a false alarm once in ~1e5 runs),
    # balanced bits, no trace of x
    u = words.astype(np.float64) / 2.0**64
    ecdf = np.arange(1, u.size + 1) / u.size
    assert np.max(np.abs(ecdf - np.sort(u))) < 2.5 / np.sqrt(u.size)
    assert abs(np.unpackbits(words.view(np.uint8)).mean() - 0.5) < 0.002
    assert np.mean(words == x.astype(np.uint64)) < 1e-3
    assert abs(np.corrcoef(u, x)[0, 1]) < 0.05


def test_prg_is_aes_256_ctr_and_stable():
    # AES-256 of the zero block under the zero key (FIPS 197 style known answer), as two LE words
    words = crypto.prg(bytes(32), 2)
    assert bytes(words.astype("<u8").tobytes()).hex() == "dc95c078a2408989ad48a21492842087"
    np.testing.assert_array_equal(crypto.prg(b"k" * 32, 1000), crypto.prg(b"k" * 32, 1000))


def test_shamir_rebuilds_from_any_t_shares_and_not_from_fewer():
    # Prepare
    secret = bytes(range(32))
    shares = shamir.split(secret, 3, [1, 2, 3, 4, 5])
    # Execute / Assert
    assert shamir.combine({x: shares[x] for x in (2, 4, 5)}, 3, 32) == secret
    assert shamir.combine(shares, 3, 32) == secret
    with pytest.raises(SecAggError, match="2 shares of secret, threshold 3"):
        shamir.combine({x: shares[x] for x in (1, 2)}, 3, 32)


def test_bench_suite_quick_runs_exact(tmp_path):
    from splitedge.cli import main

    assert main(["bench", "secagg", "--quick", "--counts", "5,12", "--dims", "8", "--no-plots",
                 "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "secagg.json").read_text())
    rows = doc["results"]["rows"]
    assert {(r["mode"], r["devices"]) for r in rows} == {(m, n) for m in ("secagg", "secagg+", "secagg+ signed")
                                                         for n in (5, 12)}
    assert all(r["exact"] and r["bytes"]["masked"] > 0 for r in rows)
    signed = [r for r in rows if r["mode"] == "secagg+ signed"]
    # 64-byte signatures: on the keys (up), the statement (up) and a quorum of them (down)
    assert all(r["bytes"]["signed"] > 64 and 64 * 2 * r["devices"] / 3 < r["bytes"]["signatures"] < 70 * r["devices"]
               for r in signed)
    assert all(r["bytes"]["keys"] > 64 + next(u for u in rows if u["mode"] == "secagg+" and u["devices"] == r["devices"]
                                              and not u["dropped"])["bytes"]["keys"] for r in signed)
    assert (tmp_path / "secagg.md").read_text().splitlines()[2].startswith("- command: `splitedge bench secagg")


_THIN = """
import sys
import numpy as np
from splitedge.methods.privacy.secagg import Device, SecAggConfig, Server
cfg = SecAggConfig(b"thin", neighbours=2)
devs = [Device(f"d{i}", cfg) for i in range(4)]
srv = Server(cfg)
for d in devs:
    srv.receive_keys(d.advertise_keys())
roster = srv.roster()
for d in devs:
    srv.receive_shares(d.share_keys(roster))
inbox = srv.route_shares()
for d in devs:
    srv.receive_masked(d.masked_input(inbox[d.id], {"x": np.ones(3), "n": np.array([1])}))
req = srv.unmask_request()
for d in devs:
    srv.receive_unmask(d.unmask(req))
out = srv.finish()
assert out.sums["x"].tolist() == [4.0, 4.0, 4.0] and out.sums["n"].tolist() == [4]
print(sorted(m for m in ("torch", "torchvision") if m in sys.modules))
"""


def test_secure_aggregation_runs_without_torch():
    proc = subprocess.run([sys.executable, "-c", _THIN], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "[]"
