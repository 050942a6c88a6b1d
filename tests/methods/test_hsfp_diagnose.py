"""bench hsfp-diagnose: the variance ratio measures what issue 12 suspects, and a small run
reports every diagnostic (variance ratios, oracles, W_c probes around each average)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from splitedge.bench import hsfp_diagnose as diag
from splitedge.methods.moments import compute_moments
from splitedge.methods.hsfp.sampling import sample_features


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def test_pooled_ratio_of_independent_samples_is_one_over_positions():
    """Real maps constant over a 4x4 grid (fully correlated positions): sampling each position
    independently from their moments keeps the per-position variance but pools to ~1/16 of it."""
    rng = np.random.default_rng(0)
    y = np.repeat(np.arange(3), 400)
    z = rng.standard_normal((len(y), 2, 1, 1)) + y[:, None, None, None]
    real = np.broadcast_to(z, (len(y), 2, 4, 4)).astype(np.float32)
    synth, ys = sample_features(compute_moments(real.reshape(len(y), -1), y), len(y), rng)
    synth = synth.reshape(real.shape)
    classes = np.arange(3)
    per_position = diag.variance_ratios(real, y, synth, ys, classes)
    pooled = diag.variance_ratios(diag.pooled(real), y, diag.pooled(synth), ys, classes)
    assert per_position["mean"] == pytest.approx(1.0, abs=0.15)
    assert pooled["mean"] == pytest.approx(1 / 16, rel=0.25)
    assert len(pooled["per_class"]) == 3


def test_class_total_var_is_the_covariance_trace():
    x = np.array([[0.0, 1.0], [2.0, 5.0], [9.0, 9.0], [9.0, 9.0]])
    y = np.array([0, 0, 1, 2])
    out = diag.class_total_var(x, y, np.array([0, 1]))
    assert out[0] == pytest.approx(2.0 + 8.0)
    assert math.isnan(out[1])  # one sample: no variance, not a zero


def test_small_run_reports_every_diagnostic():
    s = diag.DiagnoseSettings(devices=2, edges=2, rounds=2, max_train=160, max_test=100,
                              overrides={"ic": "1", "edge_samples": "256", "cloud_samples": "256",
                                         "min_class_count": "1"},  # 8 images a class: all would be withheld
                              stat_images=100, probe_images=100)
    config, results = diag.run(s)
    assert config["model"] == "cnn" and results["stacks"] == list(diag.STACKS)
    for record in results["rounds"]:
        assert all(0.0 <= record[k]["accuracy"] <= 1.0 for k in diag.STACKS)
        v = record["variance"]
        assert set(diag.VAR_KEYS) <= set(v) and 0.0 <= v["head_fit_real"] <= 1.0
        assert all(r > 0 for r in v["we_input_per_position"]["per_class"] if r == r)
    assert [p["round"] for p in results["probes"]] == [1, 2]  # ic=1: an average every round
    assert all(len(p["local_before"]) == 2 and 0.0 <= p["after"] <= 1.0 for p in results["probes"])
    assert "oracle-edge" in diag.markdown(results) and "(c) Linear probe" in diag.markdown(results)


def test_no_oracles_with_the_sampling_flags(tmp_path):
    """--no-oracles trains the H-SFP stack alone; the variance diagnostic samples as the flags
    say (mixture components per device, pre_relu moments rectified), so it measures them."""
    s = diag.DiagnoseSettings(devices=2, edges=2, rounds=1, max_train=160, max_test=100, stacks=diag.STACKS[:1],
                              overrides={"edge_samples": "256", "cloud_samples": "256", "mixture": "true",
                                         "pre_relu": "true", "class_balanced": "true"},
                              stat_images=100, probe_images=100)
    config, results = diag.run(s)
    assert results["stacks"] == ["hsfp"] and config["settings"]["pre_relu"] == "true"
    v = results["rounds"][0]["variance"]
    assert 0.0 <= v["head_fit_sampled"] <= 1.0 and v["we_input_per_position"]["mean"] > 0
    assert "oracle-edge" not in diag.markdown(results)
    # its files re-render from the JSON (named after the suite, hsfp-diagnose.json)
    from splitedge.bench.lib import report
    from splitedge.cli import main

    report.write(tmp_path, report.document("hsfp-diagnose", ["bench", "hsfp-diagnose"], config, results, 1.0), "stale")
    assert main(["bench", "hsfp-diagnose", "--rerender", "--no-plots", "--out", str(tmp_path)]) == 0
    assert "stale" not in (tmp_path / "hsfp-diagnose.md").read_text()


def test_oracle_edges_draw_real_wc_features_of_their_own_devices():
    from splitedge.cloud.options import build_run_config
    from splitedge.methods.data.datasets import load_dataset
    from splitedge.methods.data.preprocess import to_input

    s = diag.DiagnoseSettings(devices=2, edges=2, rounds=1, max_train=120, max_test=50)
    train, test, info = load_dataset("digits", max_train=120, max_test=50)
    shards = [np.arange(0, 60), np.arange(60, 120)]
    rep = diag.Replica(s, build_run_config("hsfp", info, None, 0, {}), train, test, shards)
    rep.start()
    oracle = rep.edges["oracle-edge"]["e1"].method
    assert "sample_features" not in vars(rep.edges["hsfp"]["e1"].method)  # the plain stack samples
    x, y = oracle.sample_features(None, 40, np.random.default_rng(0))
    assert set(y.tolist()) <= set(train[1][60:].tolist())  # only e1's device (d1) holds these images
    feats = diag._forward(rep.devices["d1"].wc_global, to_input(train[0][60:], info.mean, info.std))
    flat = feats.reshape(len(feats), -1)
    assert x.shape == (40, flat.shape[1])
    for row, label in zip(x, y):  # every drawn row is the global W_c output of one of d1's images
        match = np.isclose(flat, row, atol=1e-5).all(axis=1)
        assert match.any() and label in train[1][60:][match]


def _correlated_maps(n_per_class: int = 400) -> tuple[np.ndarray, np.ndarray]:
    """Real maps constant over a 4x4 grid, per (sample, channel)."""
    rng = np.random.default_rng(0)
    y = np.repeat(np.arange(3), n_per_class)
    z = rng.standard_normal((len(y), 2, 1, 1)) + y[:, None, None, None]
    return np.broadcast_to(z, (len(y), 2, 4, 4)).astype(np.float32), y


@pytest.mark.parametrize("rho, pooled_ratio", [(0.0, 1 / 16), (1.0, 1.0), (0.5, 0.5 + 0.5 / 16)])
def test_spatial_rho_sets_the_pooled_variance_and_keeps_each_position(rho, pooled_ratio):
    """H-SFP's spatial_rho (issue 12 fix of suspect 1): per-position moments unchanged, pooled
    variance rho + (1 - rho) / positions of the per-position one (real maps here: fully correlated)."""
    real, y = _correlated_maps()
    m = compute_moments(real.reshape(len(y), -1), y)
    synth, ys = sample_features(m, 6000, np.random.default_rng(1), floor=0, rho=rho, shape=(2, 4, 4))
    synth = synth.reshape(len(ys), 2, 4, 4)
    classes = np.arange(3)
    assert np.bincount(ys).tolist() == [2000, 2000, 2000]
    for c in classes:
        np.testing.assert_allclose(synth[ys == c].mean(axis=0), real[y == c].mean(axis=0), atol=0.12)
    assert diag.variance_ratios(real, y, synth, ys, classes)["mean"] == pytest.approx(1.0, abs=0.1)
    pooled = diag.variance_ratios(diag.pooled(real), y, diag.pooled(synth), ys, classes)["mean"]
    assert pooled == pytest.approx(pooled_ratio, rel=0.15)


def test_hsfp_samples_as_before_unless_spatial_rho_is_set():
    """spatial_rho = 0 (default) is the paper's sampler bit for bit; > 0 finds the map shape itself
    (the hook keeps its (merged, total, rng) signature) and refuses values outside [0, 1]."""
    from splitedge.methods.config import ModelSpec
    from splitedge.methods.registry import create_method, default_config

    spec = ModelSpec()  # cnn on 8x8 digits: W_c (32, 4, 4)
    real, y = _correlated_maps(50)
    m = compute_moments(np.tile(real, (1, 16, 1, 1)).reshape(len(y), -1), y)  # 32 channels
    plain = create_method("hsfp", default_config("hsfp", spec))
    a = plain.sample_features(m, 100, np.random.default_rng(3))
    b = sample_features(m, 100, np.random.default_rng(3))
    assert all(np.array_equal(u, v) for u, v in zip(a, b))
    corr = create_method("hsfp", default_config("hsfp", spec, spatial_rho=1.0))
    x, _ = corr.sample_features(m, 300, np.random.default_rng(3))
    maps = x.reshape(len(x), 32, 16)
    assert np.allclose(maps.std(axis=2) / np.sqrt(m.var.mean() + 1e-5), 0.0, atol=0.5)  # positions move together
    with pytest.raises(ValueError, match="spatial_rho"):
        default_config("hsfp", spec, spatial_rho=1.5)
