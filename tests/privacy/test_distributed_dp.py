"""Distributed DP (methods/privacy/distributed.py): with `dp_devices` t > 1, each device adds
noise of sigma / sqrt(t) to its raw sums, which reach the edge only inside a secure sum of at
least t devices; the sum then carries at least one release's noise, and the edge post-processes
it as a device post-processes its own release under local DP."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from splitedge.methods.contract import Message
from splitedge.methods.privacy import secagg
from splitedge.methods.privacy.distributed import (device_sigma, min_survivors, release_sums, shares_noise,
                                                   sum_release)
from splitedge.methods.privacy.dp import ClippedSums, moments_from
from splitedge.methods.privacy.errors import SecAggError
from splitedge.runtime.secure_sum import SharedNoise, body_of, sums_of
from splitedge.sim import SimSettings, run_sim


def _cfg(sigma: float, t: int) -> SimpleNamespace:
    return SimpleNamespace(dp_sigma=sigma, dp_devices=t)


def test_each_device_adds_its_share_of_the_noise() -> None:
    assert device_sigma(_cfg(2.0, 4)) == pytest.approx(1.0) and shares_noise(_cfg(2.0, 4))
    assert device_sigma(_cfg(2.0, 1)) == 2.0 and not shares_noise(_cfg(2.0, 1))
    assert min_survivors(_cfg(2.0, 4)) == 4 and min_survivors(_cfg(0.0, 1)) == 1


def _device_sums(rng: np.random.Generator, n: int, second: str = "class") -> ClippedSums:
    acc = ClippedSums(4, 3, clip=2.0, second=second)
    acc.add(rng.normal(0.5, 1.0, (n, 4)), rng.integers(0, 3, n))
    return acc


@pytest.mark.parametrize("second", ["class", "full"])
def test_the_sum_of_m_shares_carries_sigma_sqrt_m_over_t(second: str) -> None:
    # 8 devices release at sigma / sqrt(4) each; the summed noise has sd sigma sqrt(P) sqrt(8 / 4) Delta
    # per part (counts: Delta 1, sums: C, second moments: C^2): measured over 3,000 sums of empty data
    sigma, t, m, clip, draws = 1.5, 4, 8, 2.0, 3000
    rng = np.random.default_rng(0)
    empty = ClippedSums(4, 3, clip=clip, second=second)
    noise = {"counts": [], "sums": [], "second": []}
    for _ in range(draws):
        total: dict[str, np.ndarray] = {}
        for _ in range(m):
            for k, v in release_sums(empty.release(sigma / math.sqrt(t), rng))[0].items():
                total[k] = total.get(k, 0) + v
        for k, v in total.items():
            noise[k].append(v.ravel())
    want = sigma * math.sqrt(3) * math.sqrt(m / t)
    for k, delta in (("counts", 1.0), ("sums", clip), ("second", clip * clip)):
        assert np.std(np.concatenate(noise[k])) == pytest.approx(want * delta, rel=0.03), k
    summed = sum_release(total, release_sums(empty.release(0.0))[1], sigma=sigma, share=t, devices=m)
    assert summed.count_sd == pytest.approx(want)


def test_without_noise_the_summed_release_is_the_unions() -> None:
    rng = np.random.default_rng(1)
    devices = [_device_sums(rng, n) for n in (40, 25, 60)]
    union = ClippedSums(4, 3, clip=2.0, second="class")
    total: dict[str, np.ndarray] = {}
    for d in devices:
        union.counts += d.counts
        union.sums += d.sums
        union.sq += d.sq
        values, form = release_sums(d.release(0.0))
        for k, v in values.items():
            total[k] = total.get(k, 0) + v
    got = moments_from(sum_release(total, form, sigma=1.0, share=3, devices=3))
    want = moments_from(union.release(0.0))
    assert got.classes.tolist() == want.classes.tolist() and got.counts.tolist() == want.counts.tolist()
    np.testing.assert_allclose(got.mean, want.mean, rtol=1e-12)
    np.testing.assert_allclose(got.var, want.var, rtol=1e-9)


def _moments_message() -> Message:
    return Message("moments", {"classes": np.array([0]), "counts": np.array([5]), "mean": np.zeros((1, 4), np.float32),
                               "var": np.zeros((1, 4), np.float32), "space": "wc", "versions": {"wc": 1}})


def _shared_keys(ids: list[str], config: secagg.SecAggConfig) -> tuple[dict, secagg.Server, dict]:
    """Devices and their edge's server through the keys and shares exchanges: (devices, server,
    each device's inbox)."""
    devices, server = {d: secagg.Device(d, config) for d in ids}, secagg.Server(config, ids)
    for d in ids:
        server.receive_keys(devices[d].advertise_keys())
    roster = server.roster()
    for d in ids:
        server.receive_shares(devices[d].share_keys(roster))
    return devices, server, server.route_shares()


def test_a_secure_sum_of_raw_releases_is_post_processed_at_the_edge() -> None:
    # three devices' raw releases through the real SecAgg protocol; the edge's body is the
    # post-processed sum: classes kept by the summed noisy count, counts capped to the samples
    # announced, the run's minimum count applied
    rng = np.random.default_rng(2)
    ids = ["d0", "d1", "d2"]
    releases = {d: _device_sums(rng, n).release(0.3, rng) for d, n in zip(ids, (40, 25, 60))}
    inputs = {d: sums_of(_moments_message(), 3, shared_dp=True, release=releases[d]) for d in ids}
    devices, server, boxes = _shared_keys(ids, secagg.SecAggConfig(b"run/1/e0/moments.wc", min_survivors=3))
    for d in ids:
        server.receive_masked(devices[d].masked_input(boxes[d], inputs[d][0]))
    request = server.unmask_request()
    for d in ids:
        server.receive_unmask(devices[d].unmask(request))
    result = server.finish()
    meta = inputs["d0"][1]
    assert meta["dp"] == {"second": "class", "clip": 2.0}
    kind, body = body_of(meta, result.sums, SharedNoise(0.6, 4, 3, min_count=10, samples=120))
    direct = {k: sum(inputs[d][0][k] for d in ids) for k in inputs["d0"][0]}
    want = moments_from(sum_release(direct, meta["dp"], sigma=0.6, share=4, devices=3))
    keep = want.counts >= 10
    assert kind == "moments" and body["classes"].tolist() == want.classes[keep].tolist()
    assert int(np.sum(body["counts"])) <= 120
    np.testing.assert_allclose(body["mean"], want.mean[keep], atol=1e-5)
    with pytest.raises(SecAggError, match="raw DP releases, which this run does not expect"):
        body_of(meta, result.sums)
    with pytest.raises(SecAggError, match="has no raw release"):
        sums_of(_moments_message(), 3, shared_dp=True, release=None)


def test_a_sum_of_fewer_devices_than_share_the_noise_is_never_unmasked() -> None:
    # t = 4 share the noise; only 3 masked inputs arrive: the edge refuses to ask for the shares,
    # and a device asked by a dishonest edge refuses to reveal them
    ids = [f"d{i}" for i in range(5)]
    devices, server, boxes = _shared_keys(ids, secagg.SecAggConfig(b"run/2/e0/moments.wc", min_survivors=4))
    for d in ids[:3]:
        server.receive_masked(devices[d].masked_input(boxes[d], {"x": np.ones(2)}))
    with pytest.raises(SecAggError, match="3 masked inputs arrived, fewer than the 4 the sum must hold"):
        server.unmask_request()
    forged = secagg.UnmaskRequest(np.array([True, True, True, False, False]),
                                  np.array([False, False, False, True, True]))
    with pytest.raises(SecAggError, match="refused: 3 survivors, fewer than the 4 the sum must hold"):
        devices["d0"].unmask(forged)


def test_a_run_that_cannot_share_the_noise_is_refused_in_one_line() -> None:
    from splitedge.cloud.options import build_run_config
    from splitedge.methods.data.datasets import load_dataset

    info = load_dataset("digits", max_train=10, max_test=10)[2]
    private = {"dp_sigma": 1.0, "dp_clip": 4.0, "dp_head_clip": 0.5, "dp_update_clip": 5.0, "dp_devices": 2}
    with pytest.raises(ValueError, match="needs dp_sigma > 0 and secagg full or plus"):
        build_run_config("hsfp-cal", info, None, 0, private)
    with pytest.raises(ValueError, match="clustering signal"):
        build_run_config("cflhkd", info, None, 0, {**private, "secagg": "full"})
    build_run_config("hsfp-cal", info, None, 0, {**private, "secagg": "plus"})
    with pytest.raises(ValueError, match="--dp-devices 2 with client sampling"):  # a draw may leave an edge short
        SimSettings(devices=8, edges=2, method="hsfp-cal", sample_fraction=0.5, overrides={**private, "secagg": "plus"})


def _sim(url: str, run: str, out: Path, share: int, sigma: float = 1.0) -> list[dict]:
    torch.set_num_threads(1)
    overrides = {"secagg": "plus", "dp_sigma": sigma, "dp_clip": 4.0, "dp_head_clip": 0.5, "dp_update_clip": 5.0,
                 "dp_devices": min(share, 2), "min_class_count": 2, "ic": 2,
                 "secagg_min_devices": 2}  # two devices an edge, below the default of 3
    s = SimSettings(rounds=2, devices=4, edges=2, broker=url, run=run, out=out, method="hsfp-cal",
                    # the keys wait half the deadline for devices still training: 30 s was too short
                    # for round 2 on a loaded 2-core box (the suite beside a bench), and a sum aborted
                    backends=("torch", "onnx"), max_train=600, max_test=300, deadline_s=120.0, overrides=overrides)
    s.overrides["dp_devices"] = share  # past the sim's own check: as when devices are missing at a deployed edge
    run_sim(s)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_a_federation_sharing_the_noise_sums_every_release_and_refuses_too_small_sums(mosquitto, tmp_path) -> None:
    # torch and thin devices, two per edge: with dp_devices 2 each edge sums its two devices'
    # raw moments, W_c copies and head statistics, and post-processes the sums (at negligible
    # noise the calibrated head is as good as without DP's noise: the post-processing is right);
    # with dp_devices 3 no edge may unmask a sum, so every sum aborts and the run goes on without
    # them, nothing refused, nothing crashed
    records = _sim(mosquitto.url, "ddp-two", tmp_path / "two", share=2, sigma=1e-3)
    two = {"devices": 2, "dropped": 0}
    assert [r["round"] for r in records] == [1, 2]
    for r in records:
        assert r["secagg"] == {e: {"weights.wc": two} if r["round"] == 2 else {"moments.wc": two}
                               for e in ("e0", "e1")}, r
        assert r["calibration_secagg"] == {e: {"arrays.head_stats": two} for e in ("e0", "e1")}, r
        assert not any(r["rejected"].get(e) for e in ("e0", "e1")), r["rejected"]
        assert r["dp_epsilon"] > 0 and r["dp_devices"] == 2 and math.isfinite(r["accuracy"])
    assert records[-1]["accuracy_calibrated"] > 0.7, records[-1]  # fitted on the summed, post-processed statistics
    with pytest.raises(ValueError, match="--dp-devices 3: an edge unmasks no sum of fewer devices"):
        SimSettings(devices=4, edges=2, method="hsfp-cal", overrides={
            "secagg": "plus", "dp_sigma": 1.0, "dp_clip": 4.0, "dp_head_clip": 0.5, "dp_update_clip": 5.0,
            "dp_devices": 3})
    refused = _sim(mosquitto.url, "ddp-three", tmp_path / "three", share=3)
    assert [r["round"] for r in refused] == [1, 2]
    for r in refused:  # each device refuses a roster of 2 before it sends a share (issue 53): no sum forms
        sums = [s for by_edge in r.get("secagg", {}).values() for s in by_edge.values()]
        assert all("fewer than the 3" in s.get("failed", "") for s in sums), r  # none was unmasked
        assert not any(r["rejected"].get(e) for e in ("e0", "e1")), r["rejected"]
