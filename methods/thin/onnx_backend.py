"""The thin device's W_c: an onnxruntime session, with weights swapped in by name.

Only onnxruntime and numpy are imported (no torch, no `onnx`), so a Pi-class device can run
the global W_c and compute moments in a small process. The exporter keeps every W_c
initializer under its torch state-dict name, so an averaged W_c arriving as a weight map is
checked against the graph's initializer table (names, shapes, dtypes) and loaded into a fresh
session; the old session keeps serving until the new one is built, so a swap is atomic.

Two ways to load the weights (`swap=`):
- "patch" (default): overwrite the initializers' raw bytes in a copy of the model and build a
  normally optimised session from it.
- "initializer": `SessionOptions.add_initializer(name, OrtValue)` on the original bytes. The
  graph transformers of onnxruntime (Conv+BN fusion, the NCHWc layout transform, ...) read the
  values stored in the model file and bake them into new tensors before the overrides apply,
  so with any optimisation level the new weights are silently ignored (onnxruntime 1.32). This
  mode therefore runs unoptimised, which is about 2x slower and, on the CIFAR CNN at batch 32,
  needs ~35 MB more peak RSS; it is kept for graphs whose weights are not raw_data.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np
import onnxruntime as ort

from splitedge.methods.thin.onnx_graph import InitializerSpec, initializer_specs, initializer_values, patch_initializers

log = logging.getLogger(__name__)

UNUSED_STATE_KEY = "splitedge.unused_state"
"""Model metadata (JSON list): state-dict entries the graph does not use (BN num_batches_tracked)."""


@dataclass(frozen=True)
class _Graph:
    """One immutable (model, session) pair; replaced as a whole on every swap."""

    model: bytes
    session: ort.InferenceSession
    specs: dict[str, InitializerSpec]
    unused: frozenset[str]
    keep: tuple[Any, ...] = field(default=(), repr=False)  # OrtValues must outlive the session


class OnnxExtractor:
    """Extractor protocol (methods/hsfp/device.py) over onnxruntime."""

    name = "onnx"

    def __init__(self, model: bytes, *, sha256: str | None = None, threads: int = 1,
                 swap: str = "patch") -> None:
        if swap not in ("patch", "initializer"):
            raise ValueError(f"swap must be 'patch' or 'initializer', got {swap!r}")
        self.threads, self.swap = int(threads), swap
        self._graph = self._build(bytes(model), sha256)

    # -- public API ---------------------------------------------------------------------------
    @property
    def initializers(self) -> dict[str, InitializerSpec]:
        return dict(self._graph.specs)

    @property
    def model_bytes(self) -> bytes:
        return self._graph.model

    def weights(self) -> dict[str, np.ndarray]:
        """The weights the graph in use holds, by state name (entries it does not use, such as
        BatchNorm's num_batches_tracked, are not among them)."""
        graph = self._graph
        return initializer_values(graph.model, graph.specs)

    def features(self, x: np.ndarray) -> np.ndarray:
        """Normalised float32 images [N, C, H, W] -> W_c output [N, ...] (float32)."""
        graph = self._graph  # one read: a concurrent swap cannot mix two sessions
        name = graph.session.get_inputs()[0].name
        out = graph.session.run(None, {name: np.ascontiguousarray(x, dtype=np.float32)})[0]
        return np.asarray(out, dtype=np.float32)

    def load_weights(self, weights: Mapping[str, np.ndarray]) -> None:
        """Swap in a new W_c weight map (torch state-dict names); ValueError keeps the old one."""
        graph = self._graph
        arrays = self._check_weights(graph, weights)
        if self.swap == "patch":
            model = patch_initializers(graph.model, graph.specs, arrays)
            self._graph = self._session(model, graph.specs, graph.unused, {})
        else:
            self._graph = self._session(graph.model, graph.specs, graph.unused, arrays)

    def check_weights(self, weights: Mapping[str, np.ndarray]) -> None:
        """ValueError naming the first mismatch between a weight map and this graph (loads nothing)."""
        self._check_weights(self._graph, weights)

    def load_model(self, model: bytes, sha256: str) -> None:
        """Replace the whole graph (e.g. a new architecture); ValueError keeps the old one."""
        self._graph = self._build(bytes(model), sha256)

    # -- building -----------------------------------------------------------------------------
    def _build(self, model: bytes, sha256: str | None) -> _Graph:
        if sha256 is not None and hashlib.sha256(model).hexdigest() != sha256:
            raise ValueError("onnx model: sha256 does not match the model bytes")
        specs = initializer_specs(model)
        graph = self._session(model, specs, frozenset(), {})
        meta = graph.session.get_modelmeta().custom_metadata_map
        try:
            unused = frozenset(json.loads(meta.get(UNUSED_STATE_KEY, "[]")))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"onnx model: bad {UNUSED_STATE_KEY} metadata ({exc})") from exc
        if len(graph.session.get_inputs()) != 1:
            raise ValueError("onnx model: expected exactly one input (the images)")
        return _Graph(model, graph.session, specs, unused)

    def _session(self, model: bytes, specs: dict[str, InitializerSpec], unused: frozenset[str],
                 arrays: dict[str, np.ndarray]) -> _Graph:
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = self.threads
        opts.inter_op_num_threads = 1
        opts.log_severity_level = 3
        keep = []
        if arrays:  # overrides are ignored by the graph transformers (module docstring)
            opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        for name, arr in arrays.items():
            value = ort.OrtValue.ortvalue_from_numpy(arr)
            opts.add_initializer(name, value)
            keep.append(value)
        try:
            session = ort.InferenceSession(model, opts, providers=["CPUExecutionProvider"])
        except Exception as exc:  # onnxruntime raises its own exception types
            raise ValueError(f"onnx model rejected by onnxruntime: {exc}") from exc
        return _Graph(model, session, specs, unused, tuple(keep) + tuple(arrays.values()))

    @staticmethod
    def _check_weights(graph: _Graph, weights: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Own, contiguous arrays of the graph's dtypes, or ValueError naming the first mismatch.

        Float arrays load into float initializers of any width (weights travel as f4, an fp16
        graph stores f2); any other dtype must match exactly.
        """
        missing = [n for n in graph.specs if n not in weights]
        unknown = [n for n in weights if n not in graph.specs and n not in graph.unused]
        if missing or unknown:
            raise ValueError(f"weights do not match the onnx graph: missing {missing[:5]}, "
                             f"unknown {unknown[:5]}")
        out: dict[str, np.ndarray] = {}
        for name, spec in graph.specs.items():
            arr = np.asarray(weights[name])
            if tuple(arr.shape) != spec.shape:
                raise ValueError(f"{name!r}: shape {tuple(arr.shape)} != graph {spec.shape}")
            floats = np.issubdtype(arr.dtype, np.floating) and np.issubdtype(spec.dtype, np.floating)
            if arr.dtype != spec.dtype and not floats:
                raise ValueError(f"{name!r}: dtype {arr.dtype} does not fit graph dtype {spec.dtype}")
            out[name] = np.array(arr, dtype=spec.dtype, order="C", copy=True)
        return out
