"""The thin trainer (numpy, methods/thin) against torch autograd: same losses, same gradients,
same weights after an epoch, for the W_c of every model it trains.

Tolerances: forward outputs and every gradient agree to 1e-4 of the largest magnitude of the
torch value (float32 rounding of differently ordered sums; measured 1e-7 to 4e-6); losses to
1e-6; after one SupCon epoch of SGD with momentum on digits (14 steps) the weights agree to 1e-3
of their largest magnitude and BatchNorm's running statistics to 1e-4.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch import nn

from splitedge.methods.data.datasets import load_dataset
from splitedge.methods.hsfp.etf import EtfHead
from splitedge.methods.losses import feddecorr_loss, supcon_loss
from splitedge.methods.snapshot import capture, restore
from splitedge.methods.thin import losses as thin_losses
from splitedge.methods.thin.augment import crop_flip
from splitedge.methods.thin.trainer import SplitTrainer, SupConTrainer
from splitedge.methods.thin.wc_models import thin_wc
from splitedge.methods.torch_utils import sgd
from splitedge.models import create_split, pool, state_to_numpy
from torch_parity import GRAD_TOL, both_passes, rel_err

CASES = [("cnn", 3, 32), ("fedcnn", 3, 32), ("fedcnn2", 3, 32), ("cnn", 1, 8), ("fedcnn", 1, 8)]


def torch_wc(model: str, channels: int, size: int, seed: int = 0) -> nn.Module:
    """A W_c with BatchNorm scales and shifts away from their 1 / 0 initial values."""
    torch.manual_seed(seed)
    wc = create_split(model, num_classes=10, in_channels=channels, image_size=size).wc
    for m in wc.modules():
        if isinstance(m, nn.BatchNorm2d):
            nn.init.uniform_(m.weight, 0.5, 1.5)
            nn.init.uniform_(m.bias, -0.5, 0.5)
    return wc


@pytest.mark.parametrize("model,channels,size", CASES)
def test_layers_match_torch_forward_and_backward_in_training_mode(model, channels, size):
    # Prepare
    wc = torch_wc(model, channels, size).train()
    net = thin_wc(model, channels)
    net.load(state_to_numpy(wc))
    rng = np.random.default_rng(1)
    x = rng.standard_normal((16, channels, size, size)).astype(np.float32)
    # Execute
    got = both_passes(wc, net, x, rng)
    # Assert: output, input gradient, every parameter gradient, updated BatchNorm buffers
    assert rel_err(got["out"], got["out_t"]) < GRAD_TOL
    assert rel_err(got["dx"], got["dx_t"]) < GRAD_TOL
    torch_params = dict(wc.named_parameters())
    for name, layer, key in net.parameters():
        assert rel_err(layer.grads[key], torch_params[name].grad.numpy()) < GRAD_TOL, name
    state, ref = net.state(), state_to_numpy(wc)
    assert list(state) == list(ref)  # the same names in the same order: the weight maps agree
    for name in ref:
        assert state[name].dtype == ref[name].dtype, name
        np.testing.assert_allclose(state[name], ref[name], rtol=1e-5, atol=1e-6, err_msg=name)
    # eval mode uses the running statistics, as torch's
    wc.eval()
    with torch.no_grad():
        assert rel_err(net.forward(x, train=False), wc(torch.from_numpy(x)).numpy()) < GRAD_TOL


def test_losses_match_torch_values_and_gradients():
    rng = np.random.default_rng(2)
    f = rng.standard_normal((32, 16)).astype(np.float32)
    y = rng.integers(0, 4, 32)
    y[0] = 9  # an anchor with no positive: left out of SupCon, as torch's
    head = EtfHead(16, 10, seed=1, tau=0.1)
    cases = {
        "supcon": (lambda t: supcon_loss(t, torch.from_numpy(y), tau=0.5), lambda a: thin_losses.supcon(a, y, 0.5)),
        "etf": (lambda t: nn.functional.cross_entropy(head(t), torch.from_numpy(y)),
                lambda a: thin_losses.etf_cross_entropy(a, y, head.etf.numpy(), 0.1)),
        "feddecorr": (feddecorr_loss, thin_losses.feddecorr),
    }
    for name, (torch_fn, numpy_fn) in cases.items():
        ft = torch.from_numpy(f).requires_grad_()
        ref = torch_fn(ft)
        ref.backward()
        value, grad = numpy_fn(f)
        assert abs(value - ref.item()) < 1e-6, name
        assert rel_err(grad, ft.grad.numpy()) < GRAD_TOL, name


def test_crop_flip_gives_shifted_and_mirrored_crops_of_the_padded_image():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((64, 3, 8, 8)).astype(np.float32)
    out = crop_flip(x, np.random.default_rng(4))
    padded = np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1)))
    flips = 0
    for i in range(len(x)):
        crops = [padded[i, :, a:a + 8, b:b + 8] for a in range(3) for b in range(3)]
        plain = any(np.array_equal(out[i], c) for c in crops)
        mirrored = any(np.array_equal(out[i], c[..., ::-1]) for c in crops)
        assert plain or mirrored, i
        flips += mirrored and not plain
    assert 10 < flips < 54  # about half are flipped


def _torch_supcon_epoch(wc: nn.Module, head: nn.Module, views: list[np.ndarray], labels: list[np.ndarray]) -> None:
    opt = sgd(list(wc.parameters()) + list(head.parameters()), 0.05, momentum=0.9, weight_decay=5e-4)
    wc.train()
    for v, y in zip(views, labels):
        loss = supcon_loss(head(pool(wc(torch.from_numpy(v)))), torch.from_numpy(y), tau=0.5)
        opt.zero_grad()
        loss.backward()
        opt.step()


@pytest.mark.parametrize("chunk", [0, 5], ids=["whole-batch", "chunks-of-5"])
@pytest.mark.parametrize("model", ["cnn", "fedcnn"])
def test_one_supcon_epoch_ends_at_torchs_weights(model, chunk):
    # Prepare: the torch device's W_c and head, copied into the thin trainer (whole batches, or
    # chunks of 5 of the 64 views recomputed: methods/thin/chunked.py); the same views
    (x_all, y_all), _, _ = load_dataset("digits")
    wc = torch_wc(model, 1, 8)
    trainer = SupConTrainer(model, 1, proj_dim=16, lr=0.05, tau=0.5, seed=0, chunk=chunk)
    head = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 16))
    trainer.load(state_to_numpy(wc))
    trainer.head.load({k: v.detach().numpy().copy() for k, v in head.state_dict().items()})
    rng = np.random.default_rng(5)
    order = rng.permutation(len(y_all))[:448]
    views, labels = [], []
    for start in range(0, len(order), 32):
        idx = order[start:start + 32]
        x = (x_all[idx].transpose(0, 3, 1, 2).astype(np.float32) / 255.0 - 0.5) / 0.25
        views.append(np.concatenate([crop_flip(x, rng), crop_flip(x, rng)]))
        labels.append(np.concatenate([y_all[idx], y_all[idx]]).astype(np.int64))
    # Execute
    _torch_supcon_epoch(wc, head, views, labels)
    for v, y in zip(views, labels):
        trainer.step_views(v, y)
    # Assert
    ref, got = state_to_numpy(wc), trainer.weights()
    for name in ref:
        if ref[name].dtype.kind != "f":
            assert int(got[name]) == int(ref[name]) == len(views), name
        elif "running" in name:
            assert rel_err(got[name], ref[name]) < 1e-4, name
        else:
            assert rel_err(got[name], ref[name]) < 1e-3, name
    head_ref = {k: v.detach().numpy() for k, v in head.state_dict().items()}
    for name, value in trainer.head.state().items():
        assert rel_err(value, head_ref[name]) < 1e-3, name


@pytest.mark.parametrize("model,chunk", [("fedcnn", 0), ("fedcnn", 3), ("cnn", 3)])
def test_split_step_matches_torch_for_a_given_gradient(model, chunk):
    # Prepare: the SplitFed device's step: W_c forward, the edge's gradient, backward, SGD. One
    # torch thread, as every training process of the stack runs: with two, torch's reduction
    # order moved cnn's first convolution by 1.4 % over the three momentum steps (run alone)
    torch.set_num_threads(1)
    wc = torch_wc(model, 3, 32)
    trainer = SplitTrainer(model, 3, chunk=chunk)
    trainer.load(state_to_numpy(wc))
    opt_t = sgd(wc.parameters(), 0.05, momentum=0.9, weight_decay=5e-4)
    opt_n = trainer.optimizer(0.05, 0.9, 5e-4)
    rng = np.random.default_rng(6)
    images = rng.integers(0, 256, (24, 32, 32, 3), dtype=np.uint8)
    labels = rng.integers(0, 10, 24)
    grads: dict[int, np.ndarray] = {}

    def edge(act: np.ndarray, y: np.ndarray) -> np.ndarray:
        grads[len(grads)] = rng.standard_normal(act.shape).astype(np.float32) * 1e-2
        return grads[len(grads) - 1]

    # Execute: the thin epoch records the gradients the "edge" sent; torch replays them
    trainer.train_epoch(images, labels, [0.5] * 3, [0.25] * 3, 8, opt_n, np.random.default_rng(7), edge)
    order = list(np.random.default_rng(7).permutation(24).reshape(3, 8))
    wc.train()
    for i, idx in enumerate(order):
        x = torch.from_numpy((images[idx].transpose(0, 3, 1, 2).astype(np.float32) / 255.0 - 0.5) / 0.25)
        act = wc(x)
        opt_t.zero_grad()
        (act * torch.from_numpy(grads[i])).sum().backward()
        opt_t.step()
    # Assert
    ref, got = state_to_numpy(wc), trainer.weights()
    for name in ref:
        if ref[name].dtype.kind == "f":
            assert rel_err(got[name], ref[name]) < 1e-3, name


@pytest.mark.parametrize("chunk", [1, 7])
@pytest.mark.parametrize("model", ["cnn", "fedcnn", "fedcnn2"])
def test_a_chunked_step_gives_the_whole_batch_gradients(model, chunk):
    # Prepare: two copies of one W_c (BatchNorm scales moved off 1 / 0); a CIFAR-size SupCon batch
    weights = state_to_numpy(torch_wc(model, 3, 32))
    whole = SupConTrainer(model, 3, proj_dim=16, lr=0.05, tau=0.5, seed=0)
    chunked = SupConTrainer(model, 3, proj_dim=16, lr=0.05, tau=0.5, seed=0, chunk=chunk)
    whole.load(weights)
    chunked.load(weights)
    rng = np.random.default_rng(10)
    views = rng.standard_normal((40, 3, 32, 32)).astype(np.float32)
    labels = np.arange(40) % 5
    # Execute: one step each (chunks of 7 of 40: the last one short; of 1: each sample alone)
    loss_whole = whole.step_views(views.copy(), labels)
    loss_chunked = chunked.step_views(views.copy(), labels)
    # Assert: the same loss, every gradient and the running statistics (updated once, from the batch)
    assert loss_chunked["total"] == pytest.approx(loss_whole["total"], rel=1e-6)
    for (name, layer, key), (_, twin, _) in zip(whole.wc.parameters(), chunked.wc.parameters()):
        assert rel_err(twin.grads[key], layer.grads[key]) < GRAD_TOL, name
    for name, value in whole.wc.state().items():
        if value.dtype.kind == "f":
            assert rel_err(chunked.wc.state()[name], value) < 1e-5, name
        else:
            assert int(chunked.wc.state()[name]) == int(value) == 1, name


@pytest.mark.parametrize("model", ["cnn", "fedcnn"])
def test_a_chunked_step_keeps_memory_flat_and_builds_no_input_gradient_for_the_image(model, monkeypatch):
    # Prepare: a SupCon batch of 64 CIFAR images in two views; count the input gradients built
    import tracemalloc

    from splitedge.methods.thin.layers import Conv2d

    weights = state_to_numpy(torch_wc(model, 3, 32))
    views = np.random.default_rng(11).standard_normal((128, 3, 32, 32)).astype(np.float32)
    built: list[int] = []  # input channels of each input gradient built
    input_grad = Conv2d.input_grad

    def counted(self, grad, shape):
        built.append(shape[1])
        return input_grad(self, grad, shape)

    monkeypatch.setattr(Conv2d, "input_grad", counted)
    peaks, inputs = {}, {}
    for chunk in (0, 8):
        trainer = SupConTrainer(model, 3, proj_dim=16, lr=0.05, tau=0.5, seed=0, chunk=chunk)
        trainer.load(weights)
        built.clear()
        # Execute
        tracemalloc.start()
        trainer.step_views(views.copy(), np.arange(128) % 10)
        peaks[chunk] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        inputs[chunk] = set(built)
    # Assert: the whole batch's activations are not held (the cnn: ~60 MB whole, ~14 MB in
    # chunks), and no gradient of the 3-channel images is built in chunks
    assert peaks[8] < peaks[0] / 3, peaks
    assert 3 not in inputs[8], inputs


def test_a_chunked_step_refuses_a_chain_it_cannot_split():
    from splitedge.methods.thin.chunked import ChunkedStep
    from splitedge.methods.thin.layers import BatchNorm2d, Conv2d, ReLU, Sequential

    no_norm = Sequential([("conv", Conv2d(3, 4)), ("relu", ReLU())])
    norm_first = Sequential([("bn", BatchNorm2d(3)), ("conv", Conv2d(3, 4)), ("bn2", BatchNorm2d(4))])
    for wc in (no_norm, norm_first):
        with pytest.raises(TypeError, match="chunked step"):
            ChunkedStep(wc, 4)


def test_max_pool_sends_the_gradient_to_the_first_maximum_as_torch():
    # Ties everywhere (rounded values) and odd sides, whose last row or column is in no window
    from splitedge.methods.thin.layers import MaxPool2d

    rng = np.random.default_rng(12)
    for shape in [(4, 3, 8, 8), (2, 5, 7, 9)]:
        x = np.round(rng.standard_normal(shape) * 2).astype(np.float32)
        pool = MaxPool2d()
        out = pool.forward(x.copy(), train=True)
        grad = rng.standard_normal(out.shape).astype(np.float32)
        dx = pool.backward(grad.copy())
        xt = torch.from_numpy(x).requires_grad_()
        ref = nn.functional.max_pool2d(xt, 2)
        ref.backward(torch.from_numpy(grad))
        np.testing.assert_array_equal(out, ref.detach().numpy())
        np.testing.assert_array_equal(dx, xt.grad.numpy())


def test_trainer_state_survives_capture_and_restore():
    # A parked or restarted thin device keeps its local W_c, head and momentum
    trainer = SupConTrainer("cnn", 1, proj_dim=16, lr=0.05, tau=0.5, seed=0)
    trainer.load(state_to_numpy(torch_wc("cnn", 1, 8)))
    rng = np.random.default_rng(8)
    x = rng.standard_normal((16, 1, 8, 8)).astype(np.float32)
    trainer.step(x, np.arange(16) % 4, rng)

    class Holder:
        pass

    saved, fresh = Holder(), Holder()
    saved.trainer = trainer
    fresh.trainer = SupConTrainer("cnn", 1, proj_dim=16, lr=0.01, tau=0.5, seed=1)
    data = capture(saved, ("trainer",))
    restore(fresh, ("trainer",), data)
    twin = copy.deepcopy(trainer)
    # the same next step from the restored state gives the same weights
    twin.step(x, np.arange(16) % 4, np.random.default_rng(9))
    fresh.trainer.step(x, np.arange(16) % 4, np.random.default_rng(9))
    for name, value in twin.weights().items():
        np.testing.assert_array_equal(fresh.trainer.weights()[name], value, err_msg=name)


def test_a_model_it_cannot_train_is_named():
    with pytest.raises(ValueError, match="thin trainer trains the W_c of .*resnet18"):
        thin_wc("resnet18", 3)


def test_a_device_owner_chooses_the_chunk_and_a_bad_one_is_one_line(tmp_path, capsys):
    import dataclasses

    from splitedge.cli import main

    from parts import device_ctx

    # the device's --train-chunk reaches its thin trainers (H-SFP and SplitFed)
    for name in ("hsfp", "splitfed"):
        ctx = dataclasses.replace(device_ctx(name, "d0"), train_chunk=3)
        images = (np.zeros((8, 8, 8, 1), np.uint8), np.arange(8) % 2)
        part = ctx.method.device_part(ctx, images, "onnx")
        assert part.trainer.chunk == 3, name
    # a negative one is refused before the data is read
    code = main(["device", "--broker", "mqtt://127.0.0.1:1", "--id", "d0", "--edge", "e0", "--train-chunk", "-1",
                 "--data", str(tmp_path / "missing.npz")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "--train-chunk must be >= 0" in err and len(err.splitlines()) == 1, err
