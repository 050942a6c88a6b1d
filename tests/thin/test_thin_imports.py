"""The thin device install must never pull in torch.

Each snippet runs in a fresh interpreter (so other tests' imports cannot mask a leak) and
must print the heavy modules it found in ``sys.modules``; the list must be empty. Add a
snippet here for every module that promises to stay torch-free (e.g. the thin device backend).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "torchvision")

_PROTOCOL_ROUND_TRIP = """
import numpy as np
from splitedge import protocol
env = protocol.Envelope(kind="weights", run="r", round=0, sender="d1",
                        body={"part": "wc", "version": 0, "samples": 1,
                              "weights": {"w": np.ones((2, 3), dtype="f4")}})
out = protocol.decode(protocol.encode(env))
assert out.body["weights"]["w"].shape == (2, 3)
"""

# The whole `splitedge device --backend onnx` path: CLI, agent, and the H-SFP thin part building its
# W_c from its own install and binding a weight map saved by the parent (SPLITEDGE_TEST_WC, an .npz);
# no engine that runs a graph (onnxruntime, onnx) is imported.
_ONNX_DEVICE = """
import os, sys
from types import SimpleNamespace
import numpy as np
import splitedge.device.cli, splitedge.device.agent, splitedge.methods.data.local, splitedge.methods.thin.graphs, splitedge.methods.hsfp.method
from splitedge.methods.registry import create_method
from splitedge.methods.contract import DeviceContext
with np.load(os.environ["SPLITEDGE_TEST_WC"], allow_pickle=False) as f:
    weights = {k: f[k] for k in f.files}
config = {"model": {"model": "cnn", "num_classes": 10, "channels": 1, "image_size": 8, "mean": [0.5], "std": [0.25]},
          "method": {}}
method = create_method("hsfp", config)  # as a round announcement configures it
rng = np.random.default_rng(0)
x, y = rng.integers(0, 256, (40, 8, 8, 1), dtype=np.uint8), np.arange(40) % 3  # >= 10 images a class
dev = method.device_part(DeviceContext("d0", method, rng), (x, y), backend="onnx")
dev.on_message(SimpleNamespace(kind="weights", body={"part": "wc", "version": 0, "samples": 0, "weights": weights}))
assert dev.extractor.features(np.zeros((2, 1, 8, 8), np.float32)).shape == (2, 32, 4, 4)
assert dev.compute_moments().mean.shape == (3, 512)
engines = [m for m in ("onnx", "onnxruntime") if m in sys.modules]
assert not engines, engines  # the device runs numpy layers of its install, no graph engine
"""

# The thin trainer: the H-SFP thin device trains its W_c copy for a round and sends it up on an
# averaging round, a SplitFed thin device builds; all with numpy, no torch.
_THIN_TRAINER = """
import os
from types import SimpleNamespace
import numpy as np
from splitedge.methods.registry import create_method
from splitedge.methods.contract import DONE, DeviceContext, RoundPlan
with np.load(os.environ["SPLITEDGE_TEST_WC"], allow_pickle=False) as f:
    start = {k: f[k] for k in f.files}
config = {"model": {"model": "cnn", "num_classes": 10, "channels": 1, "image_size": 8, "mean": [0.5], "std": [0.25]},
          "method": {"device_batch": 8}}
method = create_method("hsfp", config)
rng = np.random.default_rng(0)
x, y = rng.integers(0, 256, (20, 8, 8, 1), dtype=np.uint8), np.arange(20) % 3
dev = method.device_part(DeviceContext("d0", method, rng), (x, y), backend="onnx")
dev.on_message(SimpleNamespace(kind="weights", body={"part": "wc", "version": 0, "samples": 0, "weights": start}))
plan = RoundPlan(round=1, method="hsfp", deadline_s=60, config=config, versions={"wc": 0, "we": 0},
                 directives={"average": ["wc"]})
out = [m for m in dev.run_round(plan) if m is not DONE]
sent = [m.body["weights"] for m in out if m.kind == "weights"]
assert len(sent) == 1 and set(start) <= set(sent[0])
assert not np.allclose(sent[0]["block1.conv.weight"], start["block1.conv.weight"])  # it trained
assert dev.losses["supcon"] > 0
sf = create_method("splitfed", config)
split = sf.device_part(DeviceContext("d1", sf, rng), (x, y), backend="onnx")
assert split.wc_shape == (32, 4, 4)
"""

# FedAvg's thin device: the whole network built from its install, a global model bound, a round
# of cross-entropy trained and the model sent, and head statistics at W_c's pooled output; numpy only.
_THIN_FEDAVG = """
import os
from types import SimpleNamespace
import numpy as np
from splitedge.methods.registry import create_method
from splitedge.methods.contract import DONE, DeviceContext, RoundPlan
from splitedge.methods.calibration.records import calibration_round
with np.load(os.environ["SPLITEDGE_TEST_MODEL"], allow_pickle=False) as f:
    start = {k: f[k] for k in f.files}
config = {"model": {"model": "cnn", "num_classes": 10, "channels": 1, "image_size": 8, "mean": [0.5], "std": [0.25]},
          "method": {"device_batch": 8, "calibrate": "lda", "calib_layer": "wc_2", "min_class_count": 1}}
method = create_method("fedavg", config)
rng = np.random.default_rng(0)
x, y = rng.integers(0, 256, (20, 8, 8, 1), dtype=np.uint8), np.arange(20) % 3
dev = method.device_part(DeviceContext("d0", method, rng), (x, y), backend="onnx")
dev.on_message(SimpleNamespace(kind="weights", body={"part": "model", "version": 0, "samples": 0, "weights": start}))
plan = RoundPlan(round=1, method="fedavg", deadline_s=60, config=config, versions={"model": 0})
sent = [m.body["weights"] for m in dev.run_round(plan) if m is not DONE and m.kind == "weights"]
assert len(sent) == 1 and set(sent[0]) == set(start)
assert not np.allclose(sent[0]["wg.fc.weight"], start["wg.fc.weight"]) and dev.losses["ce"] > 0
cal = RoundPlan(round=1, method="fedavg", deadline_s=60, config=config, versions={"model": 0}, phase="calibrate",
                directives={"calibrate": {"layers": {"wc_2": 128}}})
records = [m for m in calibration_round(dev, cal) if m is not DONE]
assert [m.body["name"] for m in records] == ["head_stats_wc_2"] and records[0].body["arrays"]["mean"].shape == (3, 128)
"""

# `splitedge device ...` parses with the device's options only: no other role's CLI module (nor
# what they import) is loaded into the device process, and reading an .npz loads no PIL.
_DEVICE_COMMAND_LINE = """
import sys
from splitedge.cli import _chosen_command, build_parser
argv = ["-v", "device", "--broker", "mqtt://h:1883", "--id", "d0", "--edge", "e0", "--data", "x.npz",
        "--backend", "onnx"]
args = build_parser(_chosen_command(argv)).parse_args(argv)
assert args.command == "device" and args.backend == "onnx", args
others = [m for m in ("splitedge.bench.cli", "splitedge.cloud.cli", "splitedge.edge.cli", "splitedge.export_cli", "splitedge.sim.cli", "PIL")
          if m in sys.modules]
assert not others, others
"""

SNIPPETS = {
    "protocol": _PROTOCOL_ROUND_TRIP,
    "onnx_device": _ONNX_DEVICE,
    "thin_trainer": _THIN_TRAINER,
    "thin_fedavg": _THIN_FEDAVG,
    "device_command_line": _DEVICE_COMMAND_LINE,
}


@pytest.fixture(scope="module")
def wc_weights_file(tmp_path_factory) -> Path:
    """A small random W_c's weight map saved here, in the parent, where torch may be imported."""
    torch = pytest.importorskip("torch")
    import numpy as np

    from splitedge.models import create_split, state_to_numpy

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("thin") / "wc.npz"
    np.savez(path, **state_to_numpy(create_split("cnn", num_classes=10, in_channels=1, image_size=8).wc))
    return path


@pytest.fixture(scope="module")
def model_weights_file(tmp_path_factory) -> Path:
    """A small random whole split's weight map (what a FedAvg cloud sends), saved in the parent."""
    torch = pytest.importorskip("torch")
    import numpy as np

    from splitedge.models import create_split, state_to_numpy

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("thin") / "model.npz"
    np.savez(path, **state_to_numpy(create_split("cnn", num_classes=10, in_channels=1, image_size=8)))
    return path


@pytest.mark.parametrize("name", sorted(SNIPPETS))
def test_snippet_does_not_import_torch(name, request):
    # Prepare
    report = f"\nimport json, sys\nprint(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))\n"
    code = SNIPPETS[name] + report
    env = dict(os.environ)
    if "SPLITEDGE_TEST_WC" in code:
        env["SPLITEDGE_TEST_WC"] = str(request.getfixturevalue("wc_weights_file"))
    if "SPLITEDGE_TEST_MODEL" in code:
        env["SPLITEDGE_TEST_MODEL"] = str(request.getfixturevalue("model_weights_file"))
    # Execute
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True,
                          text=True, timeout=120, env=env)
    # Assert
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == []
