"""A cloud checkpoint read without torch: is it a whole safetensors file, and what does it say
about the network it holds.

`splitedge export` runs these checks before it imports torch (about 10 s on a small machine),
so a missing file, one that is not safetensors (the cloud's resume.state, a text file) or one
cut short is one line at once. The cloud writes `model_metadata` into every checkpoint, so
export rebuilds the network from the file alone; `ModelInfo` reads it back. Nothing here
imports torch or safetensors (the header is 8 bytes of length and a JSON map).
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

HEADER_LIMIT = 100_000_000
"""safetensors' own cap on the JSON header: a larger length is not a safetensors file."""
MODEL_KEYS = ("model", "dataset", "input_shape", "num_classes", "mean", "std")
"""Metadata keys that describe the network (besides `method` and `round`)."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be used, in one line that says why (exit code 2 in the CLI)."""


@dataclass(frozen=True)
class Header:
    """The tensors' names, dtypes and shapes, and the string metadata of a safetensors file."""

    tensors: dict[str, dict[str, Any]]
    metadata: dict[str, str]


def read_header(path: Path) -> Header:
    """The header of the safetensors file at `path`, after checking the file is whole.

    CheckpointError when it is missing, a folder, not safetensors, or shorter than its header says.
    """
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path}: no such file")
    if path.is_dir():
        raise CheckpointError(f"{path} is a folder; give its model.safetensors")
    size = path.stat().st_size
    with open(path, "rb") as fh:
        head = fh.read(8)
        length = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
        if len(head) < 8 or length == 0 or length > HEADER_LIMIT:
            raise CheckpointError(_not_safetensors(path, size))
        raw = fh.read(length)
    if len(raw) < length:
        if raw[:1] == b"{":
            raise CheckpointError(f"{path} is cut short: {size} bytes, its header alone needs {8 + length}")
        raise CheckpointError(_not_safetensors(path, size))
    header = _parse(raw)
    if header is None:
        raise CheckpointError(_not_safetensors(path, size))
    metadata = header.pop("__metadata__", None) or {}
    end = max((int(t["data_offsets"][1]) for t in header.values()), default=0)
    if size < 8 + length + end:
        raise CheckpointError(f"{path} is cut short: {size} bytes of {8 + length + end} (a copy that did not "
                              f"finish, or a full disk)")
    return Header(header, {str(k): str(v) for k, v in metadata.items()})


def _parse(raw: bytes) -> dict[str, Any] | None:
    """The header's JSON map, or None when it is not a safetensors header."""
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return None
    if not isinstance(header, dict) or not isinstance(header.get("__metadata__", {}), dict):
        return None
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    if not all(isinstance(t, dict) and _offsets(t.get("data_offsets")) for t in tensors.values()):
        return None
    return header


def _offsets(value: Any) -> bool:
    return isinstance(value, list) and len(value) == 2 and all(isinstance(v, int) and v >= 0 for v in value)


def _not_safetensors(path: Path, size: int) -> str:
    """The one line for a file that is not a checkpoint, pointing at the model beside it if any."""
    text = f"{path} is not a safetensors checkpoint" + (" (empty)" if size == 0 else "")
    beside = path.parent / "model.safetensors"
    if path.name != beside.name and beside.is_file():
        text += f"; the cloud's model is {beside}"
    return text


def _clip(meta: Mapping[str, str]) -> float | None:
    if "head_input_clip" not in meta:
        return None
    clip = float(meta["head_input_clip"])
    if not clip > 0 or clip != clip or clip == float("inf"):
        raise ValueError(f"head_input_clip={meta['head_input_clip']!r} is not a positive number")
    return clip


HEAD_LAYER = re.compile(r"(wc|we)(_[1-9][0-9]{0,2})?")
"""A head's layer off the classifier as a checkpoint names it (methods/calibration/layers.py)."""


def _layer(meta: Mapping[str, str]) -> str | None:
    if "head_layer" not in meta:
        return None
    if not HEAD_LAYER.fullmatch(meta["head_layer"]):
        raise ValueError(f"head_layer={meta['head_layer']!r} is not one layer off the classifier (wc, wc_S, we, we_S)")
    return meta["head_layer"]


def model_metadata(*, model: str, dataset: str, channels: int, image_size: int, num_classes: int,
                   mean: tuple[float, ...], std: tuple[float, ...]) -> dict[str, str]:
    """What the cloud writes into a checkpoint so export can rebuild and feed its network
    (safetensors metadata values are strings; lists as JSON). `dataset` "" is left out."""
    meta = {"model": model, "input_shape": json.dumps([channels, image_size, image_size]),
            "num_classes": str(num_classes), "mean": json.dumps(list(mean)), "std": json.dumps(list(std))}
    return {**meta, "dataset": dataset} if dataset else meta


@dataclass(frozen=True)
class ModelInfo:
    """A checkpoint's description of itself; None where it does not say (older checkpoints)."""

    method: str | None = None
    round: int | None = None
    model: str | None = None
    dataset: str | None = None
    input_shape: tuple[int, int, int] | None = None
    num_classes: int | None = None
    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None
    head_input_clip: float | None = None
    """The L2 norm the classifier's input is clipped to (a head calibrated on private statistics)."""
    head_layer: str | None = None
    """Where a calibrated head sits when not at the classifier's input (methods/calibration/layers.py)."""

    @classmethod
    def from_metadata(cls, meta: Mapping[str, str], path: Path) -> "ModelInfo":
        """Parse `meta`; a value that does not read is a CheckpointError naming its key."""
        try:
            shape = _json(meta, "input_shape")
            if shape is not None and (not isinstance(shape, list) or len(shape) != 3):
                raise ValueError(f"input_shape={meta['input_shape']!r} is not [channels, height, width]")
            return cls(method=meta.get("method"), round=int(meta["round"]) if "round" in meta else None,
                       model=meta.get("model"), dataset=meta.get("dataset"),
                       input_shape=tuple(int(v) for v in shape) if shape is not None else None,
                       num_classes=int(meta["num_classes"]) if "num_classes" in meta else None,
                       mean=_floats(meta, "mean"), std=_floats(meta, "std"),
                       head_input_clip=_clip(meta), head_layer=_layer(meta))
        except (TypeError, ValueError) as exc:
            raise CheckpointError(f"{path}: unreadable metadata ({exc})") from None

    @property
    def describes_model(self) -> bool:
        """Whether the network can be rebuilt from this alone (no --model/--dataset needed)."""
        return None not in (self.model, self.input_shape, self.num_classes, self.mean, self.std)


def _json(meta: Mapping[str, str], key: str) -> Any:
    if key not in meta:
        return None
    try:
        return json.loads(meta[key])
    except ValueError:
        raise ValueError(f"{key}={meta[key]!r} is not JSON") from None


def _floats(meta: Mapping[str, str], key: str) -> tuple[float, ...] | None:
    value = _json(meta, key)
    return None if value is None else tuple(float(v) for v in value)
