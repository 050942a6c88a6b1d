"""Smaller variants of an exported graph: fp16 (half the bytes) and int8 (static QDQ).

fp16 is converted here rather than with onnxconverter-common (not in our dependencies): float
initializers become float16 under the same names (so weights can still be swapped by name),
Constant nodes are cast, and one Cast at the input and one at the output keep the graph's
interface float32, so a device feeds it exactly what it feeds the fp32 graph.

int8 uses onnxruntime's static quantization in QDQ format with per-channel weights, calibrated
on real images; its initializers are renamed by the quantizer, so an int8 device receives new
models, never weight maps.
"""

from __future__ import annotations

import copy
import tempfile
from pathlib import Path
from typing import Iterator

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

FP16_SUFFIX = "::fp16"


def to_fp16(model: onnx.ModelProto) -> onnx.ModelProto:
    """The same graph computing in float16 with a float32 input and output."""
    m = copy.deepcopy(model)
    g = m.graph
    for init in g.initializer:
        if init.data_type == TensorProto.FLOAT:
            init.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init).astype(np.float16), init.name))
    for node in g.node:
        _node_to_fp16(node)
    ins, outs = [i.name for i in g.input], [o.name for o in g.output]
    for node in g.node:
        node.input[:] = [n + FP16_SUFFIX if n in ins else n for n in node.input]
        node.output[:] = [n + FP16_SUFFIX if n in outs else n for n in node.output]
    casts_in = [helper.make_node("Cast", [n], [n + FP16_SUFFIX], to=TensorProto.FLOAT16) for n in ins]
    casts_out = [helper.make_node("Cast", [n + FP16_SUFFIX], [n], to=TensorProto.FLOAT) for n in outs]
    nodes = casts_in + list(g.node) + casts_out
    del g.node[:]
    g.node.extend(nodes)
    del g.value_info[:]  # intermediate types changed; let shape inference redo them
    onnx.checker.check_model(m)
    return m


def _node_to_fp16(node: onnx.NodeProto) -> None:
    """Constants and float-typed attributes of one node, switched to float16."""
    for attr in node.attribute:
        if attr.type == onnx.AttributeProto.TENSOR and attr.t.data_type == TensorProto.FLOAT:
            attr.t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(attr.t).astype(np.float16),
                                                    attr.t.name))
        if node.op_type in ("Cast", "CastLike", "RandomNormal", "RandomUniform", "EyeLike") and \
                attr.name in ("to", "dtype") and attr.i == TensorProto.FLOAT:
            attr.i = TensorProto.FLOAT16


class _Calibration:
    """onnxruntime CalibrationDataReader over an array of inputs, in small batches."""

    def __init__(self, input_name: str, x: np.ndarray, batch: int = 32) -> None:
        self._it: Iterator[dict[str, np.ndarray]] = (
            {input_name: x[i:i + batch]} for i in range(0, len(x), batch))

    def get_next(self) -> dict[str, np.ndarray] | None:
        return next(self._it, None)


def to_int8(model: onnx.ModelProto, calibration: np.ndarray) -> onnx.ModelProto:
    """Static int8 quantization (QDQ, per-channel weights, uint8 activations, MinMax calibration).

    Weights use 7 of their 8 bits (`reduce_range`): x86 CPUs without VNNI (AVX2 only, e.g. AMD
    EPYC Zen 2/3) multiply u8 activations by s8 weights with 16-bit saturation, and full-range
    weights overflowed there (random-init ResNet-18 W_c, output scale 6.7: max error 1.15, 0.27 with
    reduce_range; tests/thin/test_onnx_export.py).

    The graph is pre-processed first (onnxruntime's optimiser folds BatchNorm into Conv), so BN
    is not quantized as a layer of its own.
    """
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static
    from onnxruntime.quantization.shape_inference import quant_pre_process

    with tempfile.TemporaryDirectory() as tmp:
        src, pre, dst = Path(tmp) / "fp32.onnx", Path(tmp) / "pre.onnx", Path(tmp) / "int8.onnx"
        onnx.save(model, src)
        quant_pre_process(str(src), str(pre))
        quantize_static(str(pre), str(dst), _Calibration(model.graph.input[0].name, calibration),
                        quant_format=QuantFormat.QDQ, per_channel=True, weight_type=QuantType.QInt8,
                        activation_type=QuantType.QUInt8, calibrate_method=CalibrationMethod.MinMax,
                        reduce_range=True)
        return onnx.load(dst)
