"""`splitedge export` knows its checkpoint (issue 31, item 4): the cloud records in the
checkpoint what rebuilding its network needs, so `--checkpoint` alone exports it; a checkpoint
of a method without a global model, or a file that is no checkpoint, is one line and exit
code 2, found before torch is imported."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from splitedge.cli import main
from splitedge.exporters.checkpoint import read_header

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """A real run folder: one round of fedavg on digits, as `splitedge sim` writes it."""
    import torch

    from splitedge.sim import SimSettings, run_sim

    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("export") / "run"
    run_sim(SimSettings(rounds=1, devices=2, edges=1, method="fedavg", max_train=200, max_test=100, out=out))
    return out


def _export(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of `splitedge export ARGV`."""
    try:
        code = main(["export", *argv])
    except SystemExit as exc:  # argparse's own refusals
        code = int(exc.code)
    captured = capsys.readouterr()
    return code, captured.out, captured.err.strip()


def _with_metadata(source: Path, dest: Path, metadata: dict[str, str]) -> Path:
    """The checkpoint's weights saved again with other metadata (an older or another method's)."""
    from safetensors.numpy import load_file, save_file

    save_file(load_file(str(source)), str(dest), metadata=metadata)
    return dest


def test_the_checkpoint_records_what_export_rebuilds_the_network_from(run_dir: Path) -> None:
    meta = read_header(run_dir / "model.safetensors").metadata
    assert meta["method"] == "fedavg" and meta["round"] == "1"
    assert meta["model"] == "cnn" and meta["dataset"] == "digits" and meta["num_classes"] == "10"
    assert json.loads(meta["input_shape"]) == [1, 8, 8]
    assert len(json.loads(meta["mean"])) == 1 and len(json.loads(meta["std"])) == 1


def test_export_needs_only_the_checkpoint_and_the_onnx_matches_torch(run_dir: Path, capsys) -> None:
    import onnxruntime as ort
    import torch
    from safetensors.numpy import load_file

    from splitedge.methods.data.datasets import load_dataset
    from splitedge.methods.data.preprocess import to_input
    from splitedge.models import create_split, load_numpy_state

    # Execute: the run folder's checkpoint and nothing else
    code, out, err = _export(capsys, "--checkpoint", str(run_dir / "model.safetensors"), "--samples", "64")
    # Assert: written beside the checkpoint, for the recorded network and normalisation ...
    assert code == 0, err
    report = json.loads(out.strip().splitlines()[-1])
    meta = read_header(run_dir / "model.safetensors").metadata
    assert report["model"] == "cnn" and report["dataset"] == "digits" and report["method"] == "fedavg"
    assert report["mean"] == json.loads(meta["mean"]) and report["std"] == json.loads(meta["std"])
    assert (run_dir / "export" / "export.json").exists()
    # ... and the ONNX graph, run by onnxruntime, computes what the checkpoint's torch model does
    _, test, _ = load_dataset("digits", max_test=100)
    x = to_input(test[0], report["mean"], report["std"])
    model = create_split("cnn", num_classes=10, in_channels=1, image_size=8).eval()
    load_numpy_state(model, load_file(str(run_dir / "model.safetensors")))
    with torch.no_grad():
        expected = model(torch.from_numpy(x)).numpy()
    session = ort.InferenceSession(str(run_dir / "export" / "model.onnx"), providers=["CPUExecutionProvider"])
    got = session.run(None, {session.get_inputs()[0].name: x})[0]
    assert got.shape == expected.shape == (len(x), 10)
    assert np.max(np.abs(got - expected)) < 1e-4 and (got.argmax(1) == expected.argmax(1)).all()


def test_the_run_folder_is_taken_for_its_checkpoint(run_dir: Path, tmp_path: Path, capsys) -> None:
    code, out, err = _export(capsys, "--checkpoint", str(run_dir), "--out", str(tmp_path / "onnx"), "--samples", "32")
    assert code == 0, err
    assert json.loads(out.strip().splitlines()[-1])["checkpoint"] == str(run_dir / "model.safetensors")
    assert (tmp_path / "onnx" / "wc.onnx").exists()


def test_an_older_checkpoint_exports_with_dataset_and_otherwise_names_the_flag(run_dir: Path, tmp_path: Path,
                                                                              capsys) -> None:
    # Prepare: the metadata of checkpoints written before this issue (method and round only)
    old = _with_metadata(run_dir / "model.safetensors", tmp_path / "old.safetensors",
                         {"round": "1", "method": "fedavg"})
    # Execute, Assert: without flags, one line naming --dataset; with it, the export runs
    code, _, err = _export(capsys, "--checkpoint", str(old), "--out", str(tmp_path / "onnx"))
    assert code == 2 and len(err.splitlines()) == 1 and err.startswith("splitedge export: "), err
    assert "pass the run's --dataset (digits or cifar10)" in err and "--model" in err
    code, out, err = _export(capsys, "--checkpoint", str(old), "--dataset", "digits", "--out", str(tmp_path / "onnx"),
                             "--samples", "32")
    assert code == 0, err
    assert json.loads(out.strip().splitlines()[-1])["model"] == "cnn"


def _bad_files(run_dir: Path, tmp: Path) -> dict[str, tuple[Path, str]]:
    """name -> (a file export must refuse, what its one line says)."""
    checkpoint = run_dir / "model.safetensors"
    (tmp / "notes.txt").write_text("not a checkpoint\n")
    (tmp / "cut.safetensors").write_bytes(checkpoint.read_bytes()[:4000])
    (tmp / "empty.safetensors").write_bytes(b"")
    (tmp / "folder").mkdir(exist_ok=True)
    return {
        "missing": (tmp / "missing.safetensors", "missing.safetensors: no such file"),
        "resume.state": (run_dir / "resume.state", f"resume.state is not a safetensors checkpoint; the cloud's "
                                                   f"model is {checkpoint}"),
        "text": (tmp / "notes.txt", "notes.txt is not a safetensors checkpoint"),
        "truncated": (tmp / "cut.safetensors", "cut.safetensors is cut short: 4000 bytes of"),
        "empty": (tmp / "empty.safetensors", "empty.safetensors is not a safetensors checkpoint (empty)"),
        "folder": (tmp / "folder", "folder is a folder without model.safetensors"),
    }


@pytest.mark.parametrize("case", ["missing", "resume.state", "text", "truncated", "empty", "folder"])
def test_a_file_that_is_no_checkpoint_is_one_line(case: str, run_dir: Path, tmp_path: Path, capsys) -> None:
    path, message = _bad_files(run_dir, tmp_path)[case]
    code, out, err = _export(capsys, "--checkpoint", str(path), "--out", str(tmp_path / "onnx"))
    assert code == 2 and len(err.splitlines()) == 1 and message in err, err
    assert err.startswith("splitedge export: error: ") and not (tmp_path / "onnx").exists()


@pytest.mark.parametrize("method", ["fedproto", "simsiam", "decmar"])
def test_a_method_without_a_global_model_says_which_methods_export(method: str, run_dir: Path, tmp_path: Path,
                                                                  capsys) -> None:
    meta = {**read_header(run_dir / "model.safetensors").metadata, "method": method}
    path = _with_metadata(run_dir / "model.safetensors", tmp_path / "model.safetensors", meta)
    code, _, err = _export(capsys, "--checkpoint", str(path))
    assert code == 2 and len(err.splitlines()) == 1, err
    assert f"is a {method} checkpoint, which holds no model export can rebuild" in err
    exportable = err.split("export takes checkpoints of ")[1].split(", ")
    assert {"fedavg", "hsfp", "splitfed"} <= set(exportable) and not {"fedproto", "simsiam", "decmar"} & set(exportable)


def test_a_flag_that_contradicts_the_checkpoint_is_one_line(run_dir: Path, tmp_path: Path, capsys) -> None:
    code, _, err = _export(capsys, "--checkpoint", str(run_dir), "--dataset", "cifar10", "--out", str(tmp_path))
    assert code == 2 and err == ("splitedge export: error: --dataset cifar10: the checkpoint was written for digits; "
                                 "drop --dataset")


_CHECK_WITHOUT_TORCH = """
import json, sys
from pathlib import Path
from splitedge.export_cli import check_checkpoint
lines = []
for p in sys.argv[1:]:
    try:
        lines.append(repr(check_checkpoint(Path(p))))
    except ValueError as exc:
        lines.append(str(exc))
print(json.dumps({"lines": lines, "heavy": [m for m in ("torch", "safetensors", "onnx") if m in sys.modules]}))
"""


def test_the_checks_run_before_torch_is_imported(run_dir: Path, tmp_path: Path) -> None:
    # Prepare: every refused file, a method export refuses, and the good checkpoint
    files = [p for p, _ in _bad_files(run_dir, tmp_path).values()]
    meta = {**read_header(run_dir / "model.safetensors").metadata, "method": "fedproto"}
    files.append(_with_metadata(run_dir / "model.safetensors", tmp_path / "proto.safetensors", meta))
    files.append(run_dir / "model.safetensors")
    # Execute: in a fresh interpreter, so no other test's imports mask one
    done = subprocess.run([sys.executable, "-c", _CHECK_WITHOUT_TORCH, *map(str, files)], capture_output=True,
                          text=True, cwd=REPO, timeout=120)
    # Assert: each file got its answer, and neither torch nor safetensors was imported for it
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["heavy"] == [], result
    assert len(result["lines"]) == len(files) and "Target(" in result["lines"][-1] and "fedproto" in result["lines"][-2]
