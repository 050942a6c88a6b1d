"""methods.augment: crops are translations of the zero-padded image; flips flip."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from splitedge.methods.hsfp.augment import crop_flip, default_pad, random_crop, random_hflip, two_views


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


@pytest.mark.parametrize("c, size", [(1, 8), (3, 32)])
def test_crop_is_a_window_of_the_padded_image(c, size):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, c, size, size, generator=gen)
    out, pad = random_crop(x, generator=gen), default_pad(size)
    padded = F.pad(x, (pad,) * 4)
    for i in range(5):
        windows = [padded[i, :, dy:dy + size, dx:dx + size]
                   for dy in range(2 * pad + 1) for dx in range(2 * pad + 1)]
        assert any(torch.equal(out[i], w) for w in windows)


def test_pad_scaled_and_reflect_mode():
    assert default_pad(32) == 4 and default_pad(8) == 1
    x = torch.randn(2, 1, 8, 8)
    assert random_crop(x, mode="reflect").shape == x.shape


def test_flip_always_and_never():
    x = torch.randn(3, 2, 4, 4)
    assert torch.equal(random_hflip(x, p=1.0), x.flip(3))
    assert torch.equal(random_hflip(x, p=0.0), x)


def test_seeded_and_two_views_layout():
    x = torch.randn(4, 3, 32, 32)
    a = crop_flip(x, generator=torch.Generator().manual_seed(3))
    b = crop_flip(x, generator=torch.Generator().manual_seed(3))
    assert torch.equal(a, b)
    assert two_views(x).shape == (8, 3, 32, 32)
