"""What secure aggregation costs one edge and its devices: seconds per round and bytes per message.

Runs the whole protocol (methods/privacy/secagg.py) in this process for n devices of one edge
with the input of an H-SFP statistics message: per-class feature sums and sums of squares
(classes x dim float32, values like those of ReLU features over a few hundred samples) and
per-class counts (int). Each row: SecAgg (all pairs) or SecAgg+ (k = 2 * ceil(log2 n)
neighbours, threshold floor(k/2) + 1), without dropout and with a fraction of the devices
dropping after round 1 (their shares are out, their masked input never arrives: the edge
rebuilds their mask keys, the most expensive recovery). The `secagg+ signed` rows add what a
signed federation does (methods/privacy/identity.py): Ed25519 signatures over each device's keys,
checked by its neighbours and the edge, and the consistency round (r3a) before unmasking, in
which each device checks a quorum of ceil(2n/3) survivors' signatures.

Times are CPU seconds on this machine, one device after another (a device's figure is what one
device spends; the edge's is its whole round). Bytes are msgpack bodies (`to_body()` through the
project's array ext type), envelope and MQTT headers not included. Every row checks that the
unmasked sum equals the sum of the fixed-point encodings exactly. Full SecAgg runs whole up to
``full_max`` devices: its per-device Shamir work grows as n x t ~ n^2 / 2 (about 1 s per device
at 1,000 in pure Python, so 1,000 devices simulated in one process would take over 15 minutes);
beyond it only rounds 0 and 1 of ``sample`` devices are timed, against the whole roster.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import msgpack
import numpy as np

from splitedge.bench.lib.report import pyplot, save_figure, table
from splitedge.methods.moments import merge_moments
from splitedge.methods.privacy import additive, fixedpoint
from splitedge.methods.privacy.secagg import Device, SecAggConfig, Server
from splitedge.protocol.arrays import ext_default

ROUNDS = ("keys", "shares", "masked", "consistency", "unmask")
ROUND_NAMES = ("r0", "r1", "r2", "r3a", "r3")
MODES = ("secagg", "secagg+", "secagg+ signed")
SIGNED = MODES[2]


@dataclass
class SecAggCostSettings:
    counts: tuple[int, ...] = (10, 100, 1000)
    dim: int = 512
    classes: int = 10
    full_max: int = 100  # full SecAgg (all pairs) only up to this many devices; beyond, rounds 0-1 sampled
    sample: int = 3  # devices whose rounds 0-1 are timed for full SecAgg beyond full_max
    drop: float = 0.1  # fraction dropping after round 1 in the dropout rows
    frac_bits: int = fixedpoint.FRAC_BITS
    seed: int = 0

    @classmethod
    def from_args(cls, a: argparse.Namespace) -> SecAggCostSettings:
        counts = tuple(int(c) for c in a.counts) if a.counts else ((10, 100) if a.quick else (10, 100, 1000))
        dim = int(a.dims[0]) if a.dims else (64 if a.quick else 512)
        return cls(counts=counts, dim=dim, seed=a.seed)


def body_bytes(msg: Any) -> int:
    """Bytes of a message's body as msgpack with the project's array ext type."""
    return len(msgpack.packb(msg.to_body(), default=ext_default, use_bin_type=True))


def inputs(rng: np.random.Generator, s: SecAggCostSettings) -> dict[str, np.ndarray]:
    counts = rng.integers(0, 500, s.classes)
    feats = rng.random((s.classes, s.dim)).astype(np.float32) * 4  # a ReLU feature's mean-ish scale
    return {"count": counts, "sum": (feats * counts[:, None]).astype(np.float32),
            "sumsq": (feats**2 * counts[:, None]).astype(np.float32)}


def identities(ids: list[str], roles: dict[str, str] | None = None) -> dict[str, Any]:
    """Each node's Ed25519 signer with one keyring of every node's public key (a signed
    federation), each key with its role: `roles`, else "cloud" for cloud, "edge" for e<N>, and
    "device" for the rest."""
    import re

    from cryptography.hazmat.primitives.asymmetric import ed25519

    from splitedge.methods.privacy.identity import Keyring
    from splitedge.protocol.signing import KeyRing, Signer

    keys = {d: ed25519.Ed25519PrivateKey.generate() for d in ids}
    roles = roles if roles is not None else {
        d: "cloud" if d == "cloud" else "edge" if re.fullmatch(r"e\d+", d) else "device" for d in ids}
    ring = KeyRing({d: k.public_key() for d, k in keys.items()}, roles)
    return {d: Keyring(Signer(k), ring) for d, k in keys.items()}


def one_row(n: int, mode: str, drop: float, s: SecAggCostSettings) -> dict[str, Any]:
    """One aggregation of ``n`` devices, timed round by round on both sides."""
    rng = np.random.default_rng(s.seed + n)
    cfg = SecAggConfig(f"bench/{mode}/{n}/{drop}".encode(), neighbours=None if mode == "secagg" else "log",
                       frac_bits=s.frac_bits)
    ids = [f"d{i:04d}" for i in range(n)]
    gone = set(rng.choice(ids, int(round(drop * n)), replace=False)) if drop else set()
    dev_t: dict[str, list[float]] = {r: [] for r in ROUNDS}
    srv_t = dict.fromkeys(ROUNDS, 0.0)
    sizes: dict[str, list[int]] = {k: [] for k in ("keys", "roster", "shares", "inbox", "masked", "request", "signed",
                                                   "signatures", "reveal")}
    who = identities([*ids, "e0"]) if mode == SIGNED else {}
    server = Server(cfg, ids, who.get("e0"))
    devices = {d: Device(d, cfg, who.get(d)) for d in ids}

    def timed(bucket: list[float], fn: Callable[[], Any]) -> Any:
        start = time.perf_counter()
        out = fn()
        bucket.append(time.perf_counter() - start)
        return out

    def served(rnd: str, fn: Callable[[], Any]) -> Any:
        start = time.perf_counter()
        out = fn()
        srv_t[rnd] += time.perf_counter() - start
        return out

    for d in ids:
        msg = timed(dev_t["keys"], devices[d].advertise_keys)
        sizes["keys"].append(body_bytes(msg))
        served("keys", lambda: server.receive_keys(msg))
    whole = served("keys", server.roster)
    # SecAgg+: each device its own roster (every id, its neighbours' keys), as the edge sends it
    rosters = ({d: whole for d in ids} if server.graph is None or server.graph.complete
               else {d: served("keys", lambda: server.roster(d)) for d in ids})
    sizes["roster"] += [body_bytes(r) for r in rosters.values()]
    for d in ids:
        msg = timed(dev_t["shares"], lambda: devices[d].share_keys(rosters[d]))
        sizes["shares"].append(body_bytes(msg))
        served("shares", lambda: server.receive_shares(msg))
    inboxes = served("shares", server.route_shares)
    expected: dict[str, Any] = {}
    plain, clear = [], []
    for d in ids:
        x = inputs(rng, s)
        plain.append(len(msgpack.packb(x, default=ext_default, use_bin_type=True)))
        sizes["inbox"].append(body_bytes(inboxes[d]))
        msg = timed(dev_t["masked"], lambda: devices[d].masked_input(inboxes[d], x))
        sizes["masked"].append(body_bytes(msg))
        if d in gone:
            continue
        served("masked", lambda: server.receive_masked(msg))
        for name, arr in x.items():
            enc = fixedpoint.encode(name, arr, s.frac_bits, n)[0].view(np.int64)
            expected[name] = enc if name not in expected else expected[name] + enc
        clear.append(additive.moments_of_sums({"counts": x["count"], "sums": x["sum"], "sumsq": x["sumsq"]}))
    start = time.perf_counter()
    merge_moments(clear)  # what the edge does in the clear with the same devices' statistics
    clear_merge_s = time.perf_counter() - start
    request = served("masked", server.unmask_request)
    sizes["request"].append(body_bytes(request))
    signed = None
    if who:
        for d in sorted(server.survivors):
            msg = timed(dev_t["consistency"], lambda: devices[d].sign_request(request))
            sizes["signed"].append(body_bytes(msg))
            served("consistency", lambda: server.receive_signature(msg))
        signed = served("consistency", server.signed_survivors)
        sizes["signatures"].append(body_bytes(signed))
    for d in sorted(server.survivors):
        msg = timed(dev_t["unmask"], lambda: devices[d].unmask(request, signed))
        sizes["reveal"].append(body_bytes(msg))
        served("unmask", lambda: server.receive_unmask(msg))
    result = served("unmask", server.finish)
    exact = all(np.array_equal(result.encoded[k], v) for k, v in expected.items())
    return {"mode": mode, "devices": n, "k": server.k, "t": server.threshold, "dropped": len(result.dropped),
            "summed": len(result.devices), "input_elements": sum(a.size for a in x.values()),
            "plain_input_bytes": int(np.mean(plain)), "exact": exact,
            "device_s": {r: float(np.mean(v)) if v else 0.0 for r, v in dev_t.items()},
            "device_max_s": {r: float(np.max(v)) if v else 0.0 for r, v in dev_t.items()},
            "server_s": srv_t, "clear_merge_s": clear_merge_s, "bytes": {k: int(np.mean(v)) if v else 0 for k, v in sizes.items()}}


def sampled_full(n: int, s: SecAggCostSettings) -> dict[str, Any]:
    """Full SecAgg beyond ``full_max``: rounds 0 and 1 of ``s.sample`` devices against a roster of
    ``n`` (what one device spends before it can mask); the rest of the protocol is not run."""
    cfg = SecAggConfig(f"bench/secagg/{n}/sampled".encode(), frac_bits=s.frac_bits)
    ids = [f"d{i:04d}" for i in range(n)]
    server, devices = Server(cfg, ids), {d: Device(d, cfg) for d in ids}
    keys_t, keys_b, shares_t, shares_b = [], [], [], []
    for d in ids:
        start = time.perf_counter()
        msg = devices[d].advertise_keys()
        keys_t.append(time.perf_counter() - start)
        keys_b.append(body_bytes(msg))
        server.receive_keys(msg)
    roster = server.roster()
    for d in ids[:s.sample]:
        start = time.perf_counter()
        msg = devices[d].share_keys(roster)
        shares_t.append(time.perf_counter() - start)
        shares_b.append(body_bytes(msg))
    none = dict.fromkeys(ROUNDS)
    return {"mode": "secagg", "devices": n, "k": server.k, "t": server.threshold, "dropped": 0, "sampled": s.sample,
            "exact": None, "device_s": {**none, "keys": float(np.mean(keys_t)), "shares": float(np.mean(shares_t))},
            "server_s": none, "bytes": {"keys": int(np.mean(keys_b)), "roster": body_bytes(roster),
                                        "shares": int(np.mean(shares_b))}}


def run(s: SecAggCostSettings) -> tuple[dict[str, Any], dict[str, Any]]:
    rows = []
    for n in s.counts:
        for mode in MODES:
            if mode == "secagg" and n > s.full_max:
                rows.append(sampled_full(n, s))
                print(f"secagg cost: secagg n={n}: rounds 0-1 of {s.sample} devices only, device round 1 "
                      f"{rows[-1]['device_s']['shares']:.3f} s", flush=True)
                continue
            for drop in (0.0, s.drop) if mode != SIGNED else (0.0,):
                rows.append(one_row(n, mode, drop, s))
                r = rows[-1]
                print(f"secagg cost: {mode} n={n} drop={r['dropped']}: device "
                      f"{sum(r['device_s'].values()):.3f} s, edge {sum(r['server_s'].values()):.3f} s, "
                      f"exact={r['exact']}", flush=True)
    config = {k: list(v) if isinstance(v, tuple) else v for k, v in vars(s).items()}
    return config, {"rows": rows, "full_max": s.full_max}


def markdown(results: dict[str, Any]) -> str:
    rows = results["rows"]
    first = next((r for r in rows if "input_elements" in r), {"input_elements": 0})
    times = [(r["mode"] + (f" ({r['sampled']} sampled)" if r.get("sampled") else ""), r["devices"], r["k"], r["t"],
              r["dropped"], *(_ms(r["device_s"].get(k)) for k in ROUNDS), _ms(_total(r["device_s"], ROUNDS)),
              *(_ms(r["server_s"].get(k)) for k in ROUNDS), _ms(_total(r["server_s"], ROUNDS)),
              _ms(r.get("clear_merge_s")),
              {True: "yes", False: "NO", None: "-"}[r["exact"]]) for r in rows]
    up = ("keys", "shares", "masked", "signed", "reveal")
    b = [(r["mode"], r["devices"], r["dropped"], *(r["bytes"].get(k) for k in up), _total(r["bytes"], up),
          *(r["bytes"].get(k) for k in ("roster", "inbox", "request", "signatures")), r.get("plain_input_bytes"))
         for r in rows if not r["dropped"]]
    return "\n".join([
        "## Secure aggregation cost per round (milliseconds)\n",
        f"Input per device: {first['input_elements']} numbers (per-class counts, sums and sums of squares). "
        "SecAgg+ uses k = 2 ceil(log2 n) neighbours; both modes use t = floor(k/2) + 1. `dev`: mean "
        "milliseconds of one device per round; `edge`: the edge's whole round (r3: rebuilding the secrets "
        "and unmasking the sum). `dropped`: devices gone after round 1, whose mask keys the edge rebuilds. "
        f"Full SecAgg runs up to {results.get('full_max', 100)} devices only: its per-device Shamir work "
        "grows as n^2/2; beyond, only rounds 0 and 1 of a few devices are timed (`sampled`), against the "
        "whole roster. `edge clear merge`: the exact merge of the same devices' moments in the clear "
        "(methods/moments.py), what the edge does without SecAgg. `signed`: a signed federation's form "
        "(identity.py): signed keys, and r3a, the consistency round (devices sign the request; each checks "
        "a quorum of ceil(2n/3) survivors' signatures before r3).\n",
        table(["mode", "devices", "k", "t", "dropped", *(f"dev {r}" for r in ROUND_NAMES), "dev total",
               *(f"edge {r}" for r in ROUND_NAMES), "edge total", "edge clear merge", "exact"], times),
        "\n## Bytes per device (msgpack bodies, no envelope; rows without dropout)\n",
        f"Up: what one device sends per round; down: what the edge sends it (the request goes to every "
        f"device alike; so does SecAgg's roster of every device's keys, while SecAgg+ sends each device its "
        f"own: every id, and the keys of the device and its k neighbours). `plain`: the same input "
        f"sent without SecAgg (float32 sums, int64 counts): masking needs 8-byte words, so "
        f"{first['input_elements']} numbers cost {8 * first['input_elements']} bytes.\n",
        table(["mode", "devices", "dropped", "up keys", "up shares", "up masked", "up signed", "up reveal",
               "up total", "down roster", "down inbox", "down request", "down signatures", "plain"], b),
    ])


def _ms(v: float | None) -> float | None:
    return None if v is None else round(1e3 * v, 2)


def _total(values: dict[str, Any], keys: tuple[str, ...]) -> Any:
    """The sum over ``keys``, None when one was not measured."""
    got = [values.get(k) for k in keys]
    return None if any(v is None for v in got) else sum(got)


def plot(results: dict[str, Any], out_dir: Path) -> list[Path]:
    plt = pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for mode in MODES:
        for dropped in (False, True):
            rows = [r for r in results["rows"]
                    if r["mode"] == mode and bool(r["dropped"]) == dropped and not r.get("sampled")]
            if not rows:
                continue
            tag = f"{mode}{', dropout' if dropped else ''}"
            n = [r["devices"] for r in rows]
            ax1.plot(n, [sum(r["device_s"].values()) for r in rows], marker="o", label=f"device, {tag}")
            ax1.plot(n, [sum(r["server_s"].values()) for r in rows], marker="s", linestyle="--", label=f"edge, {tag}")
            ax2.plot(n, [sum(r["bytes"].get(k) or 0 for k in ("keys", "shares", "masked", "signed", "reveal"))
                         for r in rows],
                     marker="o", label=tag)
    ax1.set(xscale="log", yscale="log", xlabel="devices per edge", ylabel="seconds per aggregation")
    ax2.set(xscale="log", xlabel="devices per edge", ylabel="bytes sent per device")
    ax1.legend(fontsize=7)
    ax2.legend(fontsize=7)
    return save_figure(fig, out_dir / "secagg.png")


Settings = SecAggCostSettings
