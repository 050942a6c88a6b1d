"""SimCLR / SSD augmentations (METHODS.md "SSD") of float images [N, C, H, W] in [0, 1], C 1 or 3.

Order and defaults follow the SimCLR CIFAR recipe: random resized crop (area 0.2-1, aspect
3/4-4/3) + horizontal flip (p 0.5), colour jitter (0.4, 0.4, 0.4, 0.1) with p 0.8, grayscale
with p 0.2. Everything is vectorised over the batch and all randomness comes from the
caller's generator, drawn in a fixed amount per image whatever the image content or which ops
fire, so one generator state always gives one output. Choices a reader should know:

- Crop and flip are one resampling: a per-image affine grid (`affine_grid` + bilinear
  `grid_sample`, align_corners=False) whose x-scale is negated to flip. Crops are continuous
  (sub-pixel), not rounded to whole pixels as torchvision does. Like torchvision, each image
  tries 10 (area, log-aspect) draws and takes the first that fits; if none fits it takes
  torchvision's fallback, the largest central crop with the aspect clamped into range.
  Samples that fall less than half a pixel outside the image take the border value.
- Colour jitter runs in a fixed order (brightness, contrast, saturation, hue), where
  torchvision shuffles the order per call; each step is clamped to [0, 1] as in torchvision.
  Brightness scales, contrast blends with the image's mean luma, saturation blends with the
  per-pixel luma (torchvision's definitions). Hue rotates the chroma plane of YIQ by 2*pi*h
  (h in turns) instead of torchvision's HSV shift: one 3x3 matrix per image, luma kept
  (up to the clamp).
  Single-channel images get brightness and contrast only.
- Grayscale is ITU-R 601 luma (0.299, 0.587, 0.114) copied to the 3 channels; a no-op on C == 1.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

_LUMA = (0.299, 0.587, 0.114)
_RGB_TO_YIQ = ((0.299, 0.587, 0.114), (0.596, -0.274, -0.322), (0.211, -0.523, 0.312))
_CROP_TRIES = 10   # torchvision's RandomResizedCrop attempts before the central fallback


def _uniform(gen: torch.Generator, shape: tuple[int, ...], lo: float, hi: float,
             like: torch.Tensor) -> torch.Tensor:
    """U(lo, hi) drawn on the generator's device, returned on x's device and dtype."""
    u = torch.rand(shape, generator=gen, device=gen.device, dtype=like.dtype)
    return (lo + (hi - lo) * u).to(like.device)


def _fallback_box(h: int, w: int, ratio: tuple[float, float]) -> tuple[float, float]:
    """torchvision's central fallback crop, as (width, height) fractions of the image."""
    in_ratio = w / h
    if in_ratio < ratio[0]:
        return 1.0, in_ratio / ratio[0]
    if in_ratio > ratio[1]:
        return ratio[1] / in_ratio, 1.0
    return 1.0, 1.0


def _crop_boxes(x: torch.Tensor, gen: torch.Generator, scale: tuple[float, float],
                ratio: tuple[float, float]) -> torch.Tensor:
    """Per-image crops [N, 4]: (width frac, height frac, centre x, centre y), centres in [-1, 1]."""
    n, _, h, w = x.shape
    area = _uniform(gen, (n, _CROP_TRIES), scale[0], scale[1], x)
    aspect = _uniform(gen, (n, _CROP_TRIES), math.log(ratio[0]), math.log(ratio[1]), x).exp()
    # Area fraction s and pixel aspect r (width/height) give w_frac * h_frac = s.
    w_frac, h_frac = (area * aspect * h / w).sqrt(), (area * w / (aspect * h)).sqrt()
    fits = (w_frac <= 1) & (h_frac <= 1)
    first = fits.to(torch.uint8).argmax(dim=1, keepdim=True)   # first fitting try (0 if none)
    w_frac, h_frac = w_frac.gather(1, first)[:, 0], h_frac.gather(1, first)[:, 0]
    fb_w, fb_h = _fallback_box(h, w, ratio)
    any_fit = fits.any(dim=1)
    w_frac = torch.where(any_fit, w_frac, torch.full_like(w_frac, fb_w))
    h_frac = torch.where(any_fit, h_frac, torch.full_like(h_frac, fb_h))
    centre = _uniform(gen, (n, 2), -1.0, 1.0, x)
    # The fallback is central, as in torchvision.
    centre = torch.where(any_fit[:, None], centre, torch.zeros_like(centre))
    cx, cy = centre[:, 0] * (1 - w_frac), centre[:, 1] * (1 - h_frac)
    return torch.stack([w_frac, h_frac, cx, cy], dim=1)


def resized_crop_flip(x: torch.Tensor, gen: torch.Generator, scale: tuple[float, float],
                      ratio: tuple[float, float], flip_p: float) -> torch.Tensor:
    """One random resized crop per image, resampled to H x W, mirrored with probability flip_p."""
    box = _crop_boxes(x, gen, scale, ratio)
    flip = _uniform(gen, (x.shape[0],), 0.0, 1.0, x) < flip_p
    theta = torch.zeros(x.shape[0], 2, 3, dtype=x.dtype, device=x.device)
    theta[:, 0, 0] = torch.where(flip, -box[:, 0], box[:, 0])   # output x -> input x
    theta[:, 1, 1] = box[:, 1]
    theta[:, :, 2] = box[:, 2:]
    grid = F.affine_grid(theta, list(x.shape), align_corners=False)
    return F.grid_sample(x, grid, mode="bilinear", padding_mode="border", align_corners=False)


def luma(x: torch.Tensor) -> torch.Tensor:
    """ITU-R 601 luma [N, 1, H, W] of RGB images (the image itself when C == 1)."""
    if x.shape[1] == 1:
        return x
    weights = torch.tensor(_LUMA, dtype=x.dtype, device=x.device)
    return torch.einsum("c,nchw->nhw", weights, x)[:, None]


def _blend(x: torch.Tensor, other: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """factor * x + (1 - factor) * other, clamped to [0, 1]; factor is per image [N]."""
    f = factor[:, None, None, None]
    return (f * x + (1 - f) * other).clamp(0, 1)


def _hue_matrices(hue: torch.Tensor) -> torch.Tensor:
    """[N, 3, 3] RGB -> RGB maps rotating the YIQ chroma (I, Q) by 2*pi*hue, luma fixed."""
    to_yiq = torch.tensor(_RGB_TO_YIQ, dtype=torch.float64, device=hue.device)
    angle = 2 * math.pi * hue.to(torch.float64)
    rot = torch.zeros(hue.shape[0], 3, 3, dtype=torch.float64, device=hue.device)
    rot[:, 0, 0] = 1
    rot[:, 1, 1], rot[:, 1, 2] = angle.cos(), -angle.sin()
    rot[:, 2, 1], rot[:, 2, 2] = angle.sin(), angle.cos()
    return (torch.linalg.inv(to_yiq) @ rot @ to_yiq).to(hue.dtype)


def jitter_colours(x: torch.Tensor, brightness: torch.Tensor, contrast: torch.Tensor,
                   saturation: torch.Tensor, hue: torch.Tensor) -> torch.Tensor:
    """Colour jitter with given per-image factors [N], in the fixed order b, c, s, h.

    Neutral values are 1, 1, 1, 0. Saturation and hue are skipped when C == 1.
    """
    x = _blend(x, torch.zeros_like(x), brightness)
    mean_luma = luma(x).mean(dim=(1, 2, 3), keepdim=True)
    x = _blend(x, mean_luma.expand_as(x), contrast)
    if x.shape[1] == 1:
        return x
    x = _blend(x, luma(x).expand_as(x), saturation)
    return torch.einsum("nij,njhw->nihw", _hue_matrices(hue), x).clamp(0, 1)


def random_colour_jitter(x: torch.Tensor, gen: torch.Generator,
                         jitter: tuple[float, float, float, float], p: float) -> torch.Tensor:
    """With probability p per image, jitter with factors U[max(0, 1-s), 1+s] and hue U[-h, h]."""
    n = x.shape[0]
    apply = _uniform(gen, (n,), 0.0, 1.0, x) < p
    factors = [_uniform(gen, (n,), max(0.0, 1 - s), 1 + s, x) for s in jitter[:3]]
    hue = _uniform(gen, (n,), -jitter[3], jitter[3], x)
    jittered = jitter_colours(x, *factors, hue)
    return torch.where(apply[:, None, None, None], jittered, x)


def random_grayscale(x: torch.Tensor, gen: torch.Generator, p: float) -> torch.Tensor:
    """With probability p per image, replace RGB by its luma on all 3 channels."""
    apply = _uniform(gen, (x.shape[0],), 0.0, 1.0, x) < p
    if x.shape[1] == 1:
        return x
    return torch.where(apply[:, None, None, None], luma(x).expand_as(x), x)


def _check_args(x: torch.Tensor, scale: tuple[float, float], ratio: tuple[float, float],
                jitter: tuple[float, float, float, float], probs: tuple[float, ...]) -> None:
    if x.dim() != 4 or x.shape[1] not in (1, 3) or not x.is_floating_point():
        raise ValueError(f"x must be float [N, C, H, W] with C in (1, 3), "
                         f"got {x.dtype} {tuple(x.shape)}")
    if not 0 < scale[0] <= scale[1] <= 1:
        raise ValueError(f"scale must satisfy 0 < lo <= hi <= 1, got {scale}")
    if not 0 < ratio[0] <= ratio[1]:
        raise ValueError(f"ratio must satisfy 0 < lo <= hi, got {ratio}")
    if len(jitter) != 4 or min(jitter) < 0 or jitter[3] > 0.5:
        raise ValueError(f"jitter must be 4 values >= 0 with hue <= 0.5, got {jitter}")
    if not all(0 <= q <= 1 for q in probs):
        raise ValueError(f"probabilities must be in [0, 1], got {probs}")


def ssl_augment(x: torch.Tensor, generator: torch.Generator, *,
                scale: tuple[float, float] = (0.2, 1.0),
                ratio: tuple[float, float] = (3 / 4, 4 / 3), flip_p: float = 0.5,
                jitter: tuple[float, float, float, float] = (0.4, 0.4, 0.4, 0.1),
                jitter_p: float = 0.8, gray_p: float = 0.2) -> torch.Tensor:
    """One SimCLR/SSD view per image: crop + flip, colour jitter, grayscale (same shape, [0, 1])."""
    _check_args(x, scale, ratio, jitter, (flip_p, jitter_p, gray_p))
    x = resized_crop_flip(x, generator, scale, ratio, flip_p)
    x = random_colour_jitter(x, generator, jitter, jitter_p)
    return random_grayscale(x, generator, gray_p)


def ssl_views(x: torch.Tensor, generator: torch.Generator,
              **kw: object) -> tuple[torch.Tensor, torch.Tensor]:
    """Two independent augmentations of the same batch (view 1, view 2), for the paired losses."""
    return ssl_augment(x, generator, **kw), ssl_augment(x, generator, **kw)
