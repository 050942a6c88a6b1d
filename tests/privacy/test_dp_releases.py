"""Differentially private releases on the devices (methods/privacy/release.py): with `dp_sigma`
> 0 every statistic and weight update a device of fedavg, H-SFP, FedProto or CFLHKD sends is
clipped and noised,
each release is counted, and the cloud reports the epsilon they spend; a method without a
private form, or a clip left unset, is refused before round 1."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from splitedge.methods.config import ModelSpec
from splitedge.methods.contract import DeviceContext
from splitedge.methods.moments import compute_moments
from splitedge.methods.privacy.accountant import epsilon
from splitedge.methods.privacy.release import capped_counts, fit_to_hello, private_weights
from splitedge.methods.registry import create_method, default_config
from splitedge.sim import SimSettings, run_sim

CLIPS = {"dp_clip": 20.0, "dp_head_clip": 1.0, "dp_update_clip": 20.0}


def _sim(url: str, run: str, out: Path, method: str, sigma: float, rounds: int = 3, **extra) -> list[dict]:
    torch.set_num_threads(1)
    overrides = {"dp_sigma": sigma, **CLIPS, **extra} if sigma else dict(extra)
    s = SimSettings(rounds=rounds, devices=4, edges=2, broker=url, run=run, out=out, method=method,
                    backends=("torch", "onnx") if method.startswith("hsfp") else ("torch",),
                    max_train=800, max_test=300, deadline_s=60.0, overrides=overrides)
    run_sim(s)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_releases_keep_to_what_the_hello_said() -> None:
    labels = np.array([0, 0, 0, 2, 2, 5])
    classes, counts = np.array([0, 1, 2, 5, 7]), np.array([3, 4, 1, 2, 9])
    # class 1 and 7 are not held (noise let them through): never sent; the floor sees noisy counts
    assert fit_to_hello(classes, counts, labels, 1).tolist() == [True, False, True, True, False]
    assert fit_to_hello(classes, counts, labels, 2).tolist() == [True, False, False, True, False]
    capped = capped_counts(np.array([5, 1, 3]), 6)
    assert capped.sum() <= 6 and (capped >= 1).all()
    assert capped_counts(np.array([2, 3]), 6).tolist() == [2, 3]


def test_a_private_update_is_clipped_noised_and_counted() -> None:
    m = create_method("fedavg", default_config("fedavg", ModelSpec(), dp_sigma=0.5, dp_update_clip=1.0))
    part = m.device_part(DeviceContext("d0", m, np.random.default_rng(0)),
                         (np.zeros((4, 8, 8, 1), np.uint8), np.arange(4)), "torch")
    start = {"w": np.zeros(1000, np.float32), "n": np.array(3, np.int64), "bn.running_var": np.ones(4, np.float32)}
    trained = {"w": np.full(1000, 10.0, np.float32), "n": np.array(9, np.int64),
               "bn.running_var": np.full(4, 7.0, np.float32)}
    a, b = private_weights(part, trained, start), private_weights(part, trained, start)
    assert part.dp_releases == 2 and a["n"] == 3  # a count of batches is the start's
    assert (a["bn.running_var"] == 1).all()  # the device's feature statistics are not sent at all
    assert not np.array_equal(a["w"], b["w"])  # fresh noise each release, from the OS
    # the update (norm 316) is clipped to 1: the mean shift is 1/sqrt(1000) per coordinate, the
    # noise sd 2 * 0.5 * 1 = 1
    assert abs(float(a["w"].mean()) - 1 / np.sqrt(1000)) < 0.15 and 0.8 < float(a["w"].std()) < 1.2


@pytest.mark.parametrize("method, settings, message", [
    ("scaffold", {"dp_sigma": 1.0}, "dp_update_clip > 0"),
    ("splitfed", {"dp_sigma": 1.0, "dp_update_clip": 1.0}, "no differentially private form"),
    ("fedproto", {"dp_sigma": 1.0, "dp_unit": "sample", "dp_grad_clip": 1.0, "dp_sample_rate": 0.1}, "dp_clip > 0"),
    ("cflhkd", {"dp_sigma": 1.0, "dp_clip": 1.0}, "dp_update_clip > 0"),
    ("fedavg", {"dp_sigma": 1.0}, "dp_update_clip > 0"),
    ("hsfp", {"dp_sigma": 1.0, "dp_update_clip": 1.0}, "dp_clip > 0"),
    ("hsfp-cal", {"dp_sigma": 1.0, "dp_clip": 1.0, "dp_update_clip": 1.0}, "dp_head_clip > 0"),
])
def test_a_run_dp_cannot_cover_is_refused_before_round_1(method: str, settings: dict, message: str) -> None:
    from splitedge.cloud.options import build_run_config
    from splitedge.methods.data.datasets import load_dataset

    info = load_dataset("digits", max_train=10, max_test=10)[2]
    with pytest.raises(ValueError, match=message):
        build_run_config(method, info, None, 0, settings)


def test_a_private_federation_counts_its_releases_and_reports_epsilon(mosquitto, tmp_path) -> None:
    # hsfp-cal with torch and thin devices: moments (every ic = 2 rounds), W_c updates on the
    # averaging rounds and head statistics in every calibration phase, each one release
    # (and, with dp_bn_clip, W_c's BatchNorm statistics with each W_c update: torch and thin)
    records = _sim(mosquitto.url, "dp-hsfp", tmp_path / "hsfp", "hsfp-cal", 1.0, rounds=4, ic=2, dp_bn_clip=50.0)
    totals = [r["dp_releases_total"] for r in records]
    assert totals == sorted(totals) and totals[0] >= 2, totals  # round 1: moments and head statistics
    assert all(r.get("calibration_dp_releases") == 1 for r in records), records
    for r in records:
        assert r["dp_epsilon"] == pytest.approx(epsilon(1.0, r["dp_releases_total"], 1e-5))
        assert not any(r["rejected"].get(edge) for edge in ("e0", "e1")), r["rejected"]  # fitted to the hellos
    assert records[-1]["dp_epsilon"] > records[0]["dp_epsilon"]


@pytest.mark.parametrize("method, per_round, extra", [("cflhkd", 2, {}), ("cflhkd", 3, {"dp_bn_clip": 50.0}),
                                                     ("scaffold", 1, {})])
def test_cflhkd_and_scaffold_release_privately(mosquitto, tmp_path, method: str, per_round: int,
                                                        extra: dict) -> None:
    # (FedProto releases only under DP-SGD: tests/privacy/test_dp_sgd.py) CFLHKD: its mean logits and its model update
    # (the clustering signal is computed from the noised update, so it costs nothing more), and
    # with dp_bn_clip the model's BatchNorm statistics; SCAFFOLD: its model update (its control
    # variate follows from the noised model it sent)
    records = _sim(mosquitto.url, f"dp-{method}", tmp_path / method, method, 1.0, **extra)
    assert [r["dp_releases_total"] for r in records] == [per_round * r["round"] for r in records], records
    for r in records:
        assert r["dp_epsilon"] == pytest.approx(epsilon(1.0, r["dp_releases_total"], 1e-5))
        assert not any(r["rejected"].get(edge) for edge in ("e0", "e1")), r["rejected"]  # fitted to the hellos
    assert np.isfinite(records[-1]["accuracy"])


def test_negligible_noise_changes_little_and_moments_stay_exact_in_their_counts(mosquitto, tmp_path) -> None:
    clean = _sim(mosquitto.url, "dp-clean", tmp_path / "clean", "hsfp-cal", 0.0)
    quiet = _sim(mosquitto.url, "dp-quiet", tmp_path / "quiet", "hsfp-cal", 1e-4)
    assert quiet[-1]["accuracy_calibrated"] > clean[-1]["accuracy_calibrated"] - 0.1, (quiet[-1], clean[-1])
    assert quiet[-1]["accuracy"] > 0.5 and quiet[-1]["calibrated"] == clean[-1]["calibrated"]
    assert "dp_epsilon" not in clean[-1]


def test_noisy_moments_with_no_noise_are_the_exact_ones() -> None:
    from splitedge.methods.privacy.release import PrivateSums, private_moments

    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(300, 16)), rng.integers(0, 3, 300)
    m = create_method("hsfp", default_config("hsfp", ModelSpec(num_classes=5), dp_sigma=1e-12, dp_clip=1e6))
    part = m.device_part(DeviceContext("d0", m, rng), (np.zeros((300, 8, 8, 1), np.uint8), y), "onnx")
    acc = PrivateSums(16, part=part, clip=1e6, second="class", adapter=private_moments(part, y))
    acc.add(x, y)
    got, want = acc.result(), compute_moments(x, y)
    assert got.classes.tolist() == want.classes.tolist() and (got.counts == want.counts).all()
    np.testing.assert_allclose(got.mean, want.mean, rtol=1e-6, atol=1e-6)
    assert part.dp_releases == 1


def test_under_dp_the_owner_s_stricter_floor_applies_to_the_noisy_counts() -> None:
    from splitedge.methods.privacy.release import PrivateSums, private_moments

    rng = np.random.default_rng(1)
    y = np.array([0] * 30 + [1] * 3)
    x = rng.normal(size=(len(y), 4))
    m = create_method("hsfp", default_config("hsfp", ModelSpec(num_classes=3), dp_sigma=1e-12, dp_clip=1e6,
                                             min_class_count=1))
    for own, classes in ((1, [0, 1]), (5, [0])):
        part = m.device_part(DeviceContext("d0", m, rng, min_class_count=own), (np.zeros((len(y), 8, 8, 1), np.uint8), y),
                             "onnx")
        acc = PrivateSums(4, part=part, clip=1e6, second="class", adapter=private_moments(part, y))
        acc.add(x, y)
        assert acc.result().classes.tolist() == classes
        # what the floor left out is reported as without DP, from the release's noisy counts
        assert part.withheld == ({} if own == 1 else {"classes": 1, "samples": 3}), part.withheld


def _norm_inputs(model: torch.nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """Every BatchNorm layer's input over the whole batch, in eval mode (the reference)."""
    seen: dict[str, torch.Tensor] = {}
    hooks = [m.register_forward_pre_hook(lambda _m, a, n=n: seen.__setitem__(n, a[0].double()))
             for n, m in model.named_modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    with torch.inference_mode():
        model.eval()(x)
    for h in hooks:
        h.remove()
    return seen


def test_released_batchnorm_statistics_without_noise_are_the_layers_input_moments() -> None:
    from splitedge.methods.privacy.norm_stats import VAR_FLOOR, released_norm_statistics
    from splitedge.methods.torch_utils import build_split, norm_input_moments

    model = build_split(ModelSpec(model="cnn", num_classes=10, channels=3, image_size=32, mean=(0.5,) * 3,
                                  std=(0.25,) * 3))
    x = torch.randn(70, 3, 32, 32)
    layout, vectors = norm_input_moments(model, (x[i:i + 32] for i in range(0, 70, 32)))
    assert [len(v) for v in vectors] == [32, 32, 6] and len(layout) >= 2
    stats = released_norm_statistics(vectors, layout, clip=1e9, sigma=0.0)
    for name, inputs in _norm_inputs(model, x).items():  # every layer's mean and biased variance over N, H, W
        dims = (0, 2, 3) if inputs.dim() == 4 else (0,)
        np.testing.assert_allclose(stats[f"{name}.running_mean"], inputs.mean(dims).numpy(), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(stats[f"{name}.running_var"], np.maximum(inputs.var(dims, unbiased=False).numpy(),
                                                                            VAR_FLOOR), rtol=1e-4, atol=1e-6)
    noisy = released_norm_statistics(vectors, layout, clip=1.0, sigma=5.0, rng=np.random.default_rng(0))
    assert all((v >= VAR_FLOOR).all() for k, v in noisy.items() if k.endswith("running_var"))
    assert not np.allclose(noisy[f"{layout[0][0]}.running_mean"], stats[f"{layout[0][0]}.running_mean"])


def test_a_private_update_carries_released_batchnorm_statistics_counted_as_a_release() -> None:
    m = create_method("fedavg", default_config("fedavg", ModelSpec(), dp_sigma=1e-9, dp_update_clip=1.0,
                                               dp_bn_clip=100.0))
    rng = np.random.default_rng(0)
    part = m.device_part(DeviceContext("d0", m, rng), (rng.integers(0, 17, (40, 8, 8, 1), dtype=np.uint8),
                                                      np.arange(40) % 10), "torch")
    from splitedge.methods.privacy.norm_stats import VAR_FLOOR
    from splitedge.methods.torch_utils import build_split, input_batches, private_norms
    from splitedge.models import load_numpy_state, state_to_numpy

    start = state_to_numpy(part.model)
    norms = private_norms(part, part.model, input_batches(part.x))
    sent = private_weights(part, start, start, norms)
    assert part.dp_releases == 2 and norms  # the statistics (one release for all layers), then the update
    served = build_split(part.spec)
    load_numpy_state(served, sent)
    for name, inputs in _norm_inputs(served, part.x).items():  # each layer's input in the served model has them
        assert not np.allclose(sent[f"{name}.running_mean"], start[f"{name}.running_mean"])  # learned, not as received
        np.testing.assert_allclose(sent[f"{name}.running_mean"], inputs.mean((0, 2, 3)).numpy(), atol=1e-4)
        var = np.maximum(inputs.var((0, 2, 3), unbiased=False).numpy(), VAR_FLOOR)
        np.testing.assert_allclose(sent[f"{name}.running_var"], var, rtol=1e-3, atol=1e-4)
    m = create_method("fedavg", default_config("fedavg", ModelSpec(), dp_sigma=1e-9, dp_update_clip=1.0))
    part = m.device_part(DeviceContext("d0", m, rng), (np.zeros((4, 8, 8, 1), np.uint8), np.arange(4)), "torch")
    assert private_norms(part, part.model, input_batches(part.x)) == {} and part.dp_releases == 0  # dp_bn_clip 0


def test_under_dp_fedavg_s_own_head_learns_only_with_released_batchnorm_statistics(mosquitto, tmp_path) -> None:
    # at negligible noise: without the statistics' release the served model keeps BatchNorm's
    # initial statistics and its own head lags far behind (0.46 against 0.94 when written);
    # with it, it learns as without DP, in every round (released on the received statistics,
    # round 2 sat at chance)
    frozen = _sim(mosquitto.url, "dp-bn-off", tmp_path / "off", "fedavg", 1e-4)
    learned = _sim(mosquitto.url, "dp-bn-on", tmp_path / "on", "fedavg", 1e-4, dp_bn_clip=1e3)
    assert learned[-1]["accuracy"] > max(0.8, frozen[-1]["accuracy"] + 0.2), (frozen[-1], learned[-1])
    assert min(r["accuracy"] for r in learned) > 0.5, learned
    assert [r["dp_releases_total"] for r in learned] == [2 * r["round"] for r in learned]


def test_a_thin_device_releases_the_batchnorm_statistics_a_torch_device_does() -> None:
    from types import SimpleNamespace

    from splitedge.methods.thin import norms as thin_norms
    from splitedge.methods.thin.wc_models import thin_wc
    from splitedge.methods.torch_utils import build_split, private_norms
    from splitedge.models import state_to_numpy

    wc = build_split(ModelSpec(model="cnn", num_classes=10, channels=3, image_size=32, mean=(0.5,) * 3,
                               std=(0.25,) * 3)).wc
    with torch.no_grad():  # statistics unlike the initial ones, so that the layer order matters
        for name, b in wc.named_buffers():
            if name.endswith("running_mean"):
                b.normal_()
    x = np.random.default_rng(1).normal(size=(50, 3, 32, 32)).astype(np.float32)
    part = lambda: SimpleNamespace(cfg=SimpleNamespace(dp_sigma=1e-12, dp_bn_clip=1e4), dp_releases=0)  # noqa: E731
    torch_part, thin_part = part(), part()
    by_torch = private_norms(torch_part, wc, lambda: (torch.from_numpy(x[i:i + 16]) for i in range(0, 50, 16)))
    by_thin = thin_norms.private_norms(thin_part, thin_wc("cnn", 3), state_to_numpy(wc),
                                       lambda: (x[i:i + 16] for i in range(0, 50, 16)))
    assert sorted(by_thin) == sorted(by_torch) and len(by_thin) >= 4
    assert torch_part.dp_releases == thin_part.dp_releases == 1
    for k in by_torch:
        np.testing.assert_allclose(by_thin[k], by_torch[k], rtol=1e-4, atol=1e-5)


def test_a_device_that_hides_its_classes_announces_none_and_its_release_keeps_what_the_noise_lets_through() -> None:
    """Under DP the hello's class list would put the classes held in the clear: with
    hide_classes the hello names none (the edge then allows any class), and a release keeps
    every class whose noisy count passes the floor, held or not (post-processing of the release
    alone); without it, only the classes held."""
    from splitedge.methods.privacy.release import _fitted
    from splitedge.protocol.schema import validate_body
    from splitedge.runtime.allowance import Allowance

    hello = validate_body("hello", {"role": "device", "parent": "e0", "samples": 30, "backend": "onnx"})
    assert hello.get("classes") is None and Allowance.of_hello(hello).classes is None
    labels = np.array([0] * 20 + [2] * 10)
    classes, counts = np.arange(4), np.array([21, 2, 9, 0])  # noise let class 1 through, hid class 3
    m = create_method("hsfp", default_config("hsfp", ModelSpec(num_classes=4), dp_sigma=1.0, dp_clip=1.0,
                                             min_class_count=1))
    kept = {}
    for hide in (False, True):
        part = m.device_part(DeviceContext("d0", m, np.random.default_rng(0), hide_classes=hide),
                             (np.zeros((len(labels), 8, 8, 1), np.uint8), labels), "onnx")
        rows, sent = _fitted(part, labels, classes, counts)
        kept[hide] = (classes[rows].tolist(), part.withheld)
        assert sent.tolist() == counts[rows].tolist()  # the noisy counts as released: 32 > 30 images (issue 53)
    assert kept[False] == ([0, 2], {}), kept
    assert kept[True] == ([0, 1, 2], {"classes": 1, "samples": 0}), kept  # class 3 announced, hidden by the noise
    # more classes through the noise than the device has images: all of them, as released (the
    # true count of 2 images is no bound the release may know)
    few = m.device_part(DeviceContext("d1", m, np.random.default_rng(0), hide_classes=True),
                        (np.zeros((2, 8, 8, 1), np.uint8), np.array([0, 0])), "onnx")
    rows, sent = _fitted(few, np.array([0, 0]), classes, np.array([3, 7, 7, 5]))
    assert classes[rows].tolist() == [0, 1, 2, 3] and sent.tolist() == [3, 7, 7, 5]


def test_a_simulated_private_run_hides_its_devices_classes() -> None:
    from splitedge.sim import private_run

    assert private_run(SimSettings(overrides={"dp_sigma": "0.5"})) and not private_run(SimSettings())



def test_fedmar_s_private_latent_is_taken_by_the_encoder_it_received_and_it_keeps_what_it_released() -> None:
    # The mean latent is a statistic of the device's images: bounded at one image only when taken by
    # an encoder that is a function of releases (the one the round starts from), not by the one it
    # then trains on those images (docs/privacy.md, "The privacy unit"). After the round the device
    # holds the update it released, so the next round's encoder is again a function of releases.
    from splitedge.models import state_to_numpy

    cfg = default_config("fedmar", ModelSpec(), dp_sigma=1e-9, dp_clip=1e6, dp_update_clip=1e6, patch=2, vit_dim=16,
                         vit_depth=1, vit_heads=2, decoder_dim=8, decoder_depth=1, local_epochs=2)
    m = create_method("fedmar", cfg)
    rng = np.random.default_rng(0)
    part = m.device_part(DeviceContext("d0", m, rng), (rng.integers(0, 255, (40, 8, 8, 1), dtype=np.uint8),
                                                     np.zeros(40, dtype=np.int64)), "torch")
    start, seen = state_to_numpy(part.model), []
    latent = part.private_latent
    part.private_latent = lambda: (seen.append(state_to_numpy(part.model)), latent())[1]
    body = part.released_round()
    assert len(seen) == 1 and all(np.array_equal(seen[0][k], start[k]) for k in start)
    trained = [k for k in start if not np.array_equal(body["weights"][k], start[k])]
    assert trained, "the round trained nothing"
    held = state_to_numpy(part.model)
    assert all(np.array_equal(held[k], body["weights"][k]) for k in held)
    assert part.mean_latent is not None and part.dp_releases == 2
