"""Export W_c and the assembled global model to ONNX, with names a device can swap weights by.

Uses the TorchScript exporter (`dynamo=False`; the dynamo exporter fails on these models) with
a dynamic batch axis and no constant folding, so BatchNorm stays a separate node whose
parameters and running statistics are initializers named exactly like the torch state dict.
The exporter still de-duplicates initializers with equal values (a fresh BN has weight == 1
and running_var == 1 in every layer) behind Identity nodes; `_restore_names` undoes that, so a
device can later overwrite every state-dict entry by name. Every export is checked with
`onnx.checker` and against torch with onnxruntime on real inputs.
"""

from __future__ import annotations

import copy
import io
import json
import logging
import warnings
from dataclasses import dataclass
from typing import Mapping

import numpy as np
import onnx
import torch
from onnx import numpy_helper
from torch import nn

log = logging.getLogger(__name__)

OPSET = 17
INPUT_NAME = "x"
UNUSED_STATE_KEY = "splitedge.unused_state"  # state entries the graph does not use (BN num_batches_tracked)


class ParityError(ValueError):
    """The exported graph does not reproduce torch within tolerance."""


@dataclass(frozen=True)
class Tolerance:
    """|onnx - torch| <= atol + rtol * max|torch| (rtol keeps large activations fair)."""

    atol: float
    rtol: float = 0.0

    def limit(self, reference: np.ndarray) -> float:
        return self.atol + self.rtol * float(np.max(np.abs(reference), initial=0.0))


FP32_TOL = Tolerance(atol=1e-4, rtol=1e-5)


def export_module(module: nn.Module, in_shape: tuple[int, ...], *, output_name: str = "features",
                  part: str = "wc") -> onnx.ModelProto:
    """Export `module` (eval mode, a copy) for inputs [batch, *in_shape]; names are verified."""
    module = copy.deepcopy(module).eval()
    buf = io.BytesIO()
    with warnings.catch_warnings():  # the TorchScript exporter is deprecated but is what works here
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.onnx.export(module, (torch.zeros((2, *in_shape)),), buf, dynamo=False, opset_version=OPSET,
                          input_names=[INPUT_NAME], output_names=[output_name],
                          dynamic_axes={INPUT_NAME: {0: "batch"}, output_name: {0: "batch"}},
                          do_constant_folding=False, training=torch.onnx.TrainingMode.EVAL)
    model = onnx.load_from_string(buf.getvalue())
    state = {k: v.detach().cpu().numpy() for k, v in module.state_dict().items()}
    _restore_names(model, state)
    unused = verify_names(model, state)
    _set_metadata(model, {UNUSED_STATE_KEY: json.dumps(unused), "splitedge.part": part})
    onnx.checker.check_model(model)
    return model


def _restore_names(model: onnx.ModelProto, state: Mapping[str, np.ndarray]) -> None:
    """Replace `Identity(initializer) -> <state name>` by an initializer of that name."""
    graph = model.graph
    inits = {i.name for i in graph.initializer}
    keep = []
    for node in graph.node:
        out = node.output[0] if node.output else ""
        if node.op_type == "Identity" and node.input[0] in inits and out in state:
            graph.initializer.append(numpy_helper.from_array(np.ascontiguousarray(state[out]), out))
            inits.add(out)
        else:
            keep.append(node)
    del graph.node[:]
    graph.node.extend(keep)


def verify_names(model: onnx.ModelProto, state: Mapping[str, np.ndarray]) -> list[str]:
    """Check every initializer is a state-dict entry with the same value and every float entry
    is an initializer; returns the state entries the graph does not use (e.g. BN counters)."""
    inits = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    stray = sorted(set(inits) - set(state))
    floats = {k for k, v in state.items() if np.issubdtype(v.dtype, np.floating)}
    missing = sorted(floats - set(inits))
    if stray or missing:
        raise ValueError(f"onnx initializers do not match the state dict: not in state {stray[:5]}, "
                         f"missing {missing[:5]}")
    for name, arr in inits.items():
        if arr.shape != state[name].shape or not np.array_equal(arr, state[name]):
            raise ValueError(f"onnx initializer {name!r} differs from the state-dict value")
    batchnorms = sum(n.op_type == "BatchNormalization" for n in model.graph.node)
    bn_params = sum(k.endswith("running_var") for k in state)
    if batchnorms != bn_params:
        raise ValueError(f"expected {bn_params} BatchNormalization nodes, found {batchnorms} (folded?)")
    return sorted(set(state) - set(inits))


def _set_metadata(model: onnx.ModelProto, meta: Mapping[str, str]) -> None:
    for key, value in meta.items():
        entry = model.metadata_props.add()
        entry.key, entry.value = key, value


def ort_session(model: onnx.ModelProto | bytes):
    """A single-threaded CPU session (parity checks must not fight the other processes)."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.log_severity_level = 3
    data = model if isinstance(model, bytes) else model.SerializeToString()
    return ort.InferenceSession(data, opts, providers=["CPUExecutionProvider"])


def run_onnx(model: onnx.ModelProto | bytes, x: np.ndarray, batch: int = 256) -> np.ndarray:
    session = ort_session(model)
    name = session.get_inputs()[0].name
    outs = [session.run(None, {name: x[i:i + batch]})[0] for i in range(0, len(x), batch)]
    return np.concatenate(outs).astype(np.float32)


@torch.no_grad()
def run_torch(module: nn.Module, x: np.ndarray, batch: int = 256) -> np.ndarray:
    """Eval-mode outputs; the module's train/eval mode is restored (the caller may be training)."""
    was_training = module.training
    module.eval()
    try:
        return np.concatenate([module(torch.from_numpy(x[i:i + batch])).numpy()
                               for i in range(0, len(x), batch)])
    finally:
        module.train(was_training)


def max_abs_diff(model: onnx.ModelProto | bytes, module: nn.Module, x: np.ndarray,
                 tol: Tolerance | None = FP32_TOL, reference: np.ndarray | None = None) -> float:
    """Max |onnx - torch| over `x`; raises ParityError above `tol` (None: report only)."""
    ref = run_torch(module, x) if reference is None else reference
    got = run_onnx(model, x)
    if got.shape != ref.shape:
        raise ParityError(f"onnx output shape {got.shape} != torch {ref.shape}")
    diff = float(np.max(np.abs(got - ref), initial=0.0))
    if tol is not None and not diff <= tol.limit(ref):
        raise ParityError(f"onnx vs torch max abs diff {diff:.3g} > {tol.limit(ref):.3g}")
    return diff
