"""Data sets: digits, shards, ImageFolder / archive / cifar-10-batches-py readers, torch-free import."""
from __future__ import annotations

import io
import pickle
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import numpy as np
import pytest

from image_tree import COLOURS, make_tree
from splitedge.methods.data.datasets import load_dataset, load_image_folder, load_shard, load_shard_meta, save_shard

REPO = Path(__file__).resolve().parents[2]
CIFAR_ARCHIVE = Path(__file__).parents[2] / ".." / "shared" / "data" / "cifar10-jpeg.tar.gz"

def test_digits_shapes_and_split() -> None:
    (xtr, ytr), (xte, yte), info = load_dataset("digits")
    assert xtr.shape == (1437, 8, 8, 1) and xte.shape == (360, 8, 8, 1)
    assert xtr.dtype == np.uint8 and ytr.dtype == np.int64 and xtr.max() == 255
    assert (info.num_classes, info.channels, info.image_size) == (10, 1, 8)
    assert np.bincount(yte).min() >= 35  # stratified
    again = load_dataset("digits")[0]
    np.testing.assert_array_equal(again[1], ytr)
    small, _, _ = load_dataset("digits", limit_per_class=5, max_test=20)
    assert np.bincount(small[1]).tolist() == [5] * 10


def test_shard_round_trip(tmp_path: Path) -> None:
    x = np.random.default_rng(0).integers(0, 256, (5, 4, 4, 3), dtype=np.uint8)
    y = np.arange(5)
    path = tmp_path / "device-3.shard"
    save_shard(path, x, y, device=3, seed=42)
    assert path.exists()  # no ".npz" appended
    xb, yb = load_shard(path)
    np.testing.assert_array_equal(xb, x)
    np.testing.assert_array_equal(yb, y)
    assert load_shard_meta(path) == {"device": 3, "seed": 42}
    with np.load(path, allow_pickle=False) as z:
        assert sorted(z.files) == ["meta_device", "meta_seed", "x", "y"]
    with pytest.raises(ValueError):
        save_shard(path, x, y, note="text")


def test_image_folder_tree(tmp_path: Path) -> None:
    make_tree(tmp_path)
    x, y, classes = load_image_folder(tmp_path / "train")
    assert classes == ["ant", "cat"] and x.shape == (6, 8, 8, 3) and y.tolist() == [0, 0, 0, 1, 1, 1]
    np.testing.assert_allclose(x[y == 1].mean(axis=(0, 1, 2)), COLOURS["cat"], atol=4)
    (xtr, _), (xte, yte), info = load_dataset("cifar10", path=tmp_path)
    assert info.classes == ("ant", "cat") and xte.shape == (6, 8, 8, 3) and info.image_size == 8
    gray, _, _ = load_image_folder(tmp_path / "train", mode="L")
    assert gray.shape == (6, 8, 8, 1)


def test_archive_is_unpacked_once_and_cached(tmp_path: Path) -> None:
    archive = tmp_path / "tiny.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(make_tree(tmp_path / "src"), arcname=".")
    cache = tmp_path / "cache"
    first = load_dataset("cifar10", path=archive, cache_dir=cache)
    npz = next(cache.glob("cifar10-*.npz"))
    stamp = npz.stat().st_mtime_ns
    second = load_dataset("cifar10", path=archive, cache_dir=cache)
    assert npz.stat().st_mtime_ns == stamp
    np.testing.assert_array_equal(first[0][0], second[0][0])
    assert first[2] == second[2] and first[2].classes == ("ant", "cat")


def test_archive_with_unsafe_member_is_rejected(tmp_path: Path) -> None:
    archive = tmp_path / "evil.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        info = tarfile.TarInfo("../evil.txt")
        info.size = 3
        tar.addfile(info, io.BytesIO(b"bad"))
    with pytest.raises(ValueError, match="unsafe"):
        load_dataset("cifar10", path=archive, cache_dir=tmp_path / "cache")
    assert not (tmp_path / "evil.txt").exists()


def test_cifar_batches_folder(tmp_path: Path) -> None:
    """A fake torchvision cifar-10-batches-py folder (its standard pickled layout)."""
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    rng = np.random.default_rng(0)
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    for name in names:
        batch = {b"data": rng.integers(0, 256, (4, 3072), dtype=np.uint8), b"labels": [0, 1, 2, 9]}
        (folder / name).write_bytes(pickle.dumps(batch))
    meta = {b"label_names": [f"c{i}".encode() for i in range(10)]}
    (folder / "batches.meta").write_bytes(pickle.dumps(meta))
    (xtr, ytr), (xte, _), info = load_dataset("cifar10", path=tmp_path)
    assert xtr.shape == (20, 32, 32, 3) and xte.shape == (4, 32, 32, 3) and info.classes[9] == "c9"
    first = pickle.loads((folder / "data_batch_1").read_bytes())[b"data"][0]
    np.testing.assert_array_equal(xtr[0, 0, 0], first[[0, 1024, 2048]])  # channel-major -> HWC


def test_numpy_modules_import_without_torch_or_sklearn() -> None:
    code = ("import sys, splitedge.methods.moments, splitedge.methods.hsfp.sampling, splitedge.methods.data.datasets, "
            "splitedge.methods.data.partition; "
            "bad = [m for m in ('torch', 'torchvision', 'sklearn') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


@pytest.mark.slow
def test_real_cifar10_archive() -> None:
    if not CIFAR_ARCHIVE.exists():
        pytest.skip(f"{CIFAR_ARCHIVE} not present")
    t0 = time.perf_counter()
    (xtr, ytr), (xte, yte), info = load_dataset("cifar10", path=CIFAR_ARCHIVE)
    assert xtr.shape == (50_000, 32, 32, 3) and xte.shape == (10_000, 32, 32, 3)
    assert np.bincount(ytr).tolist() == [5000] * 10 and np.bincount(yte).tolist() == [1000] * 10
    assert info.classes[0] == "airplane" and info.classes[-1] == "truck"
    # README quotes ~(0.485, 0.477, 0.439); PIL decoding gives (0.491, 0.482, 0.447).
    np.testing.assert_allclose(info.mean, (0.485, 0.477, 0.439), atol=0.01)
    np.testing.assert_allclose(info.std, (0.246, 0.243, 0.260), atol=0.01)
    print(f"cifar10 load took {time.perf_counter() - t0:.1f} s")
