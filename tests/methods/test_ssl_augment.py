"""methods.ssl_augment: shapes and ranges kept, seeded; each op checked with the others off."""
from __future__ import annotations

import pytest
import torch

from splitedge.methods.ssl.augment import jitter_colours, luma, ssl_augment, ssl_views

OFF = dict(scale=(1.0, 1.0), ratio=(1.0, 1.0), flip_p=0.0, jitter_p=0.0, gray_p=0.0)


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def _images(c: int, size: int, n: int = 4, seed: int = 0) -> torch.Tensor:
    return torch.rand(n, c, size, size, generator=torch.Generator().manual_seed(seed))


def _ones(n: int, value: float) -> torch.Tensor:
    return torch.full((n,), value)


@pytest.mark.parametrize("c, size", [(1, 8), (3, 32)])
def test_shape_dtype_range_kept(c, size):
    x = _images(c, size)
    out = ssl_augment(x, torch.Generator().manual_seed(1))
    assert out.shape == x.shape and out.dtype == x.dtype
    assert out.min() >= 0 and out.max() <= 1


@pytest.mark.parametrize("c, size", [(1, 8), (3, 32)])
def test_seeded_and_views_differ(c, size):
    x = _images(c, size)
    a1, b1 = ssl_views(x, torch.Generator().manual_seed(7))
    a2, b2 = ssl_views(x, torch.Generator().manual_seed(7))
    assert torch.equal(a1, a2) and torch.equal(b1, b2)
    assert not torch.allclose(a1, b1)


@pytest.mark.parametrize("c, size", [(1, 8), (3, 32)])
def test_everything_off_is_identity(c, size):
    x = _images(c, size)
    out = ssl_augment(x, torch.Generator().manual_seed(0), **OFF)
    assert torch.allclose(out, x, atol=1e-5)


def test_flip_always_mirrors():
    x = _images(3, 8)
    out = ssl_augment(x, torch.Generator().manual_seed(0), **{**OFF, "flip_p": 1.0})
    assert torch.allclose(out, x.flip(3), atol=1e-5)


@pytest.mark.parametrize("scale, ratio, w_frac, h_frac", [
    ((0.25, 0.25), (1.0, 1.0), 0.5, 0.5),             # area 1/4, square -> half of each side
    ((0.25, 0.25), (2.0, 2.0), 0.5 ** 0.5, 0.125 ** 0.5),   # w = sqrt(s r), h = sqrt(s / r)
    ((1.0, 1.0), (2.0, 2.0), 1.0, 0.5),               # never fits -> central fallback, aspect 2
])
def test_crop_zooms_by_the_drawn_box(scale, ratio, w_frac, h_frac):
    # Prepare: ramps whose value is the pixel-centre position in [0, 1] along x or along y.
    size = 16
    pos = (torch.arange(size) + 0.5) / size
    x = torch.stack([pos.expand(size, size), pos[:, None].expand(size, size)])[:, None]
    # Execute: the same crop for both images would need the same draws, so crop each alone.
    kw = {**OFF, "scale": scale, "ratio": ratio}
    out_x = ssl_augment(x[:1], torch.Generator().manual_seed(3), **kw)[0, 0]
    out_y = ssl_augment(x[1:], torch.Generator().manual_seed(3), **kw)[0, 0]
    # Assert: one output pixel spans w_frac / size of the input (interior: no border clamping).
    assert torch.allclose(out_x[:, 1:-1].diff(dim=1), torch.full((size, size - 3), w_frac / size),
                          atol=1e-5)
    assert torch.allclose(out_y[1:-1].diff(dim=0), torch.full((size - 3, size), h_frac / size),
                          atol=1e-5)


def test_grayscale_makes_channels_equal_luma():
    x = _images(3, 8)
    out = ssl_augment(x, torch.Generator().manual_seed(0), gray_p=1.0)
    assert torch.equal(out[:, 0], out[:, 1]) and torch.equal(out[:, 1], out[:, 2])
    pixel = torch.tensor([0.6, 0.5, 0.4]).view(1, 3, 1, 1)
    # 0.299*0.6 + 0.587*0.5 + 0.114*0.4 = 0.1794 + 0.2935 + 0.0456 = 0.5185
    gray = ssl_augment(pixel, torch.Generator().manual_seed(0), **{**OFF, "gray_p": 1.0})
    assert torch.allclose(gray.flatten(), torch.full((3,), 0.5185), atol=1e-6)


def test_grayscale_is_a_no_op_on_one_channel():
    x = _images(1, 8)
    assert torch.allclose(ssl_augment(x, torch.Generator(), **{**OFF, "gray_p": 1.0}), x, atol=1e-5)


def test_brightness_factor_hand_math():
    # 1.5 * (0.2, 0.4, 0.8) = (0.3, 0.6, 1.2) -> clamped to (0.3, 0.6, 1.0)
    x = torch.tensor([0.2, 0.4, 0.8]).view(1, 3, 1, 1)
    out = jitter_colours(x, _ones(1, 1.5), _ones(1, 1.0), _ones(1, 1.0), _ones(1, 0.0))
    assert torch.allclose(out.flatten(), torch.tensor([0.3, 0.6, 1.0]), atol=1e-6)


def test_contrast_blends_with_mean_and_one_channel_skips_colour():
    # Mean 0.5, factor 0.5: 0.5 x + 0.25 -> (0.35, 0.45, 0.55, 0.65); saturation 0 and hue
    # 0.3 would change an RGB image but are skipped on one channel.
    x = torch.tensor([[0.2, 0.4], [0.6, 0.8]]).view(1, 1, 2, 2)
    out = jitter_colours(x, _ones(1, 1.0), _ones(1, 0.5), _ones(1, 0.0), _ones(1, 0.3))
    assert torch.allclose(out.flatten(), torch.tensor([0.35, 0.45, 0.55, 0.65]), atol=1e-6)


def test_hue_half_turn_reflects_chroma_through_luma():
    # A half turn negates (I, Q): rgb -> 2 Y - rgb, with Y = 0.5185 for (0.6, 0.5, 0.4)
    # -> (0.437, 0.537, 0.637); a grey pixel has no chroma and stays.
    x = torch.tensor([[0.6, 0.5, 0.4], [0.3, 0.3, 0.3]]).view(2, 3, 1, 1)
    out = jitter_colours(x, _ones(2, 1.0), _ones(2, 1.0), _ones(2, 1.0), _ones(2, 0.5))
    assert torch.allclose(out[0].flatten(), torch.tensor([0.437, 0.537, 0.637]), atol=1e-5)
    assert torch.allclose(out[1], x[1], atol=1e-6)


def test_hue_keeps_luma_when_nothing_clips():
    x = 0.4 + 0.2 * _images(3, 4)                   # in [0.4, 0.6]: rotation stays inside [0, 1]
    out = jitter_colours(x, _ones(4, 1.0), _ones(4, 1.0), _ones(4, 1.0), _ones(4, 0.1))
    assert torch.allclose(luma(out), luma(x), atol=1e-6) and not torch.allclose(out, x)


@pytest.mark.parametrize("kw", [{"flip_p": 1.5}, {"scale": (0.0, 1.0)}, {"jitter": (0.4, 0.4)}])
def test_bad_arguments_raise(kw):
    with pytest.raises(ValueError):
        ssl_augment(_images(3, 8), torch.Generator(), **kw)


def test_bad_image_shape_raises():
    with pytest.raises(ValueError):
        ssl_augment(torch.rand(2, 2, 8, 8), torch.Generator())
