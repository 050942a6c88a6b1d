"""`splitedge data split` / `splitedge data check`, through the real command line (digits only)."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from splitedge.cli import main
from splitedge.methods.data.datasets import load_dataset, load_shard, save_shard


@pytest.fixture(scope="module")
def digits_train_labels() -> np.ndarray:
    return load_dataset("digits")[0][1]


def _error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize("how", [["--iid"], ["--alpha", "0.5"]], ids=["iid", "dirichlet"])
def test_split_writes_shards_a_device_can_use(tmp_path: Path, capsys, digits_train_labels, how) -> None:
    out = tmp_path / "shards"
    assert main(["data", "split", "--dataset", "digits", "--devices", "3", "--edges", "2", "--out", str(out),
                 "--broker", "mqtt://site:1883", *how]) == 0
    printed = capsys.readouterr().out

    manifest = json.loads((out / "shards.json").read_text())
    assert manifest["dataset"] == "digits" and manifest["seed"] == 0
    assert (manifest["split"], manifest["alpha"]) == (("iid", None) if how == ["--iid"] else ("dirichlet", 0.5))
    assert [d["file"] for d in manifest["devices"]] == ["shard-d0.npz", "shard-d1.npz", "shard-d2.npz"]
    assert sorted(p.name for p in out.iterdir()) == ["shard-d0.npz", "shard-d1.npz", "shard-d2.npz", "shards.json"]
    total = np.zeros(10, np.int64)
    for i, d in enumerate(manifest["devices"]):
        path = out / d["file"]
        x, y = load_shard(path)
        assert x.dtype == np.uint8 and x.shape == (d["samples"], 8, 8, 1) and len(y) == d["samples"]
        assert np.bincount(y, minlength=10).tolist() == d["class_counts"]
        assert hashlib.sha256(path.read_bytes()).hexdigest() == d["sha256"]
        total += np.bincount(y, minlength=10)
        assert (f"splitedge device --broker mqtt://site:1883 --id d{i} --edge e{i % 2} --data {path} "
                f"--backend onnx") in printed
    assert sum(d["samples"] for d in manifest["devices"]) == len(digits_train_labels) == manifest["train_samples"]
    assert total.tolist() == np.bincount(digits_train_labels, minlength=10).tolist()
    assert "--backend torch" in printed
    if how == ["--iid"]:
        sizes = [d["samples"] for d in manifest["devices"]]
        assert max(sizes) - min(sizes) <= 1

    assert main(["data", "check", str(out / "shard-d1.npz")]) == 0
    checked = capsys.readouterr().out
    assert f"images:  {manifest['devices'][1]['samples']}" in checked and "sha256:  matches" in checked


def test_split_refuses_a_folder_with_shards_unless_overwrite(tmp_path: Path, capsys) -> None:
    out = tmp_path / "s"
    args = ["data", "split", "--dataset", "digits", "--max-train", "200", "--out", str(out)]
    assert main([*args, "--devices", "3"]) == 0
    capsys.readouterr()
    assert main([*args, "--devices", "2"]) == 2
    assert "--overwrite" in _error_line(capsys)
    assert (out / "shard-d2.npz").exists()

    assert main([*args, "--devices", "2", "--overwrite"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["shard-d0.npz", "shard-d1.npz", "shards.json"]


def test_feature_skew_is_recorded_and_its_options_need_it(tmp_path: Path, capsys) -> None:
    out = tmp_path / "s"
    args = ["data", "split", "--dataset", "digits", "--max-train", "200", "--devices", "4", "--out", str(out)]
    assert main([*args, "--max-shift", "0.1"]) == 2
    assert "--feature-skew" in _error_line(capsys)
    assert main([*args, "--feature-skew", "--max-shift", "0.1"]) == 0
    manifest = json.loads((out / "shards.json").read_text())
    assert manifest["feature_skew"] == {"max_shift": 0.1, "rotate": True}
    assert sorted(d["skew"]["rotation_k"] for d in manifest["devices"]) == [0, 1, 2, 3]


def test_split_help_shows_defaults(capsys, monkeypatch) -> None:
    monkeypatch.setenv("COLUMNS", "200")  # argparse wraps at hyphens too
    with pytest.raises(SystemExit) as exit_:
        main(["data", "split", "--help"])
    assert exit_.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: mqtt://EDGE-HOST:1883)" in text and "(default: 0)" in text and "--feature-skew" in text


def test_check_summarises_a_good_shard(tmp_path: Path, capsys) -> None:
    rng = np.random.default_rng(0)
    y = np.array([0, 0, 2, 2, 2, 5] * 6)
    save_shard(tmp_path / "d0.npz", rng.integers(0, 256, (36, 6, 6, 3), dtype=np.uint8), y, device=0)
    assert main(["data", "check", str(tmp_path / "d0.npz")]) == 0
    out = capsys.readouterr().out
    for want in ("images:  36", "[36, 6, 6, 3]", "uint8", "3 present", "0:12 2:18 5:6", "device=0", "streams: yes"):
        assert want in out, want


def _bad(path: Path, kind: str) -> None:
    z, u8 = np.zeros, np.uint8
    if kind == "float32 x":
        np.savez(path, x=z((4, 8, 8, 1), np.float32), y=z(4, np.int64))
    elif kind == "3-d x":
        np.savez(path, x=z((4, 8, 8), u8), y=z(4, np.int64))
    elif kind == "length mismatch":
        np.savez(path, x=z((4, 8, 8, 1), u8), y=z(3, np.int64))
    elif kind == "missing y":
        np.savez(path, x=z((4, 8, 8, 1), u8))
    elif kind == "not an npz":
        path.write_text("x,y\n1,2\n")
    elif kind == "empty":
        np.savez(path, x=z((0, 8, 8, 1), u8), y=z(0, np.int64))
    elif kind == "float labels":
        np.savez(path, x=z((4, 8, 8, 1), u8), y=z(4, np.float32))
    elif kind == "compressed float32 x":  # the in-memory fallback, which open_local_data does not check
        np.savez_compressed(path, x=z((4, 8, 8, 1), np.float32), y=z(4, np.int64))


@pytest.mark.parametrize("kind, says", [
    ("float32 x", "float32"), ("3-d x", "(4, 8, 8)"), ("length mismatch", "labels of shape (3,)"),
    ("missing y", "no array 'y'"), ("not an npz", "not an .npz"), ("empty", "empty"),
    ("float labels", "labels are float32"), ("compressed float32 x", "float32"),
])
def test_check_names_what_is_wrong(tmp_path: Path, capsys, kind: str, says: str) -> None:
    path = tmp_path / "bad.npz"
    _bad(path, kind)
    assert main(["data", "check", str(path)]) == 2
    line = _error_line(capsys)
    assert line.startswith(f"splitedge data: error: {path}") and says in line, line


def test_check_does_not_import_torch(tmp_path: Path) -> None:
    save_shard(tmp_path / "d0.npz", np.zeros((5, 4, 4, 1), np.uint8), np.arange(5))
    code = ("import sys\nfrom splitedge.cli import main\n"
            f"assert main(['data', 'check', {str(tmp_path / 'd0.npz')!r}]) == 0\n"
            "print('HEAVY', [m for m in ('torch', 'torchvision', 'sklearn') if m in sys.modules])\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "HEAVY []" in proc.stdout, proc.stdout
