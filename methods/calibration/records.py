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

from splitedge.methods.calibration import CALIBRATE, HEAD, HEAD_STATS, is_head_stats
from splitedge.methods.calibration.robust import robust_head_merge
from splitedge.methods.calibration.stats import (
    HeadStats, HeadStatsAccumulator, check_head_stats, head_stats_arrays, head_stats_from_arrays,
)
from splitedge.methods.contract import DONE, DevicePart, Message, RoundPlan
from splitedge.methods.data.preprocess import accumulate
from splitedge.methods.privacy.release import private_accumulator, private_head_stats
from splitedge.protocol.errors import ProtocolError

STATS_BATCH = DevicePart.stats_batch
"""Images per forward pass while a device accumulates its statistics (inference only); a part
may take fewer (DevicePart.stats_batch)."""


@dataclass(frozen=True)
class Gate:
    """What a calibration phase's records must fit: made in `round`, of dimension `dim`, at most
    `num_classes` classes, in the run's wire dtype and covariance form."""

    round: int
    dim: int
    num_classes: int
    dtype: str
    cov: str

    @classmethod
    def of(cls, plan: RoundPlan, method: Any) -> "Gate":
        cfg = method.config
        dim = int((plan.directives.get(CALIBRATE) or {}).get("dim", 0))
        return cls(plan.round, dim, method.spec.num_classes, cfg.calib_dtype, cfg.calib_cov)

    def check(self, env: Any) -> None:
        """ProtocolError naming the rule when the record does not fit this phase."""
        if int(env.body["version"]) != self.round:
            raise ProtocolError("state.stale", f"head statistics of round {env.body['version']}; the calibration "
                                               f"is of round {self.round}")
        check_head_stats(env.body["arrays"], dim=self.dim, num_classes=self.num_classes, dtype=self.dtype,
                         cov=self.cov)


def head_stats(features: Callable[[np.ndarray], np.ndarray], data: tuple[np.ndarray, np.ndarray],
               mean: Sequence[float], std: Sequence[float], batch: int = STATS_BATCH,
               keep: np.ndarray | None = None) -> HeadStats:
    """Local uint8 images through `features` (normalised images -> classifier input) in
    batches, into the float64 accumulator (only the `keep` samples, when given)."""
    return accumulate(features, data, mean, std, HeadStatsAccumulator, batch, keep)


def record(stats: HeadStats, plan: RoundPlan, cfg: Any) -> Message:
    """The `arrays` record of `stats` for the calibration phase `plan` (sent up)."""
    arrays = head_stats_arrays(stats, cfg.calib_dtype, cfg.calib_cov)
    return Message("arrays", {"name": HEAD_STATS, "version": plan.round, "arrays": arrays})


def calibration_round(part: Any, plan: RoundPlan) -> Iterator[Message | object]:
    """A device's calibration phase: the record of its head statistics when its part can reach
    the classifier's input (`DevicePart.can_calibrate`), then DONE. Nothing is trained. The
    record holds only the classes above the run's minimum count; none when no class is."""
    if part.can_calibrate and part.cfg.dp_sigma > 0:
        yield from private_record(part, plan)
    elif part.can_calibrate:
        spec, data = part.spec, part.calibration_data()
        floor = part.stats_floor(data[1])
        if floor.keep.any():
            yield record(head_stats(part.classifier_input, data, spec.mean, spec.std, part.stats_batch,
                                    keep=floor.keep), plan, part.cfg)
    yield DONE


def private_record(part: Any, plan: RoundPlan) -> Iterator[Message]:
    """The differentially private record (methods/privacy/release.py): classifier inputs clipped
    to `dp_head_clip`, one noisy release of every class; nothing when no class survives it."""
    spec, data, cfg = part.spec, part.calibration_data(), part.cfg
    private = private_accumulator(part, cfg.dp_head_clip, cfg.calib_cov, private_head_stats(part, data[1]))
    stats = accumulate(part.classifier_input, data, spec.mean, spec.std, private, part.stats_batch)
    if len(stats.classes):
        yield record(stats, plan, cfg)


def evaluation_round(part: Any, plan: RoundPlan) -> Iterator[Message | object]:
    """A device's evaluation phase: its part scores the head it was sent (`evaluate_head`,
    kept as `part.evaluation` for the `done` info), then DONE. Nothing is sent but `done`."""
    part.evaluation = part.evaluate_head()
    yield DONE


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


def merged_scores(infos: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Devices' (or edges') scores of their heads merged: the accuracy over all their held-out
    samples, and how many there were (empty when nobody scored)."""
    scored = [(float(i["accuracy"]), int(i["eval_samples"])) for i in infos
              if i.get("accuracy") is not None and int(i.get("eval_samples") or 0) > 0]
    total = sum(n for _, n in scored)
    return {"accuracy": sum(a * n for a, n in scored) / total, "eval_samples": total} if total else {}


def records_of(reports: Sequence[Any]) -> dict[str, HeadStats]:
    """Each sender's head statistics in a phase's reports (its last record; records were checked
    on arrival), by sender."""
    found: dict[str, Mapping[str, Any]] = {}
    for report in reports:
        for env in report.all("arrays"):
            if is_head_stats(env):
                found[report.sender] = env.body["arrays"]
    return {s: head_stats_from_arrays(found[s]) for s in sorted(found)}


def merge(sources: Mapping[str, HeadStats], cfg: Any) -> HeadStats:
    """The sources merged (in sender order, so arrival order does not matter) by the run's
    robust rule for statistics (exact by default)."""
    return robust_head_merge([sources[s] for s in sorted(sources)], cfg.robust, clip_k=cfg.robust_clip_k,
                             trim=cfg.robust_trim)


def edge_merge(plan: RoundPlan, reports: Sequence[Any], cfg: Any) -> tuple[list[Message], int]:
    """An edge's calibration phase: its devices' records merged and sent up (nothing when none
    came); returns the messages and how many devices' records were merged."""
    sources = records_of(reports)
    if not sources:
        return [], 0
    return [record(merge(sources, cfg), plan, cfg)], len(sources)
