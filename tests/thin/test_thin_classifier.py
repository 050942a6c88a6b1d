"""FedAvg's thin device (issue 54, item 3's first half): the whole split network trained in
numpy from the device's own install. One SGD step is torch's; the network loads the torch
split's weights by name and gives its logits; a federation of thin devices trains as one of
torch devices does; FedProx, whose proximal term a thin device would drop, has no thin part."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from splitedge.methods.thin.classifier import ClassifierTrainer, cross_entropy
from splitedge.models import create_split, load_numpy_state, seeded_init, state_to_numpy


def test_cross_entropy_and_its_gradient_are_torchs() -> None:
    rng = np.random.default_rng(0)
    logits, labels = rng.normal(size=(7, 5)).astype(np.float32), rng.integers(0, 5, 7)
    loss, grad = cross_entropy(logits, labels)
    t = torch.from_numpy(logits).requires_grad_()
    want = torch.nn.functional.cross_entropy(t, torch.from_numpy(labels))
    want.backward()
    assert abs(loss - want.item()) < 1e-6
    np.testing.assert_allclose(grad, t.grad.numpy(), atol=1e-7)


@pytest.mark.parametrize("model,channels,size", [("cnn", 1, 8), ("fedcnn", 3, 32), ("fedcnn2", 3, 32)])
def test_three_sgd_steps_in_numpy_are_torchs(model, channels, size) -> None:
    """From the same weights, three steps of SGD with momentum and weight decay on the same
    batches leave the numpy network where torch's leaves the split (BatchNorm in training mode,
    running statistics included), and the logits agree."""
    torch.set_num_threads(1)
    with seeded_init(3):
        split = create_split(model, num_classes=10, in_channels=channels, image_size=size)
    thin = ClassifierTrainer(model, channels, size, 10)
    thin.load(state_to_numpy(split))
    assert set(thin.weights()) == set(state_to_numpy(split))
    rng = np.random.default_rng(1)
    batches = [(rng.normal(size=(8, channels, size, size)).astype(np.float32), rng.integers(0, 10, 8))
               for _ in range(3)]
    opt_np = thin.optimizer(0.05, 0.9, 5e-4)
    opt_t = torch.optim.SGD(split.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    split.train()
    for x, y in batches:
        loss = thin.step(x, y, opt_np)
        opt_t.zero_grad()
        want = torch.nn.functional.cross_entropy(split(torch.from_numpy(x)), torch.from_numpy(y))
        want.backward()
        opt_t.step()
        assert abs(loss - want.item()) < 1e-4
    got, ref = thin.weights(), state_to_numpy(split)
    for name in ref:
        np.testing.assert_allclose(got[name], ref[name], atol=2e-4, err_msg=name)
    split.eval()
    x = batches[0][0]
    outputs = thin.stage_outputs(x)
    with torch.no_grad():
        feats, logits = split.features_and_logits(torch.from_numpy(x))
    np.testing.assert_allclose(outputs["classifier"], feats.numpy(), atol=1e-4)
    net = copy.deepcopy(thin.net)
    np.testing.assert_allclose(net.forward(x, False), logits.numpy(), atol=1e-4)


def test_a_thin_device_refuses_a_weight_map_that_does_not_fit_its_install() -> None:
    """The device checks the global model against the network it built itself; a good one is
    bound, a map with a reshaped classifier is refused before it touches state."""
    from types import SimpleNamespace

    from splitedge.methods.config import ModelSpec, RunConfig
    from splitedge.methods.contract import DeviceContext
    from splitedge.methods.registry import get_method
    from splitedge.protocol.errors import ProtocolError

    spec = ModelSpec(model="fedcnn", num_classes=10, channels=3, image_size=32, mean=(0.5,) * 3, std=(0.25,) * 3)
    method = get_method("fedavg")(RunConfig(spec, get_method("fedavg").Config()))
    rng = np.random.default_rng(0)
    data = (rng.integers(0, 256, size=(4, 32, 32, 3), dtype=np.uint8), np.arange(4) % 2)
    part = method.device_part(DeviceContext("d0", method, rng), data, backend="onnx")
    with seeded_init(0):
        good = state_to_numpy(create_split("fedcnn", num_classes=10, in_channels=3, image_size=32))
    env = lambda w, v: SimpleNamespace(kind="weights", body={"part": "model", "version": v, "samples": 0,  # noqa: E731
                                                               "weights": w})
    with pytest.raises(ProtocolError):
        part.check(env({**good, "wg.fc.weight": np.zeros((10, 7), np.float32)}, 1), "parent")
    assert part.version == -1
    part.check(env(good, 1), "parent")
    part.on_message(env(good, 1))
    assert part.version == 1 and np.array_equal(part.trainer.weights()["wg.fc.weight"], good["wg.fc.weight"])


def test_fedprox_has_no_thin_device_and_fedavg_has() -> None:
    from splitedge.methods.registry import get_method

    assert get_method("fedavg").device_backends() == ["onnx", "torch"]
    assert get_method("fedprox").device_backends() == ["torch"]
    assert "onnx" in get_method("fedadam").device_backends()


def test_a_federation_of_thin_devices_learns_as_one_of_torch_devices(tmp_path) -> None:
    """Two rounds of FedAvg on digits over the embedded broker, thin devices against torch
    devices from the same start: both learn, and end within a few points of each other (the
    same steps in float32, different shuffles)."""
    from splitedge.sim import SimSettings, run_sim

    torch.set_num_threads(1)
    acc = {}
    for backend in ("onnx", "torch"):
        summary = run_sim(SimSettings(rounds=3, devices=2, edges=1, method="fedavg", out=tmp_path / backend,
                                      max_train=400, max_test=200, backends=(backend,)))
        acc[backend] = summary["final_accuracy"]
    assert acc["onnx"] > 0.6 and acc["torch"] > 0.6
    assert abs(acc["onnx"] - acc["torch"]) < 0.1
