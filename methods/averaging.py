"""Sample-weighted averaging of weight maps (FedAvg and H-SFP slow-scale averaging).

numpy only, so edges and the cloud can average weights received from the wire without
torch. A weight map is `dict[str, np.ndarray]` in insertion order (see docs/internals.md).
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Mapping, Sequence

import numpy as np

WeightMap = Mapping[str, np.ndarray]
log = logging.getLogger(__name__)


def averaged_body(parts: Sequence[tuple[WeightMap, int]], part: str, version: int,
                  merge: Callable[..., dict[str, np.ndarray]] | None = None,
                  reference: WeightMap | None = None) -> dict[str, Any]:
    """Body of a `weights` message carrying `merge(parts, reference=reference)` (a method passes
    its `merge_weights` hook; default: the sample-weighted average) and their total sample count."""
    merged = average_states(parts) if merge is None else merge(parts, reference=reference)
    return {"part": part, "version": version, "samples": sum(int(n) for _, n in parts), "weights": merged}


class GlobalModels:
    """The newest global weights of each part a node relayed from its parent or sent to its
    children: the model its children's updates of that version were trained from, which bounds
    them (methods/checks.py) and centres robust clipping (methods/robust.py). Not part of a
    part's parked state: after a restart it fills again with the next global model, and until
    then updates are bounded absolutely and clipped around their median."""

    def __init__(self) -> None:
        self.held: dict[str, tuple[int, WeightMap]] = {}

    def note(self, part: str, version: int, weights: WeightMap) -> None:
        held = self.held.get(part)
        if held is None or int(version) >= held[0]:
            self.held[part] = (int(version), weights)

    def trained_from(self, part: str, version: int) -> WeightMap | None:
        """The weights of `part` at `version`, if that is the one held."""
        held = self.held.get(part)
        return held[1] if held is not None and held[0] == int(version) else None

    def of(self, body: Mapping[str, Any]) -> WeightMap | None:
        """What a `weights` body's update was trained from (its part and version)."""
        return self.trained_from(str(body.get("part")), int(body.get("version", -1)))


def weight_updates(reports: Sequence[Any], part: str, version: int | None = None) -> list[tuple[WeightMap, int]]:
    """(weights, samples) of every `weights` message for model `part` in a round's reports.

    With `version`, updates trained from another version are stale: dropped and logged.
    """
    parts, stale = [], 0
    for report in reports:
        for env in report.all("weights"):
            if env.body["part"] != part:
                continue
            if version is not None and int(env.body["version"]) != version:
                stale += 1
                continue
            parts.append((env.body["weights"], int(env.body["samples"])))
    if stale:
        log.warning("dropped %d %s update(s) trained from a version other than %d", stale, part, version)
    return parts


def check_parts(parts: Sequence[tuple[WeightMap, int]]) -> None:
    """Raise ValueError unless all maps share names and shapes and the counts are usable."""
    if not parts:
        raise ValueError("average_states needs at least one (weights, count) pair")
    names = list(parts[0][0])
    for i, (weights, count) in enumerate(parts):
        if int(count) < 0:
            raise ValueError(f"part {i}: sample count {count} is negative")
        if list(weights) != names:
            diff = sorted(set(weights) ^ set(names))
            raise ValueError(f"part {i}: names differ from part 0 (e.g. {diff[:5]})")
        for name in names:
            if np.shape(weights[name]) != np.shape(parts[0][0][name]):
                raise ValueError(f"part {i}: {name!r} has shape {np.shape(weights[name])}, "
                                 f"part 0 has {np.shape(parts[0][0][name])}")
    if sum(int(c) for _, c in parts) <= 0:
        raise ValueError("total sample count is 0; nothing to weight by")


def _average_one(arrays: list[np.ndarray], counts: np.ndarray) -> np.ndarray:
    """Weighted mean for floats (computed in float64, returned in the input dtype);
    max for integers, because counters such as BN's num_batches_tracked are not averages."""
    first = np.asarray(arrays[0])
    if np.issubdtype(first.dtype, np.integer) or first.dtype == np.bool_:
        return np.asarray(np.max(np.stack(arrays), axis=0), dtype=first.dtype)
    stacked = np.stack([np.asarray(a, dtype=np.float64) for a in arrays])
    mean = np.tensordot(counts / counts.sum(), stacked, axes=1)
    return np.asarray(mean, dtype=first.dtype)  # 0-d stays an array, not a numpy scalar


def average_states(parts: Sequence[tuple[WeightMap, int]]) -> dict[str, np.ndarray]:
    """Average weight maps weighted by their sample counts.

    Float arrays: sum_k n_k w_k / sum_k n_k. Integer arrays: element-wise max. Names keep
    the order of the first map. Raises ValueError on mismatched names/shapes or bad counts.
    """
    check_parts(parts)
    counts = np.array([float(c) for _, c in parts], dtype=np.float64)
    return {name: _average_one([w[name] for w, _ in parts], counts) for name in parts[0][0]}
