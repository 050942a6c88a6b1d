"""How much a device's per-class feature statistics leak its images (issue 32, item 1).

An H-SFP device sends, per class it holds, the count, the mean and the unbiased variance of
the flattened W_c features of its (normalised) images of that class; the edge knows W_c. This
suite plays that edge: for a class held `count` times on a device it optimises `count`
candidate images (the count travels in the clear) so that the mean of W_c over them matches
the observed mean and, from two images on, their variance matches the observed variance, with
a total-variation prior; Adam on pixels through a sigmoid box, parametrised at several scales
(coarse structure first: single-scale pixels get stuck in noisy local optima). W_c is taken in
eval mode, as devices take moments (methods/hsfp/device_torch.py), and the moments go through
the wire dtype (f4) as they would on the wire.

Scores (pixels in [0, 1]): PSNR and SSIM of each reconstruction against
  own:  the device's image it is matched to (Hungarian matching on PSNR, one to one);
  off:  the nearest image (by that score) in a pool of images of the same class NOT on the
        device, so a generic class-looking image does not count as a leak;
  mean: the data set's mean image against the device's images (a trivial guess);
  patch: per 8x8 patch, the best same-position patch of the device's images vs of the pool,
        because statistics of a convolution cannot tell which image a local patch came from
        and reconstructions of two or more images come out as mosaics of them.
A (model, W_c, count) cell leaks when, over its trials, own beats off on average on any of
whole-image PSNR, SSIM or patch PSNR; the suggested minimum count per class is the smallest
tested count from which no cell leaks any more.

W_c: "random" is the initial W_c of the run's seed (what devices use in round 1); "trained" is
that network trained centrally on a subset of the training images for a couple of epochs
(FedAvg's optimiser), its test accuracy reported beside it.
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from splitedge.bench.lib.plotstyle import Series, draw, new_figure
from splitedge.bench.lib.report import Progress, save_figure, table

MODELS = ("cnn", "fedcnn")
STATES = ("random", "trained")
COUNTS = (1, 2, 5, 10, 50)
WIRE_DTYPE = "f4"  # H-SFP's default feature_dtype: what the edge receives
SHOWN = 3  # device images per row of the picture
PATCHES = 4  # patches per side for the patch score (8x8 on CIFAR-10)
SCORES = (("PSNR", "own_psnr", "off_psnr"), ("SSIM", "own_ssim", "off_ssim"),
          ("patch PSNR", "patch_own_psnr", "patch_off_psnr"))
"""The scores a cell leaks on when own beats off-device on average: (name, own key, off key)."""


@dataclass
class AttackSettings:
    """The edge's optimiser: what it tries per class; the same for every cell."""

    steps: int = 1000
    lr: float = 0.05
    tv: float = 0.03  # weight of the total-variation prior (pixels in [0, 1])
    init_sd: float = 0.05  # spread of the random start around mid-grey (logit units, per scale)


@dataclass
class LeakSettings:
    dataset: str = "cifar10"
    data: str | None = None
    models: tuple[str, ...] = MODELS
    states: tuple[str, ...] = STATES
    counts: tuple[int, ...] = COUNTS
    trials: int = 5
    pool: int = 500  # off-device images of the class to compare with
    seed: int = 0
    train_images: int = 10000  # the trained W_c's training subset
    train_epochs: int = 2
    max_test: int = 2000  # images the trained network's accuracy is measured on
    width: int | None = None  # the model's width (None: the registry's default); tests use a tiny one
    attack: AttackSettings = dataclasses.field(default_factory=AttackSettings)

    @classmethod
    def from_args(cls, a: argparse.Namespace) -> LeakSettings:
        if a.data is not None and a.dataset != "cifar10":
            raise ValueError("--data names CIFAR-10 files: add --dataset cifar10")
        states = tuple(a.wc) if a.wc else STATES
        unknown = [s for s in states if s not in STATES]
        if unknown:
            raise ValueError(f"--wc: {unknown}; pick from {', '.join(STATES)}")
        counts = tuple(int(v) for v in a.counts) if a.counts else ((1, 2, 5) if a.quick else COUNTS)
        if any(c < 1 for c in counts):
            raise ValueError(f"--counts must be >= 1, got {counts}")
        steps = a.steps or (200 if a.quick else AttackSettings.steps)
        return cls(dataset=a.dataset, data=a.data, models=(a.model,) if a.model else MODELS, states=states,
                   counts=counts, trials=a.trials or (2 if a.quick else 5), pool=200 if a.quick else 500,
                   seed=a.seed, train_images=a.max_train or (2000 if a.quick else 10000),
                   train_epochs=1 if a.quick else 2, max_test=a.max_test or (500 if a.quick else 2000),
                   attack=AttackSettings(steps=steps))


# -- the device's side -------------------------------------------------------------------------

def build_network(model: str, info: Any, seed: int, width: int | None = None) -> nn.Module:
    """The run's split network from `seed`, as build_split makes it for round 1 (its W_c is
    what devices take moments with before any training)."""
    from splitedge.models import create_split, seeded_init

    with seeded_init(seed):
        return create_split(model, num_classes=info.num_classes, in_channels=info.channels,
                            image_size=info.image_size, **({"width": width} if width else {}))


def frozen(module: nn.Module) -> nn.Module:
    """W_c as the edge uses it: eval mode (BatchNorm on running statistics, as devices take
    moments) and no parameter gradients (only the candidate images are optimised)."""
    module.eval()
    for p in module.parameters():
        p.requires_grad_(False)
    return module


def observed_moments(wc: nn.Module, images: np.ndarray, label: int, info: Any) -> tuple[np.ndarray, np.ndarray]:
    """(mean, var) of one class as the edge receives them: the device's moments code on the
    flattened eval-mode W_c features of its normalised images, through the wire dtype."""
    from splitedge.methods.data.preprocess import to_input
    from splitedge.methods.moments import compute_moments, moments_from_body, moments_to_body

    with torch.inference_mode():
        feats = wc(torch.from_numpy(to_input(images, info.mean, info.std))).reshape(len(images), -1).numpy()
    m = compute_moments(feats, np.full(len(images), label, dtype=np.int64))
    m = moments_from_body(moments_to_body(m, WIRE_DTYPE))
    return m.mean[0], m.var[0]


# -- the edge's side: the attack ---------------------------------------------------------------

def scales(size: int) -> tuple[int, ...]:
    """Side lengths of the image's parametrisation: size/8, size/4, size/2 and size (at least
    2 pixels), each upsampled and summed, so coarse structure moves before fine noise does."""
    return tuple(sorted({max(2, size // d) for d in (8, 4, 2)} | {size}))


def total_variation(p: torch.Tensor) -> torch.Tensor:
    """Mean absolute difference of neighbouring pixels: the image prior against noise."""
    return (p[..., 1:, :] - p[..., :-1, :]).abs().mean() + (p[..., :, 1:] - p[..., :, :-1]).abs().mean()


def invert(wc: nn.Module, mean: np.ndarray, var: np.ndarray, count: int, *, shape: tuple[int, int, int],
           norm_mean: Sequence[float], norm_std: Sequence[float], attack: AttackSettings,
           seed: int) -> tuple[np.ndarray, dict[str, float]]:
    """`count` images [count, H, W, C] in [0, 1] whose W_c features have the observed per-class
    mean (and, for count >= 2, unbiased variance); also the final relative residuals. The
    residuals are relative squared errors, so the mean and variance terms weigh alike whatever
    the features' scale."""
    c, h, w = shape
    gen = torch.Generator().manual_seed(seed)
    params = [(attack.init_sd * torch.randn(count, c, s, s, generator=gen)).requires_grad_(True) for s in scales(h)]
    opt = torch.optim.Adam(params, lr=attack.lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, max(1, attack.steps))
    mu = torch.from_numpy(np.asarray(mean, dtype=np.float32))
    v = torch.from_numpy(np.asarray(var, dtype=np.float32))
    m_t = torch.tensor(norm_mean, dtype=torch.float32).view(1, -1, 1, 1)
    s_t = torch.tensor(norm_std, dtype=torch.float32).view(1, -1, 1, 1)
    mu_norm, v_norm = mu.square().sum().clamp_min(1e-12), v.square().sum().clamp_min(1e-12)

    def images() -> torch.Tensor:
        z = sum(F.interpolate(p, size=(h, w), mode="bilinear", align_corners=False) if p.shape[-1] != w else p
                for p in params)
        return torch.sigmoid(z)

    def residuals(p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        f = wc((p - m_t) / s_t).reshape(count, -1)
        res_mean = (f.mean(0) - mu).square().sum() / mu_norm
        res_var = (f.var(0) - v).square().sum() / v_norm if count > 1 else torch.zeros(())
        return res_mean, res_var

    for _ in range(attack.steps):
        p = images()
        res_mean, res_var = residuals(p)
        loss = res_mean + res_var + attack.tv * total_variation(p)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    with torch.no_grad():
        p = images()
        res_mean, res_var = residuals(p)
    return p.permute(0, 2, 3, 1).numpy().astype(np.float64), {"mean": float(res_mean), "var": float(res_var)}


# -- scores ------------------------------------------------------------------------------------

def psnr_matrix(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """PSNR (dB, peak 1) of every image of `a` [n, ...] against every image of `b` [m, ...]."""
    a2, b2 = a.reshape(len(a), -1), b.reshape(len(b), -1)
    mse = (np.square(a2).sum(1)[:, None] + np.square(b2).sum(1)[None] - 2 * a2 @ b2.T) / a2.shape[1]
    return 10 * np.log10(1.0 / np.maximum(mse, 1e-10))


def _window(size: int) -> torch.Tensor:
    """The 1-d Gaussian of SSIM (sigma 1.5, 11 taps; fewer, odd, on images smaller than 11)."""
    taps = min(11, size - (1 - size % 2))
    x = torch.arange(taps, dtype=torch.float64) - (taps - 1) / 2
    g = torch.exp(-x.square() / (2 * 1.5 ** 2))
    return g / g.sum()


def _blur(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """Separable Gaussian filter of [N, C, H, W] maps, valid region only."""
    c = x.shape[1]
    x = F.conv2d(x, g.view(1, 1, 1, -1).expand(c, 1, 1, -1), groups=c)
    return F.conv2d(x, g.view(1, 1, -1, 1).expand(c, 1, -1, 1), groups=c)


def ssim_matrix(a: np.ndarray, b: np.ndarray, chunk: int = 512) -> np.ndarray:
    """SSIM (Wang et al. 2004: Gaussian window, K1 0.01, K2 0.03, peak 1, per channel, averaged)
    of every image of `a` [n, H, W, C] against every image of `b` [m, H, W, C]. The local means
    and variances are filtered once per image; only the cross term is filtered per pair."""
    ta = torch.from_numpy(np.ascontiguousarray(a.transpose(0, 3, 1, 2), dtype=np.float64))
    tb = torch.from_numpy(np.ascontiguousarray(b.transpose(0, 3, 1, 2), dtype=np.float64))
    g = _window(min(a.shape[1], a.shape[2]))
    c1, c2 = 0.01 ** 2, 0.03 ** 2
    mu_a, mu_b = _blur(ta, g), _blur(tb, g)
    var_a, var_b = _blur(ta * ta, g) - mu_a.square(), _blur(tb * tb, g) - mu_b.square()
    out = np.empty((len(a), len(b)))
    for i in range(len(a)):
        for j in range(0, len(b), chunk):
            sl = slice(j, j + chunk)
            cov = _blur(ta[i:i + 1] * tb[sl], g) - mu_a[i:i + 1] * mu_b[sl]
            num = (2 * mu_a[i:i + 1] * mu_b[sl] + c1) * (2 * cov + c2)
            den = (mu_a[i:i + 1].square() + mu_b[sl].square() + c1) * (var_a[i:i + 1] + var_b[sl] + c2)
            out[i, sl] = (num / den).mean(dim=(1, 2, 3)).numpy()
    return out


def match(scores: np.ndarray) -> np.ndarray:
    """For reconstruction i, the device image it is matched to (one to one, highest total
    score): which reconstruction stands for which image is unknown to the attacker."""
    from scipy.optimize import linear_sum_assignment

    rows, cols = linear_sum_assignment(scores, maximize=True)
    out = np.empty(len(scores), dtype=np.int64)
    out[rows] = cols
    return out


def patch_psnr(rec: np.ndarray, candidates: np.ndarray, per_side: int = PATCHES) -> np.ndarray:
    """Per reconstruction, the mean over patch positions of the best PSNR of its patch against
    the same-position patch of any candidate image: how far a mosaic of candidates explains it."""
    n, h, w = rec.shape[:3]
    ph, pw = h // per_side, w // per_side
    best = np.zeros(n)
    for r in range(per_side):
        for c in range(per_side):
            sl = (slice(None), slice(r * ph, (r + 1) * ph), slice(c * pw, (c + 1) * pw))
            best += psnr_matrix(rec[sl], candidates[sl]).max(axis=1)
    return best / per_side ** 2


def score(rec: np.ndarray, own: np.ndarray, pool: np.ndarray, mean_image: np.ndarray) -> dict[str, Any]:
    """Every score of one trial (images in [0, 1], [n, H, W, C]); `matched[i]` is the device
    image reconstruction i stands for."""
    own_psnr = psnr_matrix(rec, own)
    matched = match(own_psnr)
    idx = np.arange(len(rec))
    own_ssim = ssim_matrix(rec, own)[idx, matched]
    off_psnr, off_ssim = psnr_matrix(rec, pool).max(axis=1), ssim_matrix(rec, pool).max(axis=1)
    return {"own_psnr": own_psnr[idx, matched].tolist(), "own_ssim": own_ssim.tolist(),
            "off_psnr": off_psnr.tolist(), "off_ssim": off_ssim.tolist(),
            "patch_own_psnr": patch_psnr(rec, own).tolist(), "patch_off_psnr": patch_psnr(rec, pool).tolist(),
            "mean_image_psnr": float(psnr_matrix(mean_image[None], own).mean()),
            "mean_image_ssim": float(ssim_matrix(mean_image[None], own).mean()),
            "closer_own": float(np.mean(own_psnr[idx, matched] > off_psnr)), "matched": matched.tolist()}


# -- one run -----------------------------------------------------------------------------------

def trained_network(s: LeakSettings, model: str, train: Any, test: Any, info: Any) -> tuple[nn.Module, dict[str, Any]]:
    """The whole split network trained centrally on `train_images` training images for
    `train_epochs` epochs with FedAvg's device optimiser: a W_c that has learnt something, cheaply."""
    from splitedge.cloud.options import build_run_config
    from splitedge.methods.data.datasets import subsample
    from splitedge.methods.metrics.evaluate import evaluate
    from splitedge.methods.torch_utils import local_tensors, sgd, tensor_batches
    from splitedge.methods.training import cross_entropy_term, train_epochs

    started = time.monotonic()
    config = build_run_config("fedavg", info, model, s.seed, {})
    cfg, spec = config.method, config.model
    net = build_network(model, info, s.seed, s.width)
    x, y = local_tensors(subsample(train, seed=s.seed, max_n=s.train_images), spec)
    opt = sgd(net.parameters(), cfg.device_lr, cfg.momentum, cfg.weight_decay)
    gen = torch.Generator().manual_seed(s.seed)

    def forward(batch: Any) -> dict[str, Any]:
        features, logits = net.features_and_logits(batch.x)
        return {"features": features, "logits": logits}

    train_epochs(forward, [cross_entropy_term()], tensor_batches(x, y, cfg.device_batch, gen), opt, [net],
                 epochs=s.train_epochs)
    acc = evaluate(net, subsample(test, seed=s.seed + 1, max_n=s.max_test), spec)["accuracy"]
    return net, {"test_accuracy": acc, "train_images": int(len(y)), "epochs": s.train_epochs,
                 "test_images": min(len(test[1]), s.max_test), "seconds": time.monotonic() - started}


def device_images(train: Any, count: int, pool: int, num_classes: int, seed: int, trial: int
                  ) -> tuple[int, np.ndarray, np.ndarray]:
    """(class, the device's `count` images of it, up to `pool` other images of it): the same
    for every model and W_c of one (count, trial), so their scores compare image for image."""
    x, y = train
    rng = np.random.default_rng([seed, count, trial])
    label = int(rng.integers(num_classes))
    members = rng.permutation(np.flatnonzero(y == label))
    if len(members) < count + 1:
        raise ValueError(f"class {label} has {len(members)} images: too few for count {count}")
    return label, x[members[:count]], x[members[count:count + pool]]


def encode(images: np.ndarray) -> dict[str, Any]:
    """uint8 images as one base64 string in the JSON (a nested list would cost a line per value)."""
    arr = np.ascontiguousarray(images, dtype=np.uint8)
    return {"shape": list(arr.shape), "b64": base64.b64encode(arr.tobytes()).decode("ascii")}


def decode(blob: dict[str, Any]) -> np.ndarray:
    return np.frombuffer(base64.b64decode(blob["b64"]), dtype=np.uint8).reshape(blob["shape"])


def to_uint8(images: np.ndarray) -> np.ndarray:
    return np.clip(np.rint(images * 255.0), 0, 255).astype(np.uint8)


def one_trial(s: LeakSettings, wc: nn.Module, info: Any, train: Any, mean_image: np.ndarray, *, model: str,
              state: str, count: int, trial: int) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """One device's class: its moments, the attack, the scores; and, for trial 0, the images
    the picture shows (a few of the device's and the reconstructions matched to them)."""
    started = time.monotonic()
    label, own, pool = device_images(train, count, s.pool, info.num_classes, s.seed, trial)
    mean, var = observed_moments(wc, own, label, info)
    rec, residual = invert(wc, mean, var, count, shape=(info.channels, info.image_size, info.image_size),
                           norm_mean=info.mean, norm_std=info.std, attack=s.attack, seed=s.seed * 1000 + trial)
    scores = score(rec, own.astype(np.float64) / 255.0, pool.astype(np.float64) / 255.0, mean_image)
    row = {"model": model, "state": state, "count": count, "trial": trial, "class": label, "pool": int(len(pool)),
           "residual": residual, **scores, "seconds": time.monotonic() - started}
    if trial != 0:
        return row, None
    shown = np.arange(min(SHOWN, count))
    by_image = {int(img): i for i, img in enumerate(scores["matched"])}
    example = {"device": encode(own[shown]), "recon": encode(to_uint8(rec[[by_image[int(k)] for k in shown]]))}
    return row, example


def run(s: LeakSettings, progress: Progress | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    from splitedge.methods.data.datasets import load_dataset

    torch.set_num_threads(1)
    train, test, info = load_dataset(s.dataset, s.data, seed=s.seed)
    mean_image = train[0].mean(axis=0) / 255.0
    config = {"dataset": s.dataset, "models": list(s.models), "states": list(s.states), "counts": list(s.counts),
              "trials": s.trials, "pool": s.pool, "seed": s.seed, "train_images": s.train_images,
              "train_epochs": s.train_epochs, "width": s.width, "wire_dtype": WIRE_DTYPE,
              "attack": {**dataclasses.asdict(s.attack), "batch": "count", "scales": list(scales(info.image_size)),
                         "loss": "relative squared error of the batch mean (and unbiased variance from count 2) "
                                 "of W_c features + tv x total variation; Adam, cosine schedule, sigmoid box"},
              "image_size": info.image_size, "classes": list(info.classes)}
    results: dict[str, Any] = {"trials": [], "networks": {}, "examples": {}}
    for model in s.models:
        for state in s.states:
            if state == "trained":
                net, about = trained_network(s, model, train, test, info)
            else:
                net, about = build_network(model, info, s.seed, s.width), {}
            wc = frozen(net.wc)
            results["networks"][f"{model}/{state}"] = {**about, "wc_features": int(np.prod(net.wc_shape))}
            for count in s.counts:
                for trial in range(s.trials):
                    row, example = one_trial(s, wc, info, train, mean_image, model=model, state=state,
                                             count=count, trial=trial)
                    results["trials"].append(row)
                    if example is not None:
                        results["examples"].setdefault(model, {}).setdefault(str(count), {})[state] = example
                if progress is not None:
                    progress(config, results)
    return config, results


# -- report ------------------------------------------------------------------------------------

def cells(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Per (model, W_c, count): means over trials (and over each trial's reconstructions) of
    every score, and whether own beats off-device on any of them."""
    groups: dict[tuple[str, str, int], list[dict[str, Any]]] = {}
    for r in results["trials"]:
        groups.setdefault((r["model"], r["state"], r["count"]), []).append(r)
    out = []
    for (model, state, count), rows in groups.items():
        def avg(key: str) -> float:
            return float(np.mean([np.mean(r[key]) for r in rows]))

        cell = {"model": model, "state": state, "count": count, "trials": len(rows),
                **{k: avg(k) for k in ("own_psnr", "off_psnr", "own_ssim", "off_ssim", "patch_own_psnr",
                                       "patch_off_psnr", "mean_image_psnr", "mean_image_ssim", "closer_own")},
                "residual_mean": float(np.mean([r["residual"]["mean"] for r in rows])),
                "residual_var": float(np.mean([r["residual"]["var"] for r in rows])),
                "seconds": float(np.mean([r["seconds"] for r in rows]))}
        cell["leaks_on"] = [name for name, own, off in SCORES if cell[own] > cell[off]]
        cell["leaks"] = bool(cell["leaks_on"])
        out.append(cell)
    return out


def safe_count(cells_: list[dict[str, Any]]) -> dict[str, int | None]:
    """Per "model/W_c": the smallest tested count from which no larger tested count leaks
    (None: even the largest leaks)."""
    out: dict[str, int | None] = {}
    for key in dict.fromkeys(f"{c['model']}/{c['state']}" for c in cells_):
        rows = sorted((c for c in cells_ if f"{c['model']}/{c['state']}" == key), key=lambda c: c["count"])
        safe = None
        for c in reversed(rows):
            if c["leaks"]:
                break
            safe = c["count"]
        out[key] = safe
    return out


def verdict(cells_: list[dict[str, Any]]) -> str:
    """The plain-words answer: from which count the reconstructions stop looking like the
    device's own images more than like other images of the class."""
    per = safe_count(cells_)
    counts = sorted({c["count"] for c in cells_})
    if not per:
        return "No finished cells."
    lines = []
    for key, safe in per.items():
        leaking = [f"{c['count']}" + (f" ({', '.join(c['leaks_on'])})" if c.get("leaks_on") else "") for c in cells_
                   if f"{c['model']}/{c['state']}" == key and c["leaks"]]
        lines.append(f"- `{key}`: " + (f"no tested count is safe (leaks at {', '.join(leaking)})"
                                        if safe is None else
                                        f"closer to the device's own images at count {', '.join(leaking)}; "
                                        f"from {safe} on no closer than to other images of the class"
                                        if leaking else f"no leak at any tested count (from {safe})"))
    if any(v is None for v in per.values()):
        overall = (f"Some W_c leaks even at the largest tested count ({counts[-1]}): test larger counts before "
                   f"choosing a minimum.")
    else:
        worst = max(v for v in per.values() if v is not None)
        overall = (f"Suggested minimum count per class: {worst} (the largest of the per-W_c thresholds above). "
                   f"This attack is a lower bound on what an edge can do: it sees one W_c's moments, not several "
                   f"rounds' of changing W_c, and uses no learnt image prior.")
    return "\n".join(lines + ["", overall])


def markdown(results: dict[str, Any]) -> str:
    cs = cells(results)
    nets = results.get("networks", {})
    rows = [(f"`{c['model']}`", c["state"], c["count"], c["trials"],
             f"{c['own_psnr']:.2f} / {c['off_psnr']:.2f}", f"{c['own_ssim']:.3f} / {c['off_ssim']:.3f}",
             f"{c['patch_own_psnr']:.2f} / {c['patch_off_psnr']:.2f}", f"{100 * c['closer_own']:.0f} %",
             f"{c['mean_image_psnr']:.2f} / {c['mean_image_ssim']:.3f}",
             f"{c['residual_mean']:.2g} / {c['residual_var']:.2g}", "yes" if c["leaks"] else "no",
             f"{c['seconds']:.0f}") for c in cs]
    net_rows = [(k, v.get("wc_features"), "-" if "test_accuracy" not in v else f"{100 * v['test_accuracy']:.1f} %",
                 v.get("train_images", "-"), v.get("epochs", "-"), "-" if "seconds" not in v else f"{v['seconds']:.0f}")
                for k, v in nets.items()]
    return "\n".join([
        "## Verdict\n",
        verdict(cs),
        "",
        "## Reconstruction vs the device's own images and other images of the class\n",
        table(["model", "W_c", "count", "trials", "PSNR own / off (dB)", "SSIM own / off", "patch PSNR own / off",
               "closer to own", "mean image PSNR / SSIM", "residual mean / var", "leaks", "s per trial"], rows),
        "",
        "own: each reconstruction against the device image it is matched to (Hungarian, on PSNR); off: against the "
        "nearest image of a pool of the class's images not on the device (nearest by that score); patch: per patch "
        f"(the image cut into {PATCHES} x {PATCHES}: 8x8 pixels on CIFAR-10), the best same-position patch among the "
        "device's images / the pool's (mosaics count); closer to own: "
        "reconstructions whose own PSNR beats their off PSNR; mean image: the data set's mean image against the "
        "device's images (a trivial guess); residual: the attack's final relative error on the mean and the variance. "
        "A cell leaks when own beats off on average on PSNR, SSIM or patch PSNR. The attacker optimises `count` "
        "images (the count is sent in the clear).",
        "",
        "## W_c\n",
        table(["model/W_c", "W_c features", "test accuracy", "train images", "epochs", "s"], net_rows),
    ])


def _row_images(example: dict[str, Any], states: Sequence[str], h: int, w: int, c: int) -> np.ndarray:
    """One picture row: the device's shown images, then per W_c the reconstructions matched to
    them, each group padded to SHOWN slots and a gap between groups."""
    gap = np.full((h, w // 4, c), 255, np.uint8)

    def group(images: np.ndarray | None) -> np.ndarray:
        slots = [images[i] if images is not None and i < len(images) else np.full((h, w, c), 255, np.uint8)
                 for i in range(SHOWN)]
        return np.concatenate(slots, axis=1)

    parts = [group(decode(example["device"]) if "device" in example else None)]
    for state in states:
        parts += [gap, group(decode(example[state]["recon"]) if state in example else None)]
    return np.concatenate(parts, axis=1)


def grid(results: dict[str, Any], model: str, out: Path) -> list[Path]:
    """Rows = counts; a few of the device's images, then the reconstructions of each W_c."""
    from matplotlib.figure import Figure

    per_count = results["examples"].get(model, {})
    if not per_count:
        return []
    counts = sorted(per_count, key=int)
    states = [s for s in STATES if any(s in per_count[k] for k in counts)]
    first = next(iter(per_count[counts[0]].values()))["device"]["shape"]
    h, w, c = first[1:]
    rows = []
    for k in counts:
        ex = {**per_count[k], "device": next(iter(per_count[k].values()))["device"]}
        rows.append(_row_images(ex, states, h, w, c))
    sep = np.full((h // 4, rows[0].shape[1], c), 255, np.uint8)
    canvas = np.concatenate([x for r in rows for x in (r, sep)][:-1], axis=0)
    fig = Figure(figsize=(max(6.0, canvas.shape[1] / 40), max(3.0, canvas.shape[0] / 40)), dpi=100,
                 layout="constrained")
    ax = fig.add_subplot()
    ax.imshow(canvas.squeeze(-1) if c == 1 else canvas, cmap="gray" if c == 1 else None, interpolation="nearest")
    ax.set_yticks([i * (h + h // 4) + h / 2 for i in range(len(counts))], [f"count {k}" for k in counts])
    group_w = SHOWN * w
    centres = [group_w / 2] + [group_w + i * (group_w + w // 4) + w // 4 + group_w / 2 for i in range(len(states))]
    ax.set_xticks(centres, ["device's images"] + [f"reconstructed, {s} W_c" for s in states], fontsize=8)
    ax.tick_params(length=0)
    for side in ax.spines.values():
        side.set_visible(False)
    ax.set_title(f"{model}: a device's images of one class (first {SHOWN}) and what an edge rebuilds\n"
                 f"from their W_c mean and variance (matched to them)", fontsize=9)
    return save_figure(fig, out / f"leak-{model}.png")


def plot(results: dict[str, Any], out_dir: Path) -> list[Path]:
    """leak.png (PSNR) and leak-ssim.png: own (solid) vs nearest off-device image (dashed) per
    count; and the picture of each model (leak-<model>.png)."""
    cs = cells(results)
    paths: list[Path] = []
    counts = sorted({c["count"] for c in cs})
    for key, label, name in (("psnr", "PSNR of the reconstruction (dB)", "leak.png"),
                             ("ssim", "SSIM of the reconstruction", "leak-ssim.png")):
        curves = []
        for group in dict.fromkeys((c["model"], c["state"]) for c in cs):
            rows = sorted((c for c in cs if (c["model"], c["state"]) == group), key=lambda c: c["count"])
            x = [c["count"] for c in rows]
            curves.append(Series(f"{group[0]} {group[1]} W_c", [c[f"own_{key}"] for c in rows], x=x))
            curves.append(Series(f"{group[0]} {group[1]} W_c", [c[f"off_{key}"] for c in rows], x=x, dashed=True))
        if not curves:
            continue
        fig = new_figure(curves)
        ax = fig.axes[0]
        draw(ax, curves, xlabel="images of the class on the device", ylabel=label,
             dashed_label="nearest image not on the device")
        if len(counts) > 1:
            ax.set_xscale("log")
            ax.set_xticks(counts, [str(k) for k in counts])
        paths += save_figure(fig, out_dir / name)
    for model in results.get("examples", {}):
        paths += grid(results, model, out_dir)
    return paths


Settings = LeakSettings
