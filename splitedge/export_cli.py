"""`splitedge export`: a cloud checkpoint (safetensors) -> W_c and global-model ONNX files.

Prints one row per (graph, variant) with file size and max |onnx - torch| on real test
images, as a markdown table and as JSON (also written to <out>/export.json).

The checkpoint says which network it holds and how its input is normalised (the cloud writes
that into its metadata: exporters/checkpoint.py), so `--checkpoint` is all export needs; the
flags are for checkpoints written before it did. Everything that can be wrong with the file
or the flags is found before torch is imported, and is one line.
"""

from __future__ import annotations

import argparse
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from splitedge.exporters.checkpoint import CheckpointError, ModelInfo, read_header
from splitedge.methods.data.datasets import BUILT_IN, dataset_argument

log = logging.getLogger(__name__)

DATASETS = BUILT_IN
CHECKPOINT = "model.safetensors"
"""The cloud's checkpoint in its run folder (runtime/outputs.py RUN_FILES)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", required=True, type=Path,
                   help="the cloud's model.safetensors, or the run folder holding it (the folder sim printed, "
                        "e.g. runs/fedavg-20250101-120000)")
    p.add_argument("--dataset", default=None, type=dataset_argument, metavar="DATASET",
                   help="only for checkpoints that do not record their data set (older runs): gives the input "
                        "shape, normalisation and the real images parity is checked on")
    p.add_argument("--data", default=None, help="CIFAR-10: the .tar.gz, an ImageFolder tree or cifar-10-batches-py")
    p.add_argument("--model", default=None,
                   help="network split (cnn | fedcnn | fedcnn2 | resnet18), only for checkpoints that do not record it; "
                        "default: the one the checkpoint fits")
    p.add_argument("--out", default=None, type=Path,
                   help="directory for wc*.onnx, model*.onnx, export.json (default: export/ beside the checkpoint)")
    p.add_argument("--fp16", action="store_true", help="also write float16 variants")
    p.add_argument("--int8", action="store_true", help="also write static int8 (QDQ) variants")
    p.add_argument("--samples", type=int, default=512, help="test images used for the parity check")
    p.add_argument("--calibration", type=int, default=256, help="training images used to calibrate int8")


@dataclass(frozen=True)
class Target:
    """What to export, settled from the checkpoint and the flags before torch is imported."""

    path: Path
    dataset: str
    model: str | None  # None: the first registered model the weights fit (older checkpoints)
    info: ModelInfo


def checkpoint_path(given: Path) -> Path:
    """The checkpoint file: `given`, or the model.safetensors in the run folder `given`."""
    if given.is_dir():
        if not (given / CHECKPOINT).is_file():
            raise CheckpointError(f"{given} is a folder without {CHECKPOINT}; give the run folder the cloud or "
                                  f"sim wrote, or the checkpoint file itself")
        return given / CHECKPOINT
    return given


def check_checkpoint(given: Path, dataset: str | None = None, model: str | None = None) -> Target:
    """Everything export can tell without torch: the file is a whole safetensors checkpoint,
    of a method whose checkpoint is a model, and its network is known (from the metadata or
    the flags). CheckpointError (one line) otherwise."""
    path = checkpoint_path(given)
    info = ModelInfo.from_metadata(read_header(path).metadata, path)
    check_exportable(info.method, path)
    return Target(path, _dataset(info, dataset, path), _agreed("--model", model, info.model), info)


def _own_dataset(name: str, *, typed: bool, data: str | None) -> None:
    """A data set of one's own needs what the run read: `--data` for "images"; and a loader
    the checkpoint names by import path runs only when `--dataset` names it too."""
    from splitedge.protocol.plugins import is_import_path

    if name == "images" and data is None:
        raise CheckpointError("the checkpoint's data set is one's own images: give --data (the .npz or folder the run "
                              "read), whose test images parity is checked on")
    if is_import_path(name) and not typed:
        raise CheckpointError(f"the checkpoint's data set is {name}, a loader of one's own: give --dataset {name} "
                              f"(and its --data) to run it")


def _plugin_model(name: str, typed: bool) -> None:
    """A model of one's own the checkpoint names by import path (models/registry.py) is
    imported only when this command line names it too (`--model`): a checkpoint is data."""
    from splitedge.models import list_models, use_model
    from splitedge.protocol.plugins import is_import_path

    if not is_import_path(name) or name in list_models():
        return
    if not typed:
        raise CheckpointError(f"the checkpoint's network is {name}, a model of one's own: give --model {name} "
                              f"(its package importable here) to build it")
    try:
        use_model(name)
    except ValueError as exc:
        raise CheckpointError(str(exc)) from None


def exportable_methods() -> list[str]:
    """Registered methods whose cloud checkpoint is a SplitModel (Method.exportable)."""
    from splitedge.methods.registry import get_method, list_methods

    return [m for m in list_methods() if get_method(m).exportable]


def check_exportable(method: str | None, path: Path) -> None:
    """A checkpoint of a method with no global SplitModel (FedProto's prototypes, an SSL
    encoder, DecMAR's MAE) is refused by name; an unnamed or unknown method is tried."""
    from splitedge.methods.registry import get_method

    if method is None:
        return
    try:
        exportable = get_method(method).exportable
    except ValueError:  # a method registered only in the process that wrote it
        return
    if not exportable:
        raise CheckpointError(f"{path} is a {method} checkpoint, which holds no model export can rebuild; "
                              f"export takes checkpoints of {', '.join(exportable_methods())}")


def _dataset(info: ModelInfo, flag: str | None, path: Path) -> str:
    """The data set the test images come from: the checkpoint's, or --dataset for older ones."""
    name = _agreed("--dataset", flag, info.dataset)
    if name is not None:
        return name
    if info.describes_model:
        raise CheckpointError(f"{path} does not name its data set, which the parity images come from; pass "
                              f"--dataset {' or --dataset '.join(DATASETS)}")
    raise CheckpointError(f"{path} does not record its network (written before checkpoints did); pass the run's "
                          f"--dataset ({' or '.join(DATASETS)}); --model is found from the weights unless given")


def _agreed(flag: str, given: str | None, recorded: str | None) -> str | None:
    """The flag's value or the checkpoint's; both and different is a mistake, not a choice."""
    if given is not None and recorded is not None and given != recorded:
        raise CheckpointError(f"{flag} {given}: the checkpoint was written for {recorded}; drop {flag}")
    return given if given is not None else recorded


def load_checkpoint(path: Path, info: Any, model: str | None, head_layer: str | None = None) -> tuple[str, Any]:
    """The SplitModel the checkpoint was saved from (the named model, or the first that fits),
    built for the data set's input shape and classes (`info`), with its head at `head_layer`
    when the checkpoint says it sits off the classifier's input."""
    from safetensors.numpy import load_file

    from splitedge.models import create_split, list_models, load_numpy_state

    weights = load_file(str(path))
    names = [model] if model else list_models()
    for name in names:
        split = create_split(name, num_classes=info.num_classes, in_channels=info.channels,
                             image_size=info.image_size)
        if head_layer is not None:
            from splitedge.methods.calibration.layers import parse_layers
            from splitedge.models.split import head_at_layer

            layer = parse_layers(head_layer)[0]
            split = head_at_layer(split, layer.stage, layer.side)
        try:
            load_numpy_state(split, _scalars_as_saved(weights, split.state_dict()))
        except ValueError as exc:
            log.debug("%s does not fit %s: %s", path, name, exc)
            continue
        return name, split.eval()
    shape = _shape((info.channels, info.image_size, info.image_size))
    what = f"{info.name} ({shape} inputs, {info.num_classes} classes)"
    if model:
        raise CheckpointError(f"{path} does not fit {model} for {what}; pass the run's --model and --dataset "
                              f"(-vv says which weights differ)")
    raise CheckpointError(f"{path} fits none of {', '.join(names)} for {what}; pass the run's --dataset "
                          f"and --model (-vv says which weights differ)")


def _scalars_as_saved(weights: dict, expected: dict) -> dict:
    """Size-1 arrays back to 0-d where the model has a scalar (BN counters).

    Checkpoints written with np.ascontiguousarray (cloud/coordinator.py) store 0-d buffers
    as shape (1,).
    """
    out = dict(weights)
    for name, tensor in expected.items():
        if tensor.dim() == 0 and name in out and out[name].shape == (1,):
            out[name] = out[name].reshape(())
    return out


def _check_fits(target: Target, info: Any) -> None:
    """The loaded data set must be what the recorded network takes (a --data of another set
    would give images of another shape or another number of classes)."""
    shape, recorded = (info.channels, info.image_size, info.image_size), target.info
    if recorded.input_shape is not None and tuple(recorded.input_shape) != shape:
        raise CheckpointError(f"{target.path} takes {_shape(recorded.input_shape)} inputs but the {target.dataset} "
                              f"images are {_shape(shape)}")
    if recorded.num_classes is not None and recorded.num_classes != info.num_classes:
        raise CheckpointError(f"{target.path} has {recorded.num_classes} classes but {target.dataset} has "
                              f"{info.num_classes}")


def _shape(shape: Any) -> str:
    return "x".join(map(str, shape))


def run(args: argparse.Namespace) -> int:
    target = check_checkpoint(args.checkpoint, args.dataset, args.model)  # before torch: wrong files fail at once
    _own_dataset(target.dataset, typed=args.dataset is not None, data=args.data)
    out = args.out if args.out is not None else target.path.parent / "export"
    from splitedge.methods.data.datasets import load_dataset
    from splitedge.methods.data.preprocess import to_input

    train, test, info = load_dataset(target.dataset, args.data, max_train=args.calibration, max_test=args.samples)
    _check_fits(target, info)
    import torch

    from splitedge.exporters.suite import export_split, markdown_table

    torch.set_num_threads(1)
    if target.model:
        _plugin_model(target.model, typed=args.model is not None)
    name, split = load_checkpoint(target.path, info, target.model, target.info.head_layer)
    if target.info.head_input_clip:  # a head calibrated on private statistics sees its input clipped
        from splitedge.models.split import clip_head_input

        clip_head_input(split, target.info.head_input_clip)
    mean, std = target.info.mean or info.mean, target.info.std or info.std
    x, calib = to_input(test[0], mean, std), to_input(train[0], mean, std)
    rows = export_split(split, x, out, fp16=args.fp16, int8=args.int8, calibration=calib)
    report = {"checkpoint": str(target.path), "method": target.info.method, "round": target.info.round,
              "model": name, "dataset": target.dataset, "input_shape": list(split.in_shape),
              "mean": list(mean), "std": list(std), "head_input_clip": target.info.head_input_clip,
              "head_layer": target.info.head_layer, "parity_images": int(len(x)),
              "variants": [r.to_dict() for r in rows]}
    (out / "export.json").write_text(json.dumps(report, indent=1))
    print(markdown_table(rows))
    print(json.dumps(report))
    return 0
