"""The thin device's streamed images behave like the in-memory arrays they replace."""

from __future__ import annotations

import zipfile
from pathlib import Path

import numpy as np
import pytest

from splitedge.methods.data.local import NpzImages, open_local_data
from splitedge.methods.data.datasets import load_image_folder, save_shard
from image_tree import make_tree


@pytest.fixture()
def shard(tmp_path: Path) -> tuple[Path, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 256, (37, 5, 4, 3), dtype=np.uint8), rng.integers(0, 10, 37)
    path = tmp_path / "d0.npz"
    save_shard(path, x, y, device=3)
    return path, x, y


def test_npz_rows_equal_the_loaded_array_for_every_index_form(shard) -> None:
    path, x, y = shard
    lazy, labels = open_local_data(path, stream=True)

    assert isinstance(lazy, NpzImages) and lazy.shape == x.shape and lazy.dtype == np.uint8 and len(lazy) == 37
    np.testing.assert_array_equal(labels, y)
    for key in (slice(0, 8), slice(30, 99), slice(5, 5), slice(None, None, 3), 0, -1, 36,
                np.array([4, 0, 36, 4]), np.arange(37) % 2 == 0, [-2, 1]):
        np.testing.assert_array_equal(lazy[key], x[key], err_msg=repr(key))
    np.testing.assert_array_equal(np.asarray(lazy), x)
    with pytest.raises(IndexError):
        lazy[37]
    with pytest.raises(IndexError):
        lazy[np.array([0, 40])]


def test_compressed_members_load_into_memory_and_non_images_are_refused(tmp_path: Path) -> None:
    x = np.zeros((4, 2, 2, 3), np.uint8)
    np.savez_compressed(tmp_path / "c.npz", x=x, y=np.zeros(4, np.int64))
    with pytest.raises(ValueError, match="compressed"):
        NpzImages(tmp_path / "c.npz")
    eager, _ = open_local_data(tmp_path / "c.npz", stream=True)  # falls back to memory, still works
    assert isinstance(eager, np.ndarray) and eager.shape == x.shape
    np.savez(tmp_path / "f.npz", x=x.astype(np.float32), y=np.zeros(4, np.int64))
    with pytest.raises(ValueError, match="uint8"):
        NpzImages(tmp_path / "f.npz")


def test_truncated_shard_is_refused(shard, tmp_path: Path) -> None:
    path, _, _ = shard
    with zipfile.ZipFile(path) as zf:
        info = zf.getinfo("x.npy")
    cut = tmp_path / "cut.npz"
    cut.write_bytes(path.read_bytes()[: info.header_offset + 200])
    with pytest.raises((ValueError, zipfile.BadZipFile)):
        open_local_data(cut, stream=True)


def test_labels_must_match_images(tmp_path: Path) -> None:
    np.savez(tmp_path / "m.npz", x=np.zeros((4, 2, 2, 3), np.uint8), y=np.zeros(3, np.int64))
    with pytest.raises(ValueError, match="labels"):
        open_local_data(tmp_path / "m.npz", stream=True)


def test_folder_is_decoded_on_access_like_the_eager_loader(tmp_path: Path) -> None:
    make_tree(tmp_path)
    want_x, want_y, _ = load_image_folder(tmp_path / "train")
    lazy, labels = open_local_data(tmp_path / "train", stream=True)

    assert lazy.shape == want_x.shape
    np.testing.assert_array_equal(labels, want_y)
    np.testing.assert_array_equal(lazy[1:5], want_x[1:5])
    np.testing.assert_array_equal(np.asarray(lazy), want_x)


class PixelExtractor:
    """Features = the normalised pixels, so the moments depend on every image byte read."""

    def features(self, x: np.ndarray) -> np.ndarray:
        return x

    def load_weights(self, weights) -> None:
        pass


def test_thin_device_moments_are_the_same_streamed_or_in_memory(shard) -> None:
    from parts import device_ctx
    from splitedge.methods.config import ModelSpec
    from splitedge.methods.hsfp.device import HSFPDevice

    path, x, y = shard
    spec = ModelSpec(model="cnn", num_classes=10, channels=3, image_size=4, mean=(0.5, 0.4, 0.3), std=(0.25, 0.2, 0.3))
    got = []
    for data in ((x, y), open_local_data(path, stream=True)):
        device = HSFPDevice(device_ctx("hsfp", "d0", spec=spec), data, PixelExtractor())
        device.moment_batch = 8  # several partial reads, the last one short
        got.append(device.compute_moments())
    np.testing.assert_array_equal(got[0].counts, got[1].counts)
    np.testing.assert_array_equal(got[0].mean, got[1].mean)
    np.testing.assert_array_equal(got[0].var, got[1].var)
