"""models.vit_mae: patching, masking, the masked-only loss, determinism and a short fit."""
from __future__ import annotations

import pytest
import torch

from splitedge.models.split import seeded_init
from splitedge.models.vit_mae import MaskedAutoencoder, param_count, sincos_pos_embed

TINY = dict(dim=32, depth=1, heads=2, decoder_dim=16, decoder_depth=1)


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def _tiny(image_size: int = 32, channels: int = 3, **kw) -> MaskedAutoencoder:
    with seeded_init(0):
        return MaskedAutoencoder(image_size, channels, **{**TINY, **kw})


def _images(n: int, c: int, s: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, c, s, s, generator=torch.Generator().manual_seed(seed))


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("c, s", [(3, 32), (1, 8)])
def test_patchify_unpatchify_are_inverses(c, s):
    # Prepare
    model = _tiny(s, c)
    x = _images(2, c, s)
    # Execute
    patches = model.patchify(x)
    # Assert: raster order, pixels (row, column, channel) within a patch
    assert patches.shape == (2, (s // 4) ** 2, 16 * c)
    assert torch.equal(patches[:, 1], x[:, :, :4, 4:8].permute(0, 2, 3, 1).reshape(2, -1))
    assert torch.equal(model.unpatchify(patches), x)


def test_forward_shapes_and_mask_count():
    # Prepare
    model = _tiny()
    x = _images(5, 3, 32)
    # Execute
    out = model(x, generator=_gen(0))
    # Assert
    assert out["loss"].shape == ()
    assert out["latent"].shape == (5, 32)
    assert out["pred"].shape == (5, 64, 48)
    assert out["mask"].shape == (5, 64)
    assert torch.equal(out["mask"].sum(dim=1), torch.full((5,), 48.0))   # round(64 * 0.75)
    assert not torch.equal(out["mask"][0], out["mask"][1])              # per-sample shuffles


def test_small_image_keeps_one_patch():
    model = _tiny(8, 1)
    out = model(_images(3, 1, 8), generator=_gen(0))
    assert torch.equal(out["mask"].sum(dim=1), torch.full((3,), 3.0))   # L = 4, keep 1


@pytest.mark.parametrize("norm_pix", [False, True])
def test_loss_scores_masked_patches_only(norm_pix):
    # Prepare
    model = _tiny(norm_pix_loss=norm_pix)
    x = _images(4, 3, 32)
    out = model(x, generator=_gen(0))
    pred, mask = out["pred"], out["mask"]
    pred.retain_grad()
    target = model.patchify(x)
    if norm_pix:
        target = (target - target.mean(-1, keepdim=True)) / (target.var(-1, keepdim=True) + 1e-6).sqrt()
    # Execute
    out["loss"].backward()
    # Assert: the value is the masked mean, and visible predictions get no gradient
    per_patch = (pred - target).pow(2).mean(-1)
    assert out["loss"].item() == pytest.approx(per_patch[mask.bool()].mean().item(), rel=1e-5)
    assert torch.all(pred.grad[~mask.bool()] == 0)
    assert torch.all(pred.grad[mask.bool()].abs().sum(-1) > 0)


def test_latent_and_pred_ignore_masked_pixels():
    # Prepare: change only the pixels of masked patches
    model = _tiny()
    x = _images(3, 3, 32)
    out = model(x, generator=_gen(0))
    patches = model.patchify(x)
    patches[out["mask"].bool()] += 5.0
    x_masked_changed = model.unpatchify(patches)
    # Execute
    out2 = model(x_masked_changed, generator=_gen(0))
    # Assert: the encoder never saw them; only the loss (whose targets they are) changes
    assert torch.equal(out2["mask"], out["mask"])
    assert torch.allclose(out2["latent"], out["latent"], atol=1e-6)
    assert torch.allclose(out2["pred"], out["pred"], atol=1e-6)
    assert out2["loss"].item() > out["loss"].item()


def test_seeded_generator_is_deterministic():
    model = _tiny()
    x = _images(4, 3, 32)
    a, b, c = (model(x, generator=_gen(s)) for s in (7, 7, 8))
    assert torch.equal(a["mask"], b["mask"]) and torch.equal(a["loss"], b["loss"])
    assert not torch.equal(a["mask"], c["mask"])


def test_encode_sees_every_patch_without_randomness():
    # Prepare
    model = _tiny()
    x = _images(3, 3, 32)
    x_last_changed = x.clone()
    x_last_changed[:, :, -4:, -4:] += 1.0
    # Execute
    torch.manual_seed(0)
    z1 = model.encode(x)
    torch.manual_seed(1)
    z2 = model.encode(x)
    z3 = model.encode(x_last_changed)
    # Assert
    assert z1.shape == (3, 32)
    assert torch.equal(z1, z2)                                   # no random masking
    assert (z3 - z1).abs().amax(dim=1).min() > 1e-4              # every sample sees that patch


def test_training_reduces_loss():
    # Prepare
    model = _tiny(8, 1)
    x = _images(8, 1, 8)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    before = model(x, generator=_gen(123))["loss"].item()
    step_gen = _gen(0)
    # Execute
    for _ in range(30):
        opt.zero_grad()
        model(x, generator=step_gen)["loss"].backward()
        opt.step()
    # Assert: measured on the same fixed masks as before training
    after = model(x, generator=_gen(123))["loss"].item()
    assert after < 0.8 * before


def test_defaults_parameter_count_and_positions():
    model = MaskedAutoencoder(32, 3)
    assert param_count(model) == 614_960
    assert model.num_patches == 64 and model.num_visible() == 16
    assert "pos" not in model.state_dict() and "decoder_pos" not in model.state_dict()
    pos = sincos_pos_embed(8, 128)
    assert pos.shape == (64, 128) and torch.equal(pos, sincos_pos_embed(8, 128))
    assert torch.unique(pos, dim=0).shape[0] == 64                # every position distinct


@pytest.mark.parametrize("kw", [dict(image_size=30), dict(image_size=4), dict(dim=30),
                                dict(decoder_dim=18), dict(mask_ratio=0.0), dict(mask_ratio=1.0)])
def test_rejects_bad_config(kw):
    args = {"image_size": 32, "channels": 3, **TINY, **kw}
    with pytest.raises(ValueError):
        MaskedAutoencoder(**args)


def test_rejects_bad_inputs():
    model = _tiny()
    with pytest.raises(ValueError):
        model(torch.zeros(2, 1, 32, 32))
    with pytest.raises(ValueError):
        model.encode(torch.zeros(2, 3, 16, 16))
    with pytest.raises(ValueError):
        model.unpatchify(torch.zeros(2, 63, 48))
