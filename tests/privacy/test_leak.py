"""`splitedge bench leak`: the inversion of W_c from per-class moments, its scores and the verdict.

Small and CPU-only: random images, sklearn digits and a width-4 network, a few seconds in all.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from splitedge.bench import leak
from splitedge.bench.leak import AttackSettings, LeakSettings


def smooth_images(n: int, size: int = 8, channels: int = 1, seed: int = 0) -> np.ndarray:
    """[n, size, size, channels] in [0.15, 0.85]: inside the sigmoid box, with some structure."""
    rng = np.random.default_rng(seed)
    coarse = rng.uniform(0.15, 0.85, size=(n, size // 2, size // 2, channels))
    return coarse.repeat(2, axis=1).repeat(2, axis=2)


def identity_inversion(images: np.ndarray, steps: int = 200) -> np.ndarray:
    """Invert the identity extractor (features = normalised pixels) from the images' moments."""
    torch.set_num_threads(1)  # as the suite runs: tiny ops, no thread hand-offs
    feats = images.transpose(0, 3, 1, 2).reshape(len(images), -1)
    var = feats.var(axis=0, ddof=1) if len(images) > 1 else np.zeros(feats.shape[1])
    rec, residual = leak.invert(nn.Identity(), feats.mean(axis=0), var, len(images),
                                shape=(images.shape[3], images.shape[1], images.shape[2]), norm_mean=(0.0,),
                                norm_std=(1.0,), attack=AttackSettings(steps=steps, lr=0.05, tv=0.0), seed=0)
    assert residual["mean"] < 1e-3
    return rec


def test_one_image_is_recovered_from_the_mean_of_an_identity_like_extractor() -> None:
    img = smooth_images(1)
    rec = identity_inversion(img)
    assert rec.shape == img.shape
    assert leak.psnr_matrix(rec, img)[0, 0] > 35


def test_two_images_come_back_pixel_by_pixel_from_mean_and_variance() -> None:
    """Mean and variance of two values give the pair, not which image holds which: every pixel of
    a reconstruction is one of the two images' pixels. Without the variance term both would be
    the mean image, half the images' difference away."""
    imgs = smooth_images(2, seed=1)
    rec = identity_inversion(imgs, steps=500)
    err = np.abs(rec[:, None] - imgs[None]).min(axis=1)  # per pixel, the nearer of the two images
    assert err.max() < 0.02
    assert np.abs(rec - imgs.mean(axis=0)).mean() > 5 * err.mean()


def test_ssim_is_one_for_an_image_with_itself_and_lower_with_noise() -> None:
    rng = np.random.default_rng(0)
    img = smooth_images(1, size=16, channels=3)
    noisy = np.clip(img + rng.normal(0, 0.1, img.shape), 0, 1)
    other = smooth_images(1, size=16, channels=3, seed=5)
    s = leak.ssim_matrix(img, np.concatenate([img, noisy, other]))[0]
    assert s[0] == pytest.approx(1.0, abs=1e-9)
    assert s[1] < 0.9 and s[2] < s[1]
    assert leak.ssim_matrix(img, img, chunk=1).shape == (1, 1)


def test_psnr_matrix_is_pairwise_mse_in_decibels() -> None:
    a, b = smooth_images(3, seed=2), smooth_images(4, seed=3)
    direct = [[10 * np.log10(1 / np.mean((x - y) ** 2)) for y in b] for x in a]
    np.testing.assert_allclose(leak.psnr_matrix(a, b), direct, rtol=1e-9)
    assert leak.psnr_matrix(a, a)[0, 0] == pytest.approx(100.0)  # identical: capped, not infinite


def test_matching_pairs_each_reconstruction_with_its_image_one_to_one() -> None:
    rng = np.random.default_rng(4)
    imgs = smooth_images(6, seed=4)
    order = rng.permutation(6)
    rec = np.clip(imgs[order] + rng.normal(0, 0.03, imgs.shape), 0, 1)
    assert leak.match(leak.psnr_matrix(rec, imgs)).tolist() == order.tolist()
    # one to one: a reconstruction between two images cannot take both
    scores = np.array([[10.0, 9.0], [10.0, 1.0]])
    assert leak.match(scores).tolist() == [1, 0]


def test_a_mosaic_of_the_devices_images_scores_on_patches_not_on_whole_images() -> None:
    own = smooth_images(2, size=16, seed=6)
    pool = smooth_images(20, size=16, seed=7)
    mosaic = own[:1].copy()
    mosaic[:, 8:] = own[1:, 8:]  # top half of one image, bottom half of the other
    assert leak.patch_psnr(mosaic, own)[0] == pytest.approx(100.0)
    assert leak.patch_psnr(mosaic, pool)[0] < 40
    assert leak.psnr_matrix(mosaic, own).max() < 40


def test_moments_are_the_devices_eval_mode_features_through_the_wire() -> None:
    """The edge sees what a device sends: BatchNorm on its running statistics (eval mode)."""
    from splitedge.methods.data.datasets import load_dataset

    _, _, info = load_dataset("digits")
    net = leak.build_network("cnn", info, seed=0, width=4)
    net.wc.block1.bn.running_mean.fill_(0.5)  # train-mode batch statistics would ignore this
    wc = leak.frozen(net.wc)
    assert not wc.training and not any(p.requires_grad for p in wc.parameters())
    imgs = (smooth_images(3) * 255).astype(np.uint8)
    mean, var = leak.observed_moments(wc, imgs, label=3, info=info)
    from splitedge.methods.data.preprocess import to_input

    with torch.no_grad():
        feats = wc(torch.from_numpy(to_input(imgs, info.mean, info.std))).reshape(3, -1).double().numpy()
    np.testing.assert_allclose(mean, feats.mean(0), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(var, feats.var(0, ddof=1), rtol=1e-5, atol=1e-6)


def cell(count: int, leaks: bool, state: str = "random") -> dict:
    return {"model": "cnn", "state": state, "count": count, "leaks": leaks}


def test_the_safe_count_is_where_no_larger_count_leaks_any_more() -> None:
    cells = [cell(1, True), cell(2, True), cell(5, False), cell(10, True), cell(50, False),
             cell(1, True, "trained"), cell(2, False, "trained"), cell(5, False, "trained"),
             cell(1, True, "x"), cell(5, True, "x")]
    assert leak.safe_count(cells) == {"cnn/random": 50, "cnn/trained": 2, "cnn/x": None}
    assert "test larger counts" in leak.verdict(cells)
    assert "Suggested minimum count per class: 50" in leak.verdict(cells[:8])


def test_the_suite_runs_through_the_bench_cli_and_writes_well_formed_results(tmp_path: Path) -> None:
    from splitedge.cli import main

    assert main(["bench", "leak", "--quick", "--out", str(tmp_path), "--model", "cnn", "--wc", "random,trained",
                 "--counts", "1,2", "--trials", "2", "--steps", "20", "--max-train", "200", "--max-test", "100"]) == 0
    doc = json.loads((tmp_path / "leak.json").read_text())
    res = doc["results"]
    assert doc["config"]["counts"] == [1, 2] and doc["config"]["attack"]["steps"] == 20
    assert [(r["state"], r["count"], r["trial"]) for r in res["trials"]] == [
        (s, c, t) for s in ("random", "trained") for c in (1, 2) for t in (0, 1)]
    for r in res["trials"]:
        assert len(r["own_psnr"]) == len(r["off_psnr"]) == len(r["own_ssim"]) == r["count"]
        assert sorted(r["matched"]) == list(range(r["count"]))
        assert all(np.isfinite(v) and -1 <= s <= 1 for v, s in zip(r["own_psnr"], r["own_ssim"]))
        assert r["pool"] > 0
    assert 0 < res["networks"]["cnn/trained"]["test_accuracy"] <= 1
    example = res["examples"]["cnn"]["2"]["trained"]
    assert leak.decode(example["recon"]).shape == leak.decode(example["device"]).shape == (2, 8, 8, 1)
    md = (tmp_path / "leak.md").read_text()
    assert md.splitlines()[2].startswith("- command: `splitedge bench leak --quick")
    assert "## Verdict" in md and "| `cnn` | trained | 2 | 2 |" in md
    assert (tmp_path / "leak.png").exists() and (tmp_path / "leak-cnn.png").exists()


def test_settings_refuse_cifar_files_for_digits_and_unknown_states() -> None:
    import argparse

    from splitedge.bench.cli import add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    with pytest.raises(ValueError, match="--dataset cifar10"):
        LeakSettings.from_args(p.parse_args(["leak", "--data", "x.tar.gz"]))
    with pytest.raises(ValueError, match="--wc"):
        LeakSettings.from_args(p.parse_args(["leak", "--wc", "random,final"]))
    s = LeakSettings.from_args(p.parse_args(["leak", "--dataset", "cifar10"]))
    assert s.counts == (1, 2, 5, 10, 50) and s.states == ("random", "trained") and s.models == ("cnn", "fedcnn")
