"""Head-statistics records on the wire: what a device sends in a calibration phase, the checks
every receiver runs before a record is kept, and an edge's merge of its devices' records.

numpy only: thin devices compute records and numpy-only edges check and merge them. The check
needs the classifier input's dimension, which only a tier holding the model knows: the cloud
puts it in the calibration phase's directive, and every node checks against that.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np

from splitedge.methods.calibration import CALIBRATE, HEAD, HEADS, is_head_stats, stats_layer, stats_name
from splitedge.methods.calibration.layers import CLASSIFIER, layer_features, parse_layers, selects
from splitedge.methods.calibration.robust import robust_head_merge
from splitedge.methods.calibration.stats import (
    HeadStats, HeadStatsAccumulator, check_head_stats, head_stats_arrays, head_stats_from_arrays,
)
from splitedge.methods.contract import DEVICES, DONE, DevicePart, Message, RoundPlan
from splitedge.methods.data.preprocess import accumulate, batches, to_input
from splitedge.methods.privacy.release import private_accumulator, private_head_stats
from splitedge.protocol.done import Scores
from splitedge.protocol.errors import ProtocolError

STATS_BATCH = DevicePart.stats_batch
"""Images per forward pass while a device accumulates its statistics (inference only); a part
may take fewer (DevicePart.stats_batch)."""


@dataclass(frozen=True)
class Gate:
    """What a calibration phase's records must fit: made in `round`, at one of the phase's
    layers with that layer's dimension (`dims`), at most `num_classes` classes, in the run's
    wire dtype and covariance form."""

    round: int
    dims: Mapping[str, int]
    num_classes: int
    dtype: str
    cov: str

    @classmethod
    def of(cls, plan: RoundPlan, method: Any) -> "Gate":
        cfg = method.config
        layers = (plan.directives.get(CALIBRATE) or {}).get("layers") or {}
        dims = {str(k): int(v) for k, v in layers.items()} if isinstance(layers, Mapping) else {}
        return cls(plan.round, dims, method.spec.num_classes, cfg.calib_dtype, cfg.calib_cov)

    def check(self, env: Any) -> None:
        """ProtocolError naming the rule when the record does not fit this phase."""
        if int(env.body["version"]) != self.round:
            raise ProtocolError("state.stale", f"head statistics of round {env.body['version']}; the calibration "
                                               f"is of round {self.round}")
        layer = stats_layer(str(env.body["name"]))
        if layer not in self.dims:
            raise ProtocolError("state.layer", f"head statistics at {layer}; the calibration takes "
                                               f"{', '.join(self.dims) or 'none'}")
        check_head_stats(env.body["arrays"], dim=self.dims[layer], num_classes=self.num_classes, dtype=self.dtype,
                         cov=self.cov)


def head_stats(features: Callable[[np.ndarray], np.ndarray], data: tuple[np.ndarray, np.ndarray],
               mean: Sequence[float], std: Sequence[float], batch: int = STATS_BATCH,
               keep: np.ndarray | None = None) -> HeadStats:
    """Local uint8 images through `features` (normalised images -> classifier input) in
    batches, into the float64 accumulator (only the `keep` samples, when given)."""
    return accumulate(features, data, mean, std, HeadStatsAccumulator, batch, keep)


def record(stats: HeadStats, plan: RoundPlan, cfg: Any, layer: str = CLASSIFIER) -> Message:
    """The `arrays` record of `stats` at `layer` for the calibration phase `plan` (sent up)."""
    arrays = head_stats_arrays(stats, cfg.calib_dtype, cfg.calib_cov)
    return Message("arrays", {"name": stats_name(layer), "version": plan.round, "arrays": arrays})


def calibration_round(part: Any, plan: RoundPlan) -> Iterator[Message | object]:
    """A device's calibration phase: a record of head statistics at each layer the run names
    (`calib_layer`), when its part can reach them (`DevicePart.can_calibrate`), then DONE.
    Nothing is trained. The records hold only the classes above the run's minimum count (none
    when no class is), and not the images held back to choose among layers."""
    if part.can_calibrate and part.cfg.dp_sigma > 0:
        yield from private_record(part, plan)
    elif part.can_calibrate:
        data = part.calibration_data()
        keep = part.stats_floor(data[1]).keep & ~part.held_back(data[1])
        if keep.any():
            for layer, stats in layer_stats(part, data, keep).items():
                yield record(stats, plan, part.cfg, layer)
    yield DONE


def layer_stats(part: Any, data: tuple[Any, np.ndarray], keep: np.ndarray) -> dict[str, HeadStats]:
    """Head statistics of the `keep` images at every layer the run names, from one forward pass
    a batch (`DevicePart.stage_outputs`); float64 accumulators."""
    layers = parse_layers(part.cfg.calib_layer)
    accs: dict[str, HeadStatsAccumulator] = {}
    for outputs, rows, labels in stage_batches(part, data, keep):
        for layer in layers:
            feats = layer_features(outputs, layer)[rows]
            accs.setdefault(layer.name, HeadStatsAccumulator(feats.shape[1])).add(feats, labels)
    return {name: acc.result() for name, acc in accs.items()}


def stage_batches(part: Any, data: tuple[Any, np.ndarray], keep: np.ndarray) -> Iterator[tuple[Any, np.ndarray,
                                                                                                np.ndarray]]:
    """(stage outputs, the batch's kept rows, their labels) of each batch of `stats_batch`
    images holding a kept one (`DevicePart.stage_outputs` on the normalised images)."""
    x, y = data
    for sl in batches(len(y), part.stats_batch):
        rows = np.asarray(keep[sl], dtype=bool)
        if rows.any():
            yield part.stage_outputs(to_input(x[sl], part.spec.mean, part.spec.std)), rows, np.asarray(y[sl])[rows]


def private_record(part: Any, plan: RoundPlan) -> Iterator[Message]:
    """The differentially private record (methods/privacy/release.py): the head's inputs at the
    run's one layer (several are refused under DP) clipped to `dp_head_clip`, one noisy release
    of every class; nothing when no class survives it."""
    spec, data, cfg = part.spec, part.calibration_data(), part.cfg
    layer = parse_layers(cfg.calib_layer)[0]
    private = private_accumulator(part, cfg.dp_head_clip, cfg.calib_cov, private_head_stats(part, data[1]))
    stats = accumulate(lambda x: layer_features(part.stage_outputs(x), layer), data, spec.mean, spec.std, private,
                       part.stats_batch)
    if len(stats.classes):
        yield record(stats, plan, cfg, layer.name)


def evaluation(part: Any, heads: Mapping[str, tuple[np.ndarray, np.ndarray]] | None) -> dict[str, Any]:
    """A device's evaluation phase, for its `done` info: its part's scores of the candidate
    `heads` on the images it held back (`calib_layer` naming several layers), or of the head it
    was sent on its held-out data (`evaluate_head`). Nothing is sent but `done`."""
    return layer_scores(part, heads) if heads and selects(part.cfg) else part.evaluate_head()


def layer_scores(part: Any, heads: Mapping[str, tuple[np.ndarray, np.ndarray]]) -> dict[str, Any]:
    """`{"layer_scores": {layer: [correct, scored]}}`: each candidate head on the images the part
    held back (those above the minimum count per class; empty when it held none back)."""
    data = part.calibration_data()
    rows = part.held_back(data[1]) & part.stats_floor(data[1]).keep
    layers = [layer for layer in parse_layers(part.cfg.calib_layer) if layer.name in heads]
    correct = dict.fromkeys((layer.name for layer in layers), 0)
    for outputs, keep, labels in stage_batches(part, data, rows):
        for layer in layers:
            weight, bias = heads[layer.name]
            feats = np.asarray(layer_features(outputs, layer)[keep], dtype=np.float64)
            if feats.shape[1] != weight.shape[1]:
                raise ProtocolError("state.shape", f"the {layer.name} head takes {weight.shape[1]} features; "
                                                   f"this device computes {feats.shape[1]} there")
            correct[layer.name] += int((np.argmax(feats @ weight.T + bias, axis=1) == labels).sum())
    scored = int(rows.sum())
    return {"layer_scores": {name: [c, scored] for name, c in correct.items()}} if scored else {}


def heads_message(heads: Mapping[str, tuple[np.ndarray, np.ndarray]], round_: int) -> Message:
    """The candidate heads for every device (float32), kept as the newest of their slot."""
    arrays: dict[str, np.ndarray] = {}
    for layer, (weight, bias) in heads.items():
        arrays[f"{layer}_weight"] = np.ascontiguousarray(weight, "<f4")
        arrays[f"{layer}_bias"] = np.ascontiguousarray(bias, "<f4")
    return Message("arrays", {"name": HEADS, "version": round_, "arrays": arrays}, to=DEVICES, slot=HEADS)


def is_heads(env: Any) -> bool:
    return env.kind == "arrays" and env.body.get("name") == HEADS


def check_heads(body: Mapping[str, Any], layers: Sequence[str], num_classes: int) -> None:
    """A candidate-heads record holds, for each of the run's layers and nothing else,
    `<layer>_weight` [classes, D] and `<layer>_bias` [classes] (ProtocolError)."""
    arrays = body["arrays"]
    want = {f"{layer}_{k}" for layer in layers for k in ("weight", "bias")}
    if set(arrays) != want:
        raise ProtocolError("state.arrays", f"candidate heads carry {sorted(want)}, got {sorted(arrays)}")
    for layer in layers:
        weight, bias = np.asarray(arrays[f"{layer}_weight"]), np.asarray(arrays[f"{layer}_bias"])
        if weight.ndim != 2 or weight.shape[0] != num_classes or bias.shape != (num_classes,) \
                or weight.dtype.kind != "f" or bias.dtype.kind != "f":
            raise ProtocolError("state.shape", f"the {layer} head is weight [{num_classes}, D] and bias "
                                               f"[{num_classes}] floats")


def take_heads(body: Mapping[str, Any], layers: Sequence[str]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """A checked candidate-heads record as layer -> (weight, bias) in float64."""
    arrays = body["arrays"]
    return {layer: (np.array(arrays[f"{layer}_weight"], dtype=np.float64),
                    np.array(arrays[f"{layer}_bias"], dtype=np.float64)) for layer in layers}


def head_message(head: tuple[np.ndarray, np.ndarray], round_: int, to: Any) -> Message:
    """A fitted head for the devices at `to`, kept as the newest of its slot (float32)."""
    arrays = {"weight": np.ascontiguousarray(head[0], "<f4"), "bias": np.ascontiguousarray(head[1], "<f4")}
    return Message("arrays", {"name": HEAD, "version": round_, "arrays": arrays}, to=to, slot=HEAD)


def check_head(body: Mapping[str, Any], num_classes: int, dim: int) -> None:
    """A head record must hold `weight` [classes, D] and `bias` [classes] (ProtocolError)."""
    arrays = body["arrays"]
    if set(arrays) != {"weight", "bias"} or tuple(arrays["weight"].shape) != (num_classes, dim) \
            or tuple(arrays["bias"].shape) != (num_classes,):
        raise ProtocolError("state.shape", f"a head is weight [{num_classes}, {dim}] and bias [{num_classes}]")


def merged_scores(scores: Sequence[Scores]) -> Scores:
    """Devices' (or edges') scores of their heads merged: the accuracy over all their held-out
    samples and how many there were, and the candidate layers' [correct, scored] summed
    (empty when nobody scored)."""
    scored = [(float(s.accuracy), s.eval_samples) for s in scores if s.accuracy is not None and s.eval_samples > 0]
    total = sum(n for _, n in scored)
    layers: dict[str, list[int]] = {}
    for s in scores:
        for layer, pair in s.layer_scores.items():
            into = layers.setdefault(str(layer), [0, 0])
            into[0], into[1] = into[0] + int(pair[0]), into[1] + int(pair[1])
    if not total:
        return Scores(layer_scores=layers)
    return Scores(accuracy=sum(a * n for a, n in scored) / total, eval_samples=total, layer_scores=layers)


def records_of(reports: Sequence[Any]) -> dict[str, dict[str, HeadStats]]:
    """Each sender's head statistics in a phase's reports (its last record at each layer;
    records were checked on arrival), by layer, then by sender."""
    found: dict[str, dict[str, Mapping[str, Any]]] = {}
    for report in reports:
        for env in report.all("arrays"):
            if is_head_stats(env):
                found.setdefault(str(stats_layer(env.body["name"])), {})[report.sender] = env.body["arrays"]
    return {layer: {s: head_stats_from_arrays(by[s]) for s in sorted(by)} for layer, by in found.items()}


def merge(sources: Mapping[str, HeadStats], cfg: Any) -> HeadStats:
    """The sources merged (in sender order, so arrival order does not matter) by the run's
    robust rule for statistics (exact by default)."""
    return robust_head_merge([sources[s] for s in sorted(sources)], cfg.robust, clip_k=cfg.robust_clip_k,
                             trim=cfg.robust_trim)


def edge_merge(plan: RoundPlan, reports: Sequence[Any], cfg: Any) -> tuple[list[Message], int]:
    """An edge's calibration phase: its devices' records merged at each layer and sent up
    (nothing when none came); returns the messages and how many devices' records were merged."""
    by_layer = records_of(reports)
    messages = [record(merge(sources, cfg), plan, cfg, layer) for layer, sources in by_layer.items()]
    return messages, len({s for sources in by_layer.values() for s in sources})
