"""`splitedge export`: a cloud checkpoint (safetensors) -> W_c and global-model ONNX files.

Prints one row per (graph, variant) with file size and max |onnx - torch| on real test
images, as a markdown table and as JSON (also written to <out>/export.json).
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

log = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", required=True, type=Path,
                   help="cloud checkpoint, e.g. runs/sim/model.safetensors (SplitModel state dict)")
    p.add_argument("--dataset", default="digits", choices=("digits", "cifar10"),
                   help="gives the input shape, normalisation and the real images parity is checked on")
    p.add_argument("--data", default=None, help="CIFAR-10: the .tar.gz, an ImageFolder tree or cifar-10-batches-py")
    p.add_argument("--model", default=None, help="network split (cnn | fedcnn | resnet18); default: the one the checkpoint fits")
    p.add_argument("--out", required=True, type=Path, help="directory for wc*.onnx, model*.onnx, export.json")
    p.add_argument("--fp16", action="store_true", help="also write float16 variants")
    p.add_argument("--int8", action="store_true", help="also write static int8 (QDQ) variants")
    p.add_argument("--samples", type=int, default=512, help="test images used for the parity check")
    p.add_argument("--calibration", type=int, default=256, help="training images used to calibrate int8")


def load_checkpoint(path: Path, info, model: str | None):
    """The SplitModel the checkpoint was saved from (the named model, or the first that fits)."""
    from safetensors.numpy import load_file

    from splitedge.models import create_split, list_models, load_numpy_state

    weights = load_file(str(path))
    errors = []
    for name in [model] if model else list_models():
        split = create_split(name, num_classes=info.num_classes, in_channels=info.channels,
                             image_size=info.image_size)
        try:
            load_numpy_state(split, _scalars_as_saved(weights, split.state_dict()))
        except ValueError as exc:
            errors.append(f"{name}: {exc}")
            continue
        return name, split.eval()
    raise ValueError(f"{path} does not fit any model for {info.name}: " + "; ".join(errors))


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


def run(args: argparse.Namespace) -> int:
    import torch

    from splitedge.exporters.suite import export_split, markdown_table
    from splitedge.methods.data.datasets import load_dataset
    from splitedge.methods.data.preprocess import to_input

    torch.set_num_threads(1)
    train, test, info = load_dataset(args.dataset, args.data, max_train=args.calibration,
                                     max_test=args.samples)
    name, split = load_checkpoint(args.checkpoint, info, args.model)
    x = to_input(test[0], info.mean, info.std)
    calib = to_input(train[0], info.mean, info.std)
    rows = export_split(split, x, args.out, fp16=args.fp16, int8=args.int8, calibration=calib)
    report = {"checkpoint": str(args.checkpoint), "model": name, "dataset": args.dataset,
              "parity_images": int(len(x)), "variants": [r.to_dict() for r in rows]}
    (args.out / "export.json").write_text(json.dumps(report, indent=1))
    print(markdown_table(rows))
    print(json.dumps(report))
    return 0
