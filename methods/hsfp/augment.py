"""Batched augmentations for SupCon views (METHODS.md: random crop with padding + h-flip).

Work on float tensors [B, C, H, W] already on the training device, vectorised over the
batch (one gather, no per-sample Python loop), so augmenting is cheap next to the model.
Padding is ZERO by default (torchvision RandomCrop's default, as in the SupCon CIFAR code;
on normalised inputs 0 is the data-set mean); pass mode="reflect" for reflection padding.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def default_pad(size: int) -> int:
    """Padding scaled to the image: 4 for 32x32 (the CIFAR convention), 1 for 8x8 digits."""
    return max(1, size // 8)


def random_crop(x: torch.Tensor, pad: int | None = None, *, mode: str = "zero",
                generator: torch.Generator | None = None) -> torch.Tensor:
    """Pad each side by `pad` and crop a random HxW window per sample."""
    b, _, h, w = x.shape
    pad = default_pad(min(h, w)) if pad is None else int(pad)
    if pad == 0:
        return x
    if mode not in ("zero", "reflect"):
        raise ValueError(f"mode must be 'zero' or 'reflect', got {mode!r}")
    padded = F.pad(x, (pad, pad, pad, pad), mode="constant" if mode == "zero" else "reflect")
    oy = torch.randint(0, 2 * pad + 1, (b,), generator=generator).to(x.device)
    ox = torch.randint(0, 2 * pad + 1, (b,), generator=generator).to(x.device)
    rows = (oy[:, None] + torch.arange(h, device=x.device))[:, :, None]   # [B, H, 1]
    cols = (ox[:, None] + torch.arange(w, device=x.device))[:, None, :]   # [B, 1, W]
    batch = torch.arange(b, device=x.device)[:, None, None]
    # Advanced indexing on dims 0, 2, 3 gives [B, H, W, C]; move C back.
    return padded.permute(0, 2, 3, 1)[batch, rows, cols].permute(0, 3, 1, 2).contiguous()


def random_hflip(x: torch.Tensor, p: float = 0.5, *,
                 generator: torch.Generator | None = None) -> torch.Tensor:
    """Flip each sample left-right with probability p."""
    flip = (torch.rand(x.shape[0], generator=generator) < p).to(x.device)
    return torch.where(flip[:, None, None, None], x.flip(3), x)


def crop_flip(x: torch.Tensor, pad: int | None = None, *, mode: str = "zero",
              generator: torch.Generator | None = None) -> torch.Tensor:
    """The standard view: random crop with padding, then horizontal flip."""
    if x.dim() != 4:
        raise ValueError(f"x must be [B, C, H, W], got {tuple(x.shape)}")
    return random_hflip(random_crop(x, pad, mode=mode, generator=generator),
                        generator=generator)


def two_views(x: torch.Tensor, *, generator: torch.Generator | None = None,
              **kw: object) -> torch.Tensor:
    """[view1; view2] stacked view-major, the layout supcon_loss expects ([2B, ...])."""
    return torch.cat([crop_flip(x, generator=generator, **kw),
                      crop_flip(x, generator=generator, **kw)])
