"""Sample-level differential privacy: DP-SGD on the device (`dp_unit = "sample"`). numpy only.

The unit and the neighbouring relation
--------------------------------------
Two datasets of a device are neighbours when one is the other with ONE image added or removed
(add/remove-one adjacency; the device's other images, and every other device's, are the same).

The mechanism (Abadi et al. 2016, as Opacus runs it with Poisson sampling)
-------------------------------------------------------------------------
Each step t of a round:
1. every local image joins the step's batch independently with probability q (`dp_sample_rate`),
   drawn from the OS's entropy (an observer who knew the draw would get no amplification);
2. each image's gradient g_i (of its own loss only: no BatchNorm batch statistics, no loss
   coupling images, see below) is clipped to ||g_i||_2 <= C (`dp_grad_clip`) over all the
   trained parameters at once;
3. the step's gradient is (sum_i clip(g_i) + N(0, sigma^2 C^2 I)) / B, with B = the run's
   `device_batch`, a public constant (dividing by the batch actually drawn would make the
   divisor depend on the data);
4. the optimiser (SGD, momentum, weight decay) takes it: post-processing.

Adding or removing one image changes the noiseless sum of step 2 by at most C (one clipped
term more or less; every other term is unchanged because each g_i depends on image i and the
current parameters only), so one step is the Poisson-subsampled Gaussian mechanism with rate q
and noise multiplier sigma; a round is `steps(cfg)` = ceil(local_epochs / q) of them (a public
count: it never depends on how many images the device holds), composed adaptively. The
accountant (accountant.py) composes dp-accounting's PoissonSampledDpEvent(q, Gaussian(sigma))
over every step of every round with the device's other releases.

Why each g_i depends on image i alone:
- BatchNorm normalises by the batch's statistics in training, which mixes images; under DP-SGD
  the model trains with BatchNorm frozen (eval mode: the running statistics the device received,
  public, or those it released with `dp_bn_clip`, computed on that received model); its affine
  weights still train. GroupNorm would need another network (and another thin engine); refusing
  BatchNorm would refuse every model here.
- SupCon (H-SFP's default device target) and FedDecorr are losses over the batch: one image's
  term moves every other image's gradient, so removing it changes the sum by more than C.
  Refused with DP-SGD (H-SFP trains toward the fixed simplex ETF instead, `device_target=etf`,
  a per-image cross-entropy; an image's two augmented views form one g_i).

What else a device may release, at the unit of one image
--------------------------------------------------------
The model a device sends is a function of the DP-SGD steps only (and of public inputs): free.
A statistic of the private images (moments, head statistics, prototypes, logits, BatchNorm
statistics, latents) is a separate Gaussian release whose per-image sensitivity is the clip
(dp.py) for a FIXED model f: removing x_j removes one clipped vector and moves no other. Two
cases keep f fixed where it matters:
- f is a function of releases only (the global model it received, an encoder a round starts
  from): public, as far as this device's images are concerned;
- f was trained on those images by DP-SGD. Then (steps, statistic) is an adaptive composition:
  each step is a Gaussian release given the model before it, the statistic a Gaussian release
  given the model after the last step, and RDP composes adaptively, so the pair is DP at the
  composed epsilon and the statistic alone is its post-processing. It is DP-SGD's own argument:
  every step's gradients are of a model trained on the same images.
Trained WITHOUT DP-SGD, f itself depends on every image: removing x_j moves f, hence every
f(x_i), by an amount nothing bounds (measured: 20.4 noise units against a bound of 1.41). So:
- H-SFP's moments of the global W_c, head statistics of the merged model, BatchNorm statistics
  of the received model, CFLHKD's logits of the model it received, MAR's latent by the encoder
  its round starts from: accepted (CFLHKD and MAR have no DP-SGD form, so dp_unit=device);
- FedProto's prototypes and head statistics (its personal model) and H-SFP's moments of its
  local copy (`moments_of=local`): accepted with dp_unit=sample, where that model trains by
  DP-SGD; refused in one line with dp_unit=device (`DevicePart.own_model_statistics`).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np


def steps(cfg: Any) -> int:
    """DP-SGD steps a device takes in one training round: ceil(local_epochs / q), 0 when it trains
    nothing. From the config alone, so the count says nothing about the device's data."""
    epochs = int(getattr(cfg, "local_epochs", 1))
    if epochs <= 0 or not cfg.dp_sample_rate > 0:
        return 0
    return math.ceil(epochs / cfg.dp_sample_rate - 1e-9)


def check_sample_unit(cfg: Any) -> None:
    """ValueError, in one line, for a config whose DP-SGD would not be a subsampled Gaussian
    mechanism at one image (method-independent rules; each method adds its own)."""
    if not cfg.dp_grad_clip > 0 or not 0 < cfg.dp_sample_rate <= 1:
        raise ValueError(f"dp_unit=sample (DP-SGD) needs dp_grad_clip > 0 (each image's gradient norm bound) and "
                         f"dp_sample_rate in (0, 1] (each image's chance to join a step), got {cfg.dp_grad_clip} and "
                         f"{cfg.dp_sample_rate}")
    if cfg.dp_devices > 1:
        raise ValueError("dp_unit=sample adds DP-SGD's noise on the device at every step: dp_devices > 1 (noise shared "
                         "behind secagg) is a device-level release; leave dp_devices at 1")
    if cfg.feddecorr_beta > 0:
        raise ValueError("dp_unit=sample refuses feddecorr_beta > 0: FedDecorr is a loss over the batch, so one image "
                         "moves every other image's gradient and DP-SGD's per-image clip bounds nothing")


def poisson_batch(n: int, rate: float, rng: np.random.Generator) -> np.ndarray:
    """Indices (sorted, i8) of the images a step draws: each of `n` independently with prob `rate`."""
    return np.flatnonzero(rng.random(n) < rate).astype(np.int64)


def clip_per_sample(grads: dict[str, np.ndarray], clip: float) -> dict[str, np.ndarray]:
    """Per-sample gradients {name: [N, ...]} scaled, each sample's over ALL names at once, to
    global L2 norm <= clip (float64); the clipped sum is `summed(...)`."""
    if not clip > 0:
        raise ValueError(f"clip must be > 0, got {clip}")
    n = {len(g) for g in grads.values()}
    if len(n) != 1:
        raise ValueError(f"per-sample gradients disagree on the sample count: {sorted(n)}")
    count = n.pop()
    sq = np.zeros(count)
    for g in grads.values():
        sq += np.square(np.asarray(g, np.float64).reshape(count, -1)).sum(axis=1)
    norms = np.sqrt(sq)
    if not np.isfinite(norms).all():
        raise ValueError("a per-sample gradient is not finite")
    scale = np.minimum(1.0, clip / np.maximum(norms, 1e-300))
    return {k: np.asarray(g, np.float64) * scale.reshape((count,) + (1,) * (np.ndim(g) - 1)) for k, g in grads.items()}


def noisy_step_gradient(clipped_sum: dict[str, np.ndarray], *, clip: float, sigma: float, divisor: float,
                        rng: np.random.Generator) -> dict[str, np.ndarray]:
    """(sum of clipped per-sample gradients + N(0, (sigma clip)^2) per coordinate) / divisor, float32."""
    return {k: ((s + rng.normal(0.0, sigma * clip, np.shape(s))) / divisor).astype(np.float32)
            for k, s in clipped_sum.items()}
