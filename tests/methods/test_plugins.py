"""Plug-ins (issue 55, items 1 and 4; protocol/plugins.py, docs/plugins.md): a model defined only
in a test folder and a plug-in package's method and model run like the shipped ones, in a sim
and as processes, export included; a name that arrives off the wire is never imported."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from federation import Federation
from splitedge.methods.config import ModelSpec
from splitedge.methods.registry import create_method, get_method, use_method
from splitedge.models import create_split, split_module, use_model
from splitedge.sim import SimSettings, run_sim

HERE = Path(__file__).resolve().parents[1]  # tests/
MODELS = HERE / "plugin_models"
MODEL = "tiny_mobilenet:factory"
EXAMPLE = HERE.parent / "examples" / "plugin-label-smoothing"


@pytest.fixture(autouse=True)
def registries_as_they_were(monkeypatch):
    """What a test registers stays in that test (the registries are per process, and a worker
    runs other tests' modules after this one)."""
    import splitedge.methods.metrics.extra as metrics
    import splitedge.methods.registry as methods
    import splitedge.methods.thin.plugins as thin
    import splitedge.models.registry as models

    for module, name in ((models, "_REGISTRY"), (models, "_PLUGGED"), (methods, "_METHODS"), (metrics, "_METRICS"),
                         (thin, "_REGISTRY")):
        monkeypatch.setattr(module, name, dict(getattr(module, name)))


@pytest.fixture
def own_models(monkeypatch):
    monkeypatch.syspath_prepend(str(MODELS))
    monkeypatch.setenv("PYTHONPATH", str(MODELS))


@pytest.fixture(scope="module")
def example_install(tmp_path_factory) -> Path:
    """The example plug-in package installed as a user would (pip, from its folder), into a
    folder of its own put on PYTHONPATH by the tests that use it."""
    target = tmp_path_factory.mktemp("site")
    build = tmp_path_factory.mktemp("build")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                    "--target", str(target), str(EXAMPLE)], check=True, cwd=build,
                   env={"PIP_DISABLE_PIP_VERSION_CHECK": "1", "PATH": "/usr/bin:/bin", "HOME": str(build)})
    return target


def _splitedge(*argv: str, env_path: Path, cwd: Path) -> subprocess.CompletedProcess:
    import os

    env = {**os.environ, "PYTHONPATH": str(env_path), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "splitedge", *argv], capture_output=True, text=True, env=env,
                          cwd=cwd, timeout=280)


def test_split_module_cuts_a_network_by_names_and_says_what_does_not_fit() -> None:
    net = nn.Sequential()
    net.add_module("conv", nn.Conv2d(1, 4, 3, padding=1))
    net.add_module("body", nn.Sequential(nn.ReLU(), nn.Conv2d(4, 8, 3, stride=2, padding=1)))
    net.add_module("fc", nn.Linear(8 * 16, 10))
    split = split_module(net, wc=["conv"], we=["body.1"], wg=[nn.Flatten(1), "fc"], in_shape=(1, 8, 8), num_classes=10)
    assert split.wc_shape == (4, 8, 8) and split.we_shape == (8, 4, 4) and split(torch.zeros(2, 1, 8, 8)).shape == (2, 10)
    assert split.wc.conv is net.conv  # the user's modules, not copies
    cases = [({"wc": ["nope"]}, "has no submodule 'nope'"), ({"we": ["conv"]}, "already in another piece"),
             ({"wg": ["fc"]}, "ends in its classifier"), ({"wg": [nn.Flatten(1), nn.ReLU()]}, "ends in its classifier"),
             ({"we": ["body.0"]}, "do not chain"), ({"wc": []}, "at least one module")]
    for change, message in cases:
        parts = {"wc": ["conv"], "we": ["body.1"], "wg": [nn.Flatten(1), "fc"], **change}
        with pytest.raises(ValueError, match=message):
            split_module(net, **parts, in_shape=(1, 8, 8), num_classes=10)
    with pytest.raises(ValueError, match="not the 3 class logits"):
        split_module(net, wc=["conv"], we=["body.1"], wg=[nn.Flatten(1), "fc"], in_shape=(1, 8, 8), num_classes=3)


def test_a_name_off_the_wire_is_never_imported(tmp_path, monkeypatch) -> None:
    # a hostile cloud names an importable module in its round announcement: what the device
    # builds comes from what its owner registered, so it is an unknown name, and not imported
    (tmp_path / "wire_named.py").write_text("raise SystemExit('imported')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match="unknown model"):
        create_split("wire_named:factory", num_classes=10, in_channels=1, image_size=8)
    with pytest.raises(ValueError, match="unknown method"):
        get_method("wire_named:Method")
    with pytest.raises(ValueError, match="unknown method"):
        create_method("wire_named:Method", {})
    assert "wire_named" not in sys.modules


def test_what_an_owner_names_is_checked_in_one_line(own_models) -> None:
    assert use_model(MODEL) == MODEL and use_model("cnn") == "cnn"
    for value, message in (("tiny_mobilenet:nope", "has no 'nope'"), ("no_such_module:f", "does not import"),
                           ("tiny mobilenet", "unknown model")):
        with pytest.raises(ValueError, match=message):
            use_model(value)
    with pytest.raises(ValueError, match="not a SplitModel"):
        use_model("tiny_mobilenet:not_a_split")
        create_split("tiny_mobilenet:not_a_split", num_classes=10, in_channels=1, image_size=8)
    for value, message in (("tiny_mobilenet:TinyMobileNet", "not a splitedge Method"), ("nope", "unknown method")):
        with pytest.raises(ValueError, match=message):
            use_method(value)


def test_a_model_of_one_s_own_runs_fedavg_and_hsfp_cal_in_a_sim_and_exports(own_models, tmp_path) -> None:
    torch.set_num_threads(1)
    results = {}
    for method, rounds in (("fedavg", 3), ("hsfp-cal", 2)):
        s = SimSettings(rounds=rounds, devices=4, edges=2, method=method, model=MODEL, out=tmp_path / method,
                        max_train=600, max_test=300, overrides={"calibrate": "lda"})
        results[method] = run_sim(s)
        assert results[method]["status"] == "complete"
    # chance is 0.1: the calibrated head on the network's own features is far above it
    assert results["fedavg"]["final_accuracy_calibrated"] > 0.5, results["fedavg"]
    assert results["hsfp-cal"]["final_accuracy_calibrated"] > 0.3, results["hsfp-cal"]
    # a checkpoint is data: the model it names is imported only when the command line names it too
    # (a process of its own: this one registered the model for the sims above)
    bare = _splitedge("export", "--checkpoint", str(tmp_path / "fedavg"), "--out", str(tmp_path / "x"),
                      env_path=MODELS, cwd=tmp_path)
    assert bare.returncode == 2 and f"give --model {MODEL}" in bare.stderr, bare.stderr
    named = _splitedge("export", "--checkpoint", str(tmp_path / "fedavg"), "--out", str(tmp_path / "x"), "--model",
                       MODEL, env_path=MODELS, cwd=tmp_path)
    assert named.returncode == 0, named.stderr
    report = json.loads((tmp_path / "x" / "export.json").read_text())
    assert report["model"] == MODEL
    model = next(v for v in report["variants"] if v["graph"] == "model")
    assert model["top1_agreement"] == 1.0 and model["rel_diff"] < 1e-4, report


def test_a_thin_device_with_a_model_of_one_s_own_is_refused_before_any_work(own_models, tmp_path) -> None:
    with pytest.raises(ValueError, match="builds only the networks of its install"):
        run_sim(SimSettings(rounds=1, method="hsfp-cal", model=MODEL, backends=("torch", "onnx"), out=tmp_path / "r"))
    assert not (tmp_path / "r").exists()


THIN_MODEL, THIN_PLUGIN = "plain_net:factory", "plain_net_thin:THIN"


def test_thin_devices_train_a_model_of_one_s_own_from_the_thin_model_their_owner_names(own_models, mosquitto,
                                                                                          tmp_path) -> None:
    """A thin device builds a model of one's own from the numpy layers its owner gives it (a
    ThinModel, --plugin or an entry point), never from the wire: beside torch devices, in the
    sim's worker processes, it sends moments and head statistics of it, trains its W_c and sends
    that up on averaging rounds."""
    import threading

    from splitedge.protocol.mqtt import MqttTransport
    from splitedge.protocol.topics import pattern

    with pytest.raises(ValueError, match="builds only the networks of its install"):
        run_sim(SimSettings(rounds=1, method="hsfp-cal", model=THIN_MODEL, backends=("torch", "onnx"),
                            out=tmp_path / "refused"))
    run, sent, lock = "thin-own-model", [], threading.Lock()

    def record(topic, env) -> None:
        if env.body.get("part") == "wc":
            with lock:
                sent.append((env.sender, env.round))

    observer = MqttTransport(mosquitto.url, client_id="observer-thin-own", role="observer")
    observer.subscribe(pattern(run, "device", "+", "up", "weights"), record)
    try:
        summary = run_sim(SimSettings(rounds=2, devices=4, edges=2, method="hsfp-cal", model=THIN_MODEL,
                                      backends=("torch", "onnx"), broker=mosquitto.url, run=run, workers=2,
                                      plugins=(THIN_PLUGIN,),  # as `splitedge sim --plugin plain_net_thin:THIN`
                                      out=tmp_path / "mixed", deadline_s=120.0, overrides={"ic": 2}))
    finally:
        observer.close()
    assert summary["status"] == "complete" and summary["final_accuracy"] > summary["chance"], summary
    assert {("d1", 2), ("d3", 2)} <= set(sent), sorted(sent)  # the thin ones (round-robin) trained W_c
    # a thin device's plug-in imports no torch, and a ThinModel of a shipped name is refused
    code = ("import sys\nfrom splitedge.runtime.plugin_args import use_plugins\nuse_plugins(['plain_net_thin:THIN'])\n"
            "from splitedge.methods.thin.wc_models import thin_wc\nthin_wc('plain_net:factory', 3)\n"
            "print('torch' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**__import__("os").environ, "PYTHONPATH": str(MODELS)})
    assert proc.returncode == 0 and proc.stdout.strip() == "False", proc.stderr
    from splitedge.methods.thin.plugins import ThinModel, register_thin_model

    with pytest.raises(ValueError, match="name of a network splitedge ships"):
        register_thin_model(ThinModel("cnn", lambda c: None), shipped=("cnn",))


def test_a_process_federation_runs_a_model_and_data_set_of_one_s_own(own_models, mosquitto, tmp_path) -> None:
    # the cloud evaluates on a loader of one's own; every node but d3 is started with --plugin; d3
    # gets the same announcement naming the model by import path, with the module importable on
    # its path, and leaves without importing it
    marker = tmp_path / "d3-imported"
    plugin = ["--plugin", MODEL]
    fed = Federation(tmp_path, mosquitto.url, edges=2, devices=4, rounds=2,  # the devices' shards are digits
                     extra=["--method", "hsfp-cal", "--model", MODEL, "--dataset", "own_data:load", "--deadline", "120"],
                     node_extra={**{n: plugin for n in ("e0", "e1", "d0", "d1", "d2")}},
                     node_env={"d3": {"SPLITEDGE_TEST_IMPORTED": str(marker)}})
    try:
        fed.wait(timeout=280)
        records = fed.metrics()
    finally:
        fed.close()
    assert [r["round"] for r in records] == [1, 2], fed.logs()
    assert records[-1]["devices_reported"] == 3 and np.isfinite(records[-1]["accuracy"]), records[-1]
    assert "unknown model 'tiny_mobilenet:factory'" in fed.log("d3") and "--plugin" in fed.log("d3")
    assert fed.procs["d3"].returncode != 0 and not marker.exists()  # it left at once, and never imported it


def test_a_plugin_package_s_method_is_listed_and_runs(example_install, tmp_path) -> None:
    shown = _splitedge("sim", "--help", env_path=example_install, cwd=tmp_path)
    assert shown.returncode == 0 and "fedavg-ls" in shown.stdout and "--label-smoothing" in shown.stdout, shown.stderr
    ran = _splitedge("sim", "--method", "fedavg-ls", "--label-smoothing", "0.2", "--model", "mobilenet-tiny",
                     "--rounds", "2", "--max-train", "300", "--max-test", "100", "--calibrate", "lda",
                     "--out", str(tmp_path / "run"), env_path=example_install, cwd=tmp_path)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "complete" and summary["config"]["method"] == "fedavg-ls", summary
    assert summary["config"]["settings"]["label_smoothing"] == 0.2 and summary["config"]["model"]["model"] == "mobilenet-tiny"
    refused = _splitedge("sim", "--method", "fedavg-ls", "--backends", "onnx", "--label-smoothing", "1.5",
                         env_path=example_install, cwd=tmp_path)
    assert refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1, refused.stderr


def test_a_plugin_method_s_objective_is_the_one_that_trains() -> None:
    from splitedge.methods.config import RunConfig
    from splitedge.methods.training import Batch

    sys.path.insert(0, str(EXAMPLE))
    try:
        from splitedge_label_smoothing.method import FedAvgLabelSmoothing
    finally:
        sys.path.remove(str(EXAMPLE))
    m = FedAvgLabelSmoothing(RunConfig(ModelSpec(), FedAvgLabelSmoothing.Config(label_smoothing=0.5)), name="fedavg-ls")
    (term,) = m.objective("device")
    logits, y = torch.tensor([[10.0, -10.0]]), torch.tensor([0])
    smoothed = float(term.fn({"logits": logits}, Batch(torch.zeros(1, 1), y)))
    assert smoothed > 4.0  # half the label on the wrong class costs ~ 0.25 * 20; plain CE costs ~ 0
    with pytest.raises(ValueError, match="label_smoothing"):
        FedAvgLabelSmoothing.Config(label_smoothing=1.0)


def test_a_data_set_of_one_s_own_as_an_npz_a_folder_or_a_loader(own_models, tmp_path) -> None:
    from PIL import Image

    from splitedge.methods.data.datasets import load_dataset

    (x, y), (xt, yt), names = __import__("own_data").load()
    np.savez(tmp_path / "own.npz", x_train=x, y_train=y, x_test=xt, y_test=yt, classes=np.array(names))
    for split, xs, ys in (("train", x[:60], y[:60]), ("test", xt[:30], yt[:30])):
        for i, (image, label) in enumerate(zip(xs, ys)):
            folder = tmp_path / "tree" / split / names[label]
            folder.mkdir(parents=True, exist_ok=True)
            Image.fromarray(image).save(folder / f"{i}.png")
    npz = load_dataset("images", tmp_path / "own.npz")
    tree = load_dataset("images", tmp_path / "tree")
    loader = load_dataset("own_data:load", "1000")
    assert npz[2].classes == loader[2].classes == tuple(names) and npz[2].image_size == 8 and npz[2].channels == 1
    assert len(loader[0][1]) == 1000 and np.array_equal(npz[1][0], loader[1][0])
    assert tree[0][0].shape == (60, 8, 8, 1) and tree[2].classes == tuple(sorted(set(names[c] for c in y[:60])))
    run = run_sim(SimSettings(rounds=2, devices=3, edges=1, method="fedavg", dataset="images",
                              data=str(tmp_path / "own.npz"), out=tmp_path / "run", max_test=200))
    assert run["status"] == "complete" and run["final_accuracy"] > 0.5, run


@pytest.mark.parametrize("loader, message", [
    ("own_data:float_images", "train images are float32"), ("own_data:labels_past_the_classes", "outside 0..4"),
    ("own_data:not_square", "square"), ("own_data:shapes_disagree", "test images"),
    ("own_data:not_three_things", "not ((x_train"), ("own_data:nope", "has no 'nope'")])
def test_a_data_set_that_does_not_fit_is_one_line(own_models, loader: str, message: str, tmp_path) -> None:
    from splitedge.methods.data.datasets import load_dataset

    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        load_dataset(loader)
    np.savez(tmp_path / "half.npz", x_train=np.zeros((4, 8, 8), np.uint8), y_train=np.zeros(4, np.int64))
    with pytest.raises(ValueError, match="lacks x_test, y_test"):
        load_dataset("images", tmp_path / "half.npz")


def test_a_metric_of_one_s_own_is_in_every_evaluated_round(own_models, tmp_path, caplog) -> None:
    from splitedge.methods.metrics.extra import use_metric

    assert use_metric("sklearn.metrics:balanced_accuracy_score") == "metric_balanced_accuracy_score"
    assert use_metric("own_data:float_images") == "metric_float_images"  # fails on (y, pred): left out, logged
    with pytest.raises(ValueError, match="not a function"):
        use_metric("own_data:NAMES")
    run_sim(SimSettings(rounds=2, devices=2, edges=1, method="fedavg", out=tmp_path / "run", max_test=150))
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    for r in records:
        assert 0 < r["metric_balanced_accuracy_score"] <= 1 and "metric_float_images" not in r, r
    assert "metric_float_images failed" in caplog.text


def test_the_bench_runs_a_model_of_one_s_own_and_refuses_a_wrong_one_before_work(own_models, tmp_path,
                                                                                   capsys) -> None:
    from splitedge.cli import main

    out = tmp_path / "bench"
    assert main(["bench", "accuracy", "--dataset", "digits", "--model", MODEL, "--methods", "fedavg",
                 "--variant", "cal=fedavg:calibrate=lda", "--alphas", "iid", "--rounds", "2", "--max-train", "400",
                 "--max-test", "200", "--backends", "torch", "--jobs", "1", "--no-plots", "--out", str(out)]) == 0
    doc = json.loads((out / "accuracy.json").read_text())
    assert doc["config"]["model"] == MODEL
    runs = {r["method"]: r for r in doc["results"]["runs"]}
    assert sorted(runs) == ["cal", "fedavg"] and all(len(r["accuracy_per_round"]) == 2 for r in runs.values())
    assert runs["cal"]["accuracy_calibrated_per_round"][-1] is not None and runs["fedavg"]["effective_rank"] > 0
    capsys.readouterr()
    assert main(["bench", "accuracy", "--dataset", "digits", "--model", "tiny_mobilenet:nope", "--methods", "fedavg",
                 "--out", str(tmp_path / "never")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "tiny_mobilenet has no 'nope'" in err, err
    assert not (tmp_path / "never").exists()
