"""Export W_c and the global model with their fp16/int8 variants; parity and size of each.

One row per (graph, variant). Every variant is checked against torch on the same real inputs
with a tolerance suited to its precision, and the export fails (ParityError) above it.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from torch import nn

from splitedge.exporters.onnx_export import FP32_TOL, Tolerance, export_module, max_abs_diff, run_onnx, run_torch
from splitedge.exporters.variants import to_fp16, to_int8

log = logging.getLogger(__name__)

# fp16 keeps ~3 significant digits per op; int8 is a coarse approximation judged on scale.
TOLERANCES = {"fp32": FP32_TOL, "fp16": Tolerance(atol=1e-2, rtol=2e-2), "int8": Tolerance(atol=0.05, rtol=0.25)}


@dataclass(frozen=True)
class VariantResult:
    graph: str  # "wc" or "model"
    variant: str  # "fp32" | "fp16" | "int8"
    path: str
    bytes: int
    max_abs_diff: float
    rel_diff: float  # max_abs_diff / max|torch output|
    top1_agreement: float | None  # share of argmax equal to torch where torch decides (global model only)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def export_split(split: nn.Module, x: np.ndarray, out_dir: Path, *, fp16: bool = False, int8: bool = False,
                 calibration: np.ndarray | None = None,
                 tolerances: dict[str, Tolerance] | None = None) -> list[VariantResult]:
    """Write wc[.fp16|.int8].onnx and model[...].onnx into out_dir; returns the parity table."""
    tolerances = {**TOLERANCES, **(tolerances or {})}
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for graph, module, output in (("wc", split.wc, "features"), ("model", split, "logits")):
        base = export_module(module, tuple(split.in_shape), output_name=output, part=graph)
        variants = {"fp32": lambda m=base: m}
        if fp16:
            variants["fp16"] = lambda m=base: to_fp16(m)
        if int8:
            calib = x if calibration is None else calibration
            variants["int8"] = lambda m=base, c=calib: to_int8(m, c)
        ref = run_torch(module, x)
        for variant, build in variants.items():
            rows.append(_write(graph, variant, build(), module, x, ref, out_dir, tolerances[variant]))
    return rows


def _write(graph: str, variant: str, model: onnx.ModelProto, module: nn.Module, x: np.ndarray,
           ref: np.ndarray, out_dir: Path, tol: Tolerance) -> VariantResult:
    data = model.SerializeToString()
    diff = max_abs_diff(data, module, x, tol, reference=ref)
    top1 = None
    if graph == "model":
        top1 = top1_agreement(run_onnx(data, x), ref, diff)
    name = graph if variant == "fp32" else f"{graph}.{variant}"
    path = out_dir / f"{name}.onnx"
    path.write_bytes(data)
    scale = float(np.max(np.abs(ref), initial=0.0)) or 1.0
    log.info("%s %s: %d bytes, max abs diff %.3g", graph, variant, len(data), diff)
    return VariantResult(graph, variant, str(path), len(data), diff, diff / scale, top1)


def top1_agreement(logits: np.ndarray, ref: np.ndarray, diff: float) -> float:
    """The share of samples whose argmax is torch's, among those torch decides by more than
    twice the graph's largest difference: a near-tie (two logits closer than that) may flip
    either way in a correct export (a trained tiny network gave 0.997 on such ties)."""
    agree = logits.argmax(1) == ref.argmax(1)
    if ref.shape[1] < 2:  # one output: nothing to tie with
        return float(np.mean(agree))
    top2 = np.sort(ref, axis=1)[:, -2:]
    decided = (top2[:, 1] - top2[:, 0]) > 2 * diff
    return float(np.mean(agree[decided])) if decided.any() else 1.0


def markdown_table(rows: list[VariantResult]) -> str:
    lines = ["| graph | variant | size (bytes) | max abs diff | rel diff | top-1 agreement |",
             "|---|---|---:|---:|---:|---:|"]
    for r in rows:
        top1 = "" if r.top1_agreement is None else f"{r.top1_agreement:.3f}"
        lines.append(f"| {r.graph} | {r.variant} | {r.bytes:,} | {r.max_abs_diff:.3g} | {r.rel_diff:.3g} | {top1} |")
    return "\n".join(lines)
