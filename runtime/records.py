"""What a closed round reports upward: an edge's `done` info, and the cloud's tally of refusals.

Each tier adds its own to what its children said: an edge merges its devices' losses (sample
weighted) and sums their refusal counts beside its own; the cloud lists refusals per tier in
its metrics record (`rejected`), so one look at a round shows where messages were dropped.
"""

from __future__ import annotations

import collections
import math
import numbers
from typing import Any, Mapping, Sequence

from splitedge.methods.contract import Part, Report
from splitedge.methods.losslog import merge_weighted
from splitedge.methods.privacy.floor import most_releases, summed_withheld
from splitedge.protocol.done import DevicesDone, DoneInfo, dones

METRICS_NOT_SENT = frozenset({"round"})  # the envelope's round already says it


def edge_done_info(part: Part, infos: Mapping[str, DoneInfo], *, reported: int, seconds: float, errors: int,
                   refused: Mapping[str, int], trained: bool = True) -> DoneInfo:
    """An edge's done info: its part's `round_info` and losses (of a training phase), its own time,
    errors and refusals, and `devices`: what its devices' done infos say, under their names
    (losses merged by samples, refusals and withheld classes summed, failures by reason, who
    left and why), with how many reported."""
    values = list(infos.values())
    losses, samples = merge_weighted((i.loss, i.samples or 0) for i in values if i.loss)
    refused_by_devices: collections.Counter[str] = collections.Counter()
    for i in values:
        refused_by_devices.update(i.refused)
    devices = DevicesDone(reported=reported, loss=losses, samples=samples, refused=dict(refused_by_devices),
                          failed=failed_devices(values), withheld=summed_withheld([i.withheld for i in values]),
                          left={d: i.left for d, i in infos.items() if i.left})
    return DoneInfo(method=dict(part.round_info()) if trained else {}, loss=dict(part.losses), devices=devices,
                    seconds=round(seconds, 3), errors=errors, refused=dict(refused))


def failed_devices(infos: Sequence[DoneInfo]) -> dict[str, int]:
    """`{reason: devices}` of the devices whose phase failed ("memory" or "time": over their
    round guard's bound, as their `done` says; "refused": their edge refused a message of the
    phase; "other": any other failure), leavers aside."""
    return dict(collections.Counter(i.reason or "other" for i in infos if i.failed and not i.left))


def phase_failures(reports: Sequence[Report]) -> dict[str, int]:
    """A phase's failed devices summed over its edges (their `devices.failed`), with the edges
    whose own merge failed as `edge_<reason>`: what the cloud records."""
    out: collections.Counter[str] = collections.Counter()
    for info in dones(reports).values():
        out.update((info.devices or DevicesDone()).failed)
        if info.failed:
            out[f"edge_{info.reason or 'failed'}"] += 1
    return dict(out)


def round_rejections(cloud: Mapping[str, int], reports: Sequence[Report]) -> dict[str, dict[str, int]]:
    """Messages dropped so far, by rule: at the cloud (malformed frames, refused by the part)
    and at each edge that closed this round (as its done info says); devices summed."""
    out = {"cloud": dict(cloud)}
    devices: collections.Counter[str] = collections.Counter()
    for edge, info in dones(reports).items():
        if info.refused:
            out[edge] = dict(info.refused)
        devices.update((info.devices or DevicesDone()).refused)
    if devices:
        out["devices"] = dict(devices)  # summed over this round's devices, each counting since it started
    return out


def phase_privacy(reports: Sequence[Report], prefix: str = "") -> dict[str, Any]:
    """What a closed phase's edges say of their devices' privacy, for the cloud's record (keys
    under `prefix`, each only when there is something to say): `withheld`, the classes and images
    held back below the minimum count per class, summed (methods/privacy/floor.py);
    `dp_releases`, the most differentially private releases one device made, which bounds every
    device's privacy loss (accountant.py); `secagg`, each edge's secure sums as its done info
    says (runtime/secure_sum.py)."""
    infos = dones(reports)
    of = [i.devices or DevicesDone() for i in infos.values()]
    found = {"withheld": summed_withheld([d.withheld for d in of]),
             "dp_releases": most_releases([d.dp_releases for d in of]),
             "secagg": {e: dict(i.secagg) for e, i in infos.items() if i.secagg}}
    return {prefix + key: value for key, value in found.items() if value}


def wire_metrics(record: Mapping[str, Any]) -> dict[str, int | float]:
    """The numbers of a cloud's round record (accuracy, round seconds, edges, ...) as the body of
    its `metrics` message: what a watcher shows per round. Maps (losses, bytes, costs, which
    travel in the edges' done infos) and anything not finite stay in metrics.jsonl."""
    out: dict[str, int | float] = {}
    for key, value in record.items():
        if key in METRICS_NOT_SENT or isinstance(value, bool) or not isinstance(value, numbers.Real):
            continue
        value = int(value) if isinstance(value, numbers.Integral) else float(value)
        if math.isfinite(value):
            out[str(key)] = value
    return out
