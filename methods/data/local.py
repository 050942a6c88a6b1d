"""A device's local images, read from storage a batch at a time instead of held in memory.

A thin device computes moments in small batches, so it never needs all its images at once:
5,000 CIFAR images are 15 MB of the 80 MB a Pi-class process may use. `NpzImages` reads rows
of an uncompressed .npz member straight from the file (`os.pread` at the member's offset; the
OS page cache, not this process, holds what was read) and `FolderImages` decodes image files
on access. Both behave like the uint8 [N, H, W, C] array for what the device parts do with it:
``len``, ``shape``, ``dtype``, ``x[a:b]``, ``x[int_array]`` and ``np.asarray(x)``.
Labels are small and always loaded.
"""

from __future__ import annotations

import logging
import os
import struct
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

from splitedge.methods.data.datasets import list_image_folder, load_image_folder, load_shard, read_image

log = logging.getLogger(__name__)

LOCAL_HEADER = struct.Struct("<4s5H3I2H")  # zip local file header, 30 bytes
LOCAL_MAGIC = b"PK\x03\x04"


class CompressedMember(ValueError):
    """The .npz member is deflated, so its rows cannot be read in place."""


class _RowImages:
    """Array-like over N images of one shape; subclasses read rows."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        self.shape = tuple(int(d) for d in shape)
        self.dtype = np.dtype(np.uint8)
        self.ndim = len(self.shape)

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, key: Any) -> np.ndarray:
        n = len(self)
        if isinstance(key, (int, np.integer)):
            i = int(key) + n if key < 0 else int(key)
            if not 0 <= i < n:
                raise IndexError(f"index {key} out of range for {n} images")
            return self._rows(i, i + 1)[0]
        if isinstance(key, slice):
            start, stop, step = key.indices(n)
            if step == 1:
                return self._rows(start, max(start, stop))
            key = np.arange(start, stop, step)
        idx = np.asarray(key)
        if idx.dtype == bool:
            idx = np.flatnonzero(idx)
        if idx.ndim != 1 or not np.issubdtype(idx.dtype, np.integer):
            raise IndexError(f"unsupported index {key!r}")
        idx = np.where(idx < 0, idx + n, idx)
        if idx.size and (idx.min() < 0 or idx.max() >= n):
            raise IndexError(f"index out of range for {n} images")
        out = np.empty((len(idx), *self.shape[1:]), dtype=np.uint8)
        for j, i in enumerate(idx):
            out[j] = self._rows(int(i), int(i) + 1)[0]
        return out

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        x = self._rows(0, len(self))
        return x if dtype is None else x.astype(dtype)

    def _rows(self, start: int, stop: int) -> np.ndarray:
        raise NotImplementedError


class NpzImages(_RowImages):
    """Member ``x`` of an uncompressed .npz (what `save_shard` writes), read on demand."""

    def __init__(self, path: str | os.PathLike, member: str = "x") -> None:
        self.path = Path(path)
        with zipfile.ZipFile(self.path) as zf:
            try:
                info = zf.getinfo(f"{member}.npy")
            except KeyError:
                raise ValueError(f"{self.path}: no array {member!r}") from None
        if info.compress_type != zipfile.ZIP_STORED:
            raise CompressedMember(f"{self.path}: {member!r} is compressed; it cannot be read in place")
        with open(self.path, "rb") as f:
            f.seek(info.header_offset)
            head = f.read(LOCAL_HEADER.size)
            if len(head) != LOCAL_HEADER.size or head[:4] != LOCAL_MAGIC:
                raise ValueError(f"{self.path}: bad zip local header for {member!r}")
            fields = LOCAL_HEADER.unpack(head)
            f.seek(info.header_offset + LOCAL_HEADER.size + fields[-2] + fields[-1])
            version = np.lib.format.read_magic(f)
            read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) \
                else np.lib.format.read_array_header_2_0
            shape, fortran, dtype = read_header(f)
            self.offset = f.tell()
        if dtype != np.uint8 or fortran or len(shape) != 4:
            raise ValueError(f"{self.path}: expected C-order uint8 images [N,H,W,C], got {dtype} {shape}")
        if self.offset + int(np.prod(shape)) > self.path.stat().st_size:
            raise ValueError(f"{self.path}: {member!r} is truncated")
        super().__init__(shape)
        self.row_bytes = int(np.prod(shape[1:]))
        self._fd = os.open(self.path, os.O_RDONLY)

    def _rows(self, start: int, stop: int) -> np.ndarray:
        size = (stop - start) * self.row_bytes
        buf = bytearray(size)
        view, done = memoryview(buf), 0
        while done < size:  # pread may return less than asked
            got = os.preadv(self._fd, [view[done:]], self.offset + start * self.row_bytes + done)
            if got <= 0:
                raise OSError(f"{self.path}: short read")
            done += got
        return np.frombuffer(buf, dtype=np.uint8).reshape(stop - start, *self.shape[1:])

    def close(self) -> None:
        if getattr(self, "_fd", None) is not None:
            os.close(self._fd)
            self._fd = None

    def __del__(self) -> None:
        self.close()


class FolderImages(_RowImages):
    """<root>/<class>/<image> decoded on access; every image must have the first one's shape."""

    def __init__(self, files: list[Path], mode: str) -> None:
        if not files:
            raise ValueError("no images")
        self.files, self.mode = files, mode
        first = self._decode(files[0])
        super().__init__((len(files), *first.shape))

    def _decode(self, path: Path) -> np.ndarray:
        im = read_image(path, self.mode)
        return im if im.ndim == 3 else im[..., None]

    def _rows(self, start: int, stop: int) -> np.ndarray:
        out = np.empty((stop - start, *self.shape[1:]), dtype=np.uint8)
        for j, path in enumerate(self.files[start:stop]):
            im = self._decode(path)
            if im.shape != self.shape[1:]:
                raise ValueError(f"{path}: shape {im.shape} differs from {self.shape[1:]}")
            out[j] = im
        return out


def folder_images(root: str | os.PathLike) -> tuple[FolderImages, np.ndarray]:
    """(images, labels) of <root>/<class>/<image>, classes in sorted folder order."""
    files, labels, _ = list_image_folder(Path(root))
    mode = "L" if all(_mode_of(f) == "L" for f in files) else "RGB"  # as load_image_folder decides
    return FolderImages(files, mode), labels


def _mode_of(path: Path) -> str:
    from PIL import Image

    with Image.open(path) as im:
        return "L" if im.mode in ("L", "1", "I;16") else "RGB"


def open_local_data(path: str | os.PathLike, *, stream: bool) -> tuple[Any, np.ndarray]:
    """A device's (x, y) from an .npz shard or an image folder; ``stream`` keeps images on disk.

    Anything that is not a usable shard (missing, not an .npz, no `x` or `y`, float or 3-D
    images, labels that do not match, empty) is one ValueError naming the file and the problem,
    raised before the device connects anywhere.
    """
    path = Path(path)
    if not path.exists():
        raise ValueError(f"{path}: no such file or folder")
    if path.is_file() and not zipfile.is_zipfile(path):  # np.load would guess pickle and say so
        raise ValueError(f"{path}: not an .npz shard (not a zip archive, or a truncated one); make shards with "
                         "splitedge data split")
    try:
        x, y = _open(path, stream)
    except KeyError as exc:  # np.load's NpzFile: "y is not a file in the archive"
        name = str(exc.args[0] if exc.args else exc).split(" is not a file")[0]
        raise ValueError(f"{path}: no array {name!r} (a shard needs arrays 'x' and 'y')") from None
    except (ValueError, OSError, EOFError, TypeError, zipfile.BadZipFile) as exc:  # truncated, .npy, text, ...
        message = str(exc) or type(exc).__name__
        raise ValueError(message if str(path) in message else f"{path}: {message}") from None
    check_arrays(path, x, y)
    return x, y


def _open(path: Path, stream: bool) -> tuple[Any, np.ndarray]:
    if not stream:
        if path.is_dir():
            x, y, _ = load_image_folder(path)
            return x, y
        return load_shard(path)
    if path.is_dir():
        return folder_images(path)
    with np.load(path, allow_pickle=False) as z:
        y = np.asarray(z["y"])
    try:
        x = NpzImages(path)
    except CompressedMember:  # still works, at the memory cost of holding the images
        log.warning("%s: images are compressed, so they are loaded into memory instead of read "
                    "in place (write the shard with np.savez / save_shard to stream it)", path)
        x, y = load_shard(path)
    return x, y


def check_arrays(path: Path | str, x: Any, y: np.ndarray, num_classes: int | None = None) -> None:
    """What every device's data must be: uint8 images [N,H,W,C], N >= 1, N integer labels >= 0
    (and below `num_classes` once the federation's model is known)."""
    y = np.asarray(y)
    dtype, shape = getattr(x, "dtype", None), tuple(getattr(x, "shape", ()))
    if dtype != np.uint8 or len(shape) != 4:
        raise ValueError(f"{path}: expected uint8 images [N,H,W,C], got {dtype} {shape}")
    if y.ndim != 1 or len(y) != shape[0]:
        raise ValueError(f"{path}: {shape[0]} images but labels of shape {y.shape}")
    if shape[0] == 0:
        raise ValueError(f"{path}: empty (no images)")
    if not np.issubdtype(y.dtype, np.integer):
        raise ValueError(f"{path}: labels are {y.dtype}, expected integers")
    if y.min() < 0:
        raise ValueError(f"{path}: negative labels (min {int(y.min())})")
    if num_classes is not None and y.max() >= num_classes:
        raise ValueError(f"{path}: label {int(y.max())} outside the data set's classes 0..{num_classes - 1}")


def fits_model(x: Any, y: np.ndarray, spec: Any) -> str | None:
    """Why this data cannot train the federation's model (image shape, channels, classes), or None."""
    want = (spec.image_size, spec.image_size, spec.channels)
    shape = tuple(getattr(x, "shape", ()))[1:]
    if shape != want:
        return (f"the run's model takes {want[0]}x{want[1]} images with {want[2]} channel(s) but this device has "
                f"{'x'.join(map(str, shape[:2]))} with {shape[2] if len(shape) > 2 else '?'}; make the shard from the "
                f"run's data set (splitedge data split)")
    if len(y) and int(np.max(y)) >= spec.num_classes:
        return (f"label {int(np.max(y))} is outside the run's {spec.num_classes} classes; make the shard from the "
                f"run's data set (splitedge data split)")
    return None
