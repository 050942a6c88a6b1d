"""Virtual devices: a device holds its model only while it trains (a pool of N training
slots), its state kept as bytes between rounds. The federation must not notice: the same
seed gives the same accuracy in every round and the same served model as with every device
keeping its model, bit for bit (with float32 parking)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest


def _served(path: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(str(path))


@pytest.mark.parametrize("method, backends", [("hsfp", ("torch",)), ("hsfp-cal", ("torch",)), ("fedavg", ("torch",)),
                                              ("hsfp-cal", ("torch", "onnx"))])
def test_virtual_devices_change_nothing_but_memory(tmp_path: Path, method: str, backends: tuple,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from splitedge.methods.thin.graphs import LocalGraph
    from splitedge.sim import SimSettings, run_sim

    sessions = {"built": 0}  # local graphs a run builds (a parked thin device rebuilds its own)
    build = LocalGraph.__init__

    def counted(self, *args, **kwargs):
        sessions["built"] += 1
        build(self, *args, **kwargs)

    monkeypatch.setattr(LocalGraph, "__init__", counted)

    # Prepare: W_c averaged at round 2, so a parked device must take a model message it got meanwhile
    # (hsfp-cal: the calibration models a device was sent must survive its parking; thin devices
    # park too, the weights they bound kept as arrays and their graphs rebuilt from the install)
    overrides = {"ic": 2, "ie": 2} if method.startswith("hsfp") else {}
    runs, built = {}, {}
    for virtual in (0, 2):
        s = SimSettings(rounds=4, devices=6, edges=2, method=method, alpha=0.5, seed=1, virtual=virtual,
                        out=tmp_path / f"v{virtual}", overrides=overrides, backends=backends)
        # Execute
        sessions["built"] = 0
        runs[virtual] = run_sim(s)
        built[virtual] = sessions["built"]
    # Assert
    assert runs[2]["accuracy_per_round"] == runs[0]["accuracy_per_round"]
    if "onnx" in backends:  # 3 thin devices, 2 graphs each: rebuilt after every round they parked
        assert built[0] == 6 and built[2] > built[0], built
    a, b = _served(tmp_path / "v0" / "model.safetensors"), _served(tmp_path / "v2" / "model.safetensors")
    assert all(np.array_equal(a[k], b[k]) for k in a)


def test_a_parked_device_keeps_its_optimiser_and_model_in_half_the_bytes() -> None:
    import torch

    from splitedge.methods import snapshot
    from splitedge.methods.torch_utils import PlainSGD

    model = torch.nn.Linear(64, 32)
    opt = PlainSGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, 64)).sum().backward()
    opt.step()

    class Part:
        def __init__(self) -> None:
            self.model, self.opt = model, opt

    names = ("model", "opt")
    full = snapshot.dumps(snapshot.capture(Part(), names))
    half = snapshot.dumps(snapshot.cast_floats(snapshot.capture(Part(), names), "f2"))
    assert len(half) < 0.6 * len(full)
    fresh = Part.__new__(Part)
    fresh.model, fresh.opt = torch.nn.Linear(64, 32), None
    fresh.opt = PlainSGD(fresh.model.parameters(), lr=0.5, momentum=0.0)
    snapshot.restore(fresh, names, snapshot.loads(half))
    assert fresh.opt.momentum == 0.9 and fresh.opt.momentum_buffers[0].dtype == torch.float32
    assert torch.allclose(fresh.model.weight, model.weight, atol=1e-3)
    assert fresh.opt.params[0] is fresh.model.weight  # the optimiser still trains the restored model
