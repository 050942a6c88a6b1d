"""Image data sets as plain uint8 arrays, plus per-device shards.

numpy + PIL only at import time (a thin device without torch or sklearn uses this module);
sklearn is imported lazily for "digits". Decoded CIFAR-10 is cached as an .npz outside the
repo so that only the first load pays for unpacking and JPEG decoding.

Besides the two shipped ones, a data set of one's own: "images" reads `--data`, an .npz
(x_train, y_train, x_test, y_test, optionally classes) or a folder of train/<class>/* and
test/<class>/*; an import path `package.module:loader` (protocol/plugins.py) names a loader
the owner wrote, called with `--data` (or nothing) and returning (train, test, classes). Every
one is checked once (`checked_splits`): one line naming what does not fit.
"""
from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import pickle  # only for torchvision's cifar-10-batches-py, a standard third-party format
import shutil
import tarfile
import tempfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from splitedge.protocol import plugins

log = logging.getLogger(__name__)

Split = tuple[np.ndarray, np.ndarray]  # (x uint8 [N,H,W,C], y int64 [N])
Stats = tuple[tuple[float, ...], tuple[float, ...]]  # per-channel (mean, std) in [0, 1] units
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp")
CACHE_FORMAT = 1  # bump when the cached .npz layout changes, so stale caches are rebuilt
BUILT_IN = ("digits", "cifar10")
OWN_IMAGES = "images"
DATASET_HELP = ("digits (bundled with scikit-learn), cifar10 (needs --data), images (one's own: --data an .npz of "
                "x_train, y_train, x_test, y_test[, classes], or a folder of train/<class>/* and test/<class>/*), or "
                "a loader of one's own as package.module:function (docs/plugins.md)")
DEFAULT_CIFAR_ARCHIVE = Path(__file__).resolve().parents[2] / ".." / "shared" / "data" / "cifar10-jpeg.tar.gz"


@dataclass(frozen=True)
class DatasetInfo:
    """What a model needs to know about a data set; mean/std are per channel in [0, 1] units."""

    name: str
    num_classes: int
    channels: int
    image_size: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    classes: tuple[str, ...]


def load_dataset(name: str, path: str | os.PathLike | None = None, cache_dir: str | os.PathLike | None = None,
                 *, limit_per_class: int | None = None, max_train: int | None = None,
                 max_test: int | None = None, seed: int = 0) -> tuple[Split, Split, DatasetInfo]:
    """Load "digits" or "cifar10" as (train, test, info).

    mean/std come from the full train split (before any subsampling), so they do not depend
    on how much data a fast run keeps. limit_per_class/max_train subsample train and max_test
    subsamples test, deterministically from `seed`.
    """
    stats = None
    if name == "digits":
        train, test, classes = _load_digits(seed=0)
    elif name == "cifar10":
        train, test, classes, stats = _load_cifar10(Path(path) if path else DEFAULT_CIFAR_ARCHIVE, cache_dir)
    elif name == OWN_IMAGES:
        train, test, classes = checked_splits(*_load_images(path), where=f"--data {path}")
    elif plugins.is_import_path(name):
        train, test, classes = checked_splits(*_load_with(name, path), where=f"data set {name}")
    else:
        raise ValueError(f"unknown data set {name!r}; expected {DATASET_HELP}")
    mean, std = stats or channel_stats(train[0])
    info = DatasetInfo(name, len(classes), train[0].shape[3], train[0].shape[1], mean, std, tuple(classes))
    train = subsample(train, seed=seed, limit_per_class=limit_per_class, max_n=max_train)
    test = subsample(test, seed=seed + 1, max_n=max_test)
    return train, test, info


def check_dataset_name(name: str) -> str:
    """`name` when it is a data set this module can load (the name's form only: nothing is read
    or imported yet); ValueError saying what is accepted otherwise."""
    if name in BUILT_IN or name == OWN_IMAGES or plugins.is_import_path(name):
        return name
    raise ValueError(f"unknown data set {name!r}; expected {DATASET_HELP}")


def dataset_argument(value: str) -> str:
    """check_dataset_name as an argparse type (its message on error)."""
    import argparse

    try:
        return check_dataset_name(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _load_images(path: str | os.PathLike | None) -> tuple[Split, Split, list[str]]:
    """One's own images: an .npz of both splits, or a train/ and test/ ImageFolder tree."""
    if path is None:
        raise ValueError("--dataset images reads --data: an .npz (x_train, y_train, x_test, y_test[, classes]) or a "
                         "folder of train/<class>/* and test/<class>/*")
    root = Path(path)
    if root.is_file():
        try:
            with np.load(root, allow_pickle=False) as z:
                missing = [k for k in ("x_train", "y_train", "x_test", "y_test") if k not in z.files]
                if missing:
                    raise ValueError(f"--data {root}: the .npz lacks {', '.join(missing)} (it holds {', '.join(z.files)})")
                n = int(max(z["y_train"].max(initial=0), z["y_test"].max(initial=0))) + 1
                classes = [str(c) for c in z["classes"]] if "classes" in z.files else [str(i) for i in range(n)]
                return (z["x_train"], z["y_train"]), (z["x_test"], z["y_test"]), classes
        except (OSError, zlib.error) as exc:
            raise ValueError(f"--data {root}: not a readable .npz ({exc})") from None
    if (root / "train").is_dir() and (root / "test").is_dir():
        return _load_tree(root)
    raise ValueError(f"--data {root}: --dataset images reads an .npz file or a folder with train/ and test/ "
                     f"(each <class>/<image>)")


def _load_with(name: str, path: str | os.PathLike | None) -> tuple[Split, Split, list[str]]:
    """A loader of one's own, named by the owner's command line: `loader(data)` (or `loader()`
    without --data) returning (train, test, classes), each split (x, y)."""
    loader = plugins.load(name, "data set")
    out = loader(path) if path is not None else loader()
    try:
        (xtr, ytr), (xte, yte), classes = out
    except (TypeError, ValueError):
        raise ValueError(f"data set {name} returned {type(out).__name__}, not ((x_train, y_train), (x_test, y_test), "
                         f"classes)") from None
    return (xtr, ytr), (xte, yte), [str(c) for c in classes]


def checked_splits(train: Split, test: Split, classes: list[str], *, where: str) -> tuple[Split, Split, list[str]]:
    """A data set of one's own as the shipped ones are: x uint8 [N, H, H, C] (a [N, H, H] array
    gains its channel), y int64 [N] in 0..classes-1, both splits of one image shape, at least
    two classes. ValueError naming the first thing that does not fit."""
    if len(classes) < 2 or len(set(classes)) != len(classes):
        raise ValueError(f"{where}: {len(classes)} class name(s) {list(classes)[:5]}: at least two, each once")
    out = []
    for split_name, (x, y) in (("train", train), ("test", test)):
        x, y = np.asarray(x), np.asarray(y)
        if x.ndim == 3:
            x = x[..., None]
        if x.dtype != np.uint8 or x.ndim != 4 or x.shape[1] != x.shape[2] or x.shape[1] < 4:
            raise ValueError(f"{where}: {split_name} images are {x.dtype} {x.shape}; expected uint8 [N, H, H, C] "
                             f"(square, H >= 4, values 0..255)")
        if y.ndim != 1 or len(y) != len(x) or not len(y) or y.dtype.kind not in "iu":
            raise ValueError(f"{where}: {split_name} labels are {y.dtype} {y.shape} for {len(x)} images; expected one "
                             f"integer label per image")
        if int(y.min()) < 0 or int(y.max()) >= len(classes):
            raise ValueError(f"{where}: {split_name} labels run {int(y.min())}..{int(y.max())}, outside 0.."
                             f"{len(classes) - 1} ({len(classes)} classes)")
        out.append((np.ascontiguousarray(x), y.astype(np.int64)))
    if out[0][0].shape[1:] != out[1][0].shape[1:]:
        raise ValueError(f"{where}: train images are {out[0][0].shape[1:]}, test images {out[1][0].shape[1:]}")
    return out[0], out[1], list(classes)


def subsample(split: Split, *, seed: int, limit_per_class: int | None = None, max_n: int | None = None) -> Split:
    """Seeded subset keeping the original order, for fast runs."""
    x, y = split
    keep = np.arange(len(y))
    rng = np.random.default_rng(seed)
    if limit_per_class is not None:
        keep = np.concatenate([rng.permutation(np.flatnonzero(y == c))[:limit_per_class] for c in np.unique(y)])
    if max_n is not None and len(keep) > max_n:
        keep = rng.permutation(keep)[:max_n]
    keep = np.sort(keep)
    return (x, y) if len(keep) == len(y) else (x[keep], y[keep])


def channel_stats(x: np.ndarray, chunk: int = 2048) -> Stats:
    """Per-channel mean and std of uint8 images in [0, 1] units, chunked to bound memory."""
    c = x.shape[-1]
    s, ss, n = np.zeros(c), np.zeros(c), 0
    for i in range(0, len(x), chunk):
        part = x[i:i + chunk].reshape(-1, c).astype(np.float64) / 255.0
        s += part.sum(axis=0)
        ss += np.square(part).sum(axis=0)
        n += len(part)
    mean = s / n
    std = np.sqrt(np.maximum(ss / n - mean ** 2, 0.0))
    return tuple(float(v) for v in mean), tuple(float(v) for v in std)


def _load_digits(seed: int) -> tuple[Split, Split, list[str]]:
    """sklearn's bundled 8x8 digits (offline), values 0..16 scaled to 0..255, stratified 80/20."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    d = load_digits()
    x = np.rint(d.images * (255.0 / 16.0)).clip(0, 255).astype(np.uint8)[..., None]
    y = d.target.astype(np.int64)
    xtr, xte, ytr, yte = train_test_split(x, y, test_size=0.2, stratify=y, random_state=seed)
    return (xtr, ytr), (xte, yte), [str(i) for i in range(10)]


def _load_cifar10(path: Path, cache_dir: str | os.PathLike | None) -> tuple[Split, Split, list[str], Stats | None]:
    """Dispatch on what `path` is: the JPEG archive, an ImageFolder tree, or cifar-10-batches-py.

    Only the archive path returns cached channel stats (recomputing them costs ~2 s on 50k images).
    """
    if path.is_file():
        return _load_archive(path, cache_root(cache_dir))
    if (path / "cifar-10-batches-py" / "data_batch_1").is_file():
        path = path / "cifar-10-batches-py"
    if (path / "data_batch_1").is_file():
        return (*_load_cifar_batches(path), None)
    if (path / "train").is_dir() and (path / "test").is_dir():
        return (*_load_tree(path), None)
    raise ValueError(f"{path}: not a CIFAR-10 archive, ImageFolder tree or cifar-10-batches-py folder")


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """$SPLITEDGE_CACHE or ~/.cache/splitedge unless given; always outside the repo."""
    root = cache_dir or os.environ.get("SPLITEDGE_CACHE") or Path.home() / ".cache" / "splitedge"
    return Path(root).expanduser()


def _load_tree(root: Path) -> tuple[Split, Split, list[str]]:
    """ImageFolder train/ and test/; the test classes must match the train classes."""
    xtr, ytr, classes = load_image_folder(root / "train")
    xte, yte, _ = load_image_folder(root / "test", classes=classes)
    return (xtr, ytr), (xte, yte), classes


def _load_archive(archive: Path, root: Path) -> tuple[Split, Split, list[str], Stats]:
    """Unpack and decode once into `root`, keyed by the archive's sha256; later loads read the .npz."""
    key = file_sha256(archive)[:16]
    npz = root / f"cifar10-{key}-v{CACHE_FORMAT}.npz"
    if not npz.exists():
        root.mkdir(parents=True, exist_ok=True)
        with _file_lock(root / f"cifar10-{key}.lock"):
            if not npz.exists():  # another process may have built it while we waited
                log.info("building CIFAR-10 cache %s from %s (once, ~20 s)", npz, archive)
                try:
                    tree = _unpack_once(archive, root / f"cifar10-{key}")
                except (tarfile.TarError, EOFError, zlib.error, OSError) as exc:
                    reason = str(exc).splitlines()[-1].lstrip("- ") if str(exc) else type(exc).__name__
                    raise ValueError(f"{archive}: not a readable CIFAR-10 archive ({reason}); is the file complete? "
                                     f"(../shared/data/README.md gives its sha256)") from None
                (xtr, ytr), (xte, yte), classes = _load_tree(tree)
                mean, std = channel_stats(xtr)
                _atomic_savez(npz, x_train=xtr, y_train=ytr, x_test=xte, y_test=yte, classes=np.array(classes),
                              mean=np.array(mean), std=np.array(std))
    with np.load(npz, allow_pickle=False) as z:
        stats = (tuple(z["mean"].tolist()), tuple(z["std"].tolist()))
        return (z["x_train"], z["y_train"]), (z["x_test"], z["y_test"]), [str(c) for c in z["classes"]], stats


def file_sha256(path: Path) -> str:
    """Hex sha256 of a file, read a megabyte at a time."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """Exclusive advisory lock so two processes do not build the same cache at once."""
    try:
        import fcntl
    except ImportError:  # no flock (Windows): atomic renames still keep the cache consistent
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _unpack_once(archive: Path, dest: Path) -> Path:
    """Extract into a temp dir next to `dest`, then rename, so a half-unpacked tree is never seen."""
    if dest.is_dir():
        return dest
    tmp = Path(tempfile.mkdtemp(prefix=".unpack-", dir=dest.parent))
    try:
        with tarfile.open(archive, "r:*") as tar:
            members = [_checked_member(m) for m in tar.getmembers()]
            tar.extractall(tmp, members=[m for m in members if m is not None], filter="data")
        os.rename(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def _checked_member(m: tarfile.TarInfo) -> tarfile.TarInfo | None:
    """Reject absolute paths and '..'; skip links and specials (the archive only needs files/dirs)."""
    parts = Path(m.name).parts
    if m.name.startswith(("/", "\\")) or Path(m.name).is_absolute() or ".." in parts:
        raise ValueError(f"unsafe path in archive: {m.name!r}")
    return m if (m.isfile() or m.isdir()) else None


def _atomic_savez(path: Path, **arrays: np.ndarray) -> None:
    """Write to a temp file in the same directory, then os.replace (readers never see a partial file)."""
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".npz", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **arrays)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def _load_cifar_batches(folder: Path) -> tuple[Split, Split, list[str]]:
    """torchvision's cifar-10-batches-py; its pickles are a fixed public format, read with encoding=bytes."""
    def read(name: str) -> dict:
        with open(folder / name, "rb") as f:
            return pickle.load(f, encoding="bytes")  # noqa: S301 - standard CIFAR format, not ours

    def split(names: list[str]) -> Split:
        batches = [read(n) for n in names]
        x = np.concatenate([np.asarray(b[b"data"], dtype=np.uint8) for b in batches])
        y = np.concatenate([np.asarray(b[b"labels"], dtype=np.int64) for b in batches])
        return np.ascontiguousarray(x.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)), y

    classes = [c.decode() for c in read("batches.meta")[b"label_names"]]
    return split([f"data_batch_{i}" for i in range(1, 6)]), split(["test_batch"]), classes


def load_image_folder(path: str | os.PathLike, classes: list[str] | None = None,
                      mode: str | None = None) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """Read <path>/<class>/<image> into (x uint8 [N,H,W,C], y int64 [N], classes).

    Class order = sorted folder names unless `classes` is given (e.g. the train order for test).
    mode: a PIL mode ("RGB", "L"); default RGB unless every image is single-channel.
    """
    root = Path(path)
    files, labels, classes = list_image_folder(root, classes)
    images = [read_image(f, mode) for f in files]
    if mode is None and any(im.ndim == 3 for im in images):
        images = [np.repeat(im[..., None], 3, axis=2) if im.ndim == 2 else im for im in images]
    shapes = {im.shape for im in images}
    if len(shapes) != 1:
        raise ValueError(f"{root}: images differ in shape: {sorted(shapes)[:3]}")
    x = np.stack(images)
    return (x if x.ndim == 4 else x[..., None]), labels, classes


def list_image_folder(root: Path, classes: list[str] | None = None) -> tuple[list[Path], np.ndarray, list[str]]:
    """(image files, int64 labels, classes) of <root>/<class>/<image>, in class then name order."""
    classes = classes if classes is not None else sorted(p.name for p in root.iterdir() if p.is_dir())
    files: list[Path] = []
    labels: list[int] = []
    for label, cls in enumerate(classes):
        if not (root / cls).is_dir():
            raise ValueError(f"{root}: class folder {cls!r} missing")
        names = sorted(p for p in (root / cls).iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
        files += names
        labels += [label] * len(names)
    if not files:
        raise ValueError(f"{root}: no images found")
    return files, np.asarray(labels, dtype=np.int64), list(classes)


def read_image(path: Path, mode: str | None) -> np.ndarray:
    from PIL import Image  # only where images are decoded: a thin device reading an .npz never loads it

    with Image.open(path) as im:
        if mode is None:
            mode = "L" if im.mode in ("L", "1", "I;16") else "RGB"
        return np.asarray(im.convert(mode), dtype=np.uint8)


def save_shard(path: str | os.PathLike, x: np.ndarray, y: np.ndarray, **meta_ints: int) -> None:
    """Save one device's data as an .npz (no pickle); integer metadata such as device index or seed."""
    x, y = np.asarray(x), np.asarray(y)
    if len(x) != len(y) or y.ndim != 1:
        raise ValueError(f"x has {len(x)} rows but y has shape {y.shape}")
    meta = {}
    for k, v in meta_ints.items():
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise ValueError(f"shard metadata {k!r} must be an int, got {type(v).__name__}")
        meta[f"meta_{k}"] = np.int64(v)
    with open(path, "wb") as f:  # a file object stops np.savez from appending ".npz"
        np.savez(f, x=x, y=y.astype(np.int64), **meta)


def load_shard(path: str | os.PathLike) -> Split:
    """(x, y) of a shard written by save_shard; never unpickles."""
    with np.load(path, allow_pickle=False) as z:
        return z["x"], z["y"]


def load_shard_meta(path: str | os.PathLike) -> dict[str, int]:
    """The integer metadata given to save_shard."""
    with np.load(path, allow_pickle=False) as z:
        return {k[5:]: int(z[k]) for k in z.files if k.startswith("meta_")}
