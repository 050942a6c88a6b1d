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
from splitedge.methods.privacy.floor import most_releases, summed_withheld

METRICS_NOT_SENT = frozenset({"round"})  # the envelope's round already says it
from splitedge.methods.losslog import device_losses


def edge_done_info(part: Part, infos: Sequence[Mapping[str, Any]], *, reported: int, seconds: float, errors: int,
                   refused: Mapping[str, int], trained: bool = True) -> dict[str, Any]:
    """An edge's done info: its part's (of a training phase), its devices' losses and refusals
    (from their done infos), how many devices reported, how many of them failed the phase and
    why (`device_failed`, e.g. over their memory ceiling or time budget, runtime/guard.py), its
    own time, errors and refusals."""
    device_refused: collections.Counter[str] = collections.Counter()
    for i in infos:
        device_refused.update(i.get("refused") or {})
    info = {**(part.round_info() if trained else {}), **device_losses(infos), "devices": reported, "device_refused": dict(device_refused),
            "seconds": round(seconds, 3), "errors": errors, "refused": dict(refused)}
    failed = failed_devices(infos)
    if failed:
        info["device_failed"] = failed
    withheld = summed_withheld([i.get("withheld") for i in infos])
    if withheld:
        info["device_withheld"] = withheld  # classes (and images) below the minimum count, summed
    if part.losses:
        info["loss"] = dict(part.losses)
    return info


def failed_devices(infos: Sequence[Mapping[str, Any]]) -> dict[str, int]:
    """`{reason: devices}` of the devices whose phase failed ("memory" or "time": over their
    round guard's bound, as their `done` says; "refused": their edge refused a message of the
    phase; "other": any other failure), leavers aside."""
    out: collections.Counter[str] = collections.Counter()
    for i in infos:
        if i.get("failed") and not i.get("left"):
            out[str(i.get("reason") or "other")] += 1
    return dict(out)


def phase_failures(reports: Sequence[Report]) -> dict[str, int]:
    """A phase's failed devices summed over its edges (`device_failed` of their done infos),
    with the edges whose own merge failed as `edge_<reason>`: what the cloud records."""
    out: collections.Counter[str] = collections.Counter()
    for r in reports:
        info = _done_info(r)
        failed = info.get("device_failed")
        if isinstance(failed, Mapping):
            out.update({str(k): int(v) for k, v in failed.items() if isinstance(v, int)})
        if info.get("merge_failed"):
            out[f"edge_{info['merge_failed']}"] += 1
    return dict(out)


def round_rejections(cloud: Mapping[str, int], reports: Sequence[Report]) -> dict[str, dict[str, int]]:
    """Messages dropped so far, by rule: at the cloud (malformed frames, refused by the part)
    and at each edge that closed this round (as its done info says); devices summed."""
    out = {"cloud": dict(cloud)}
    devices: collections.Counter[str] = collections.Counter()
    for r in reports:
        info = _done_info(r)
        if info.get("refused"):
            out[r.sender] = dict(info["refused"])
        devices.update(info.get("device_refused") or {})
    if devices:
        out["devices"] = dict(devices)  # summed over this round's devices, each counting since it started
    return out


def _done_info(report: Report) -> Mapping[str, Any]:
    """A child's `done` info in its report (empty when it sent no `done`)."""
    done = report.get("done")
    return done.body["info"] if done is not None else {}


def phase_privacy(reports: Sequence[Report], prefix: str = "") -> dict[str, Any]:
    """What a closed phase's edges say of their devices' privacy, for the cloud's record (keys
    under `prefix`, each only when there is something to say): `withheld`, the classes and images
    held back below the minimum count per class, summed (methods/privacy/floor.py);
    `dp_releases`, the most differentially private releases one device made, which bounds every
    device's privacy loss (accountant.py); `secagg`, each edge's secure sums as its done info
    says (runtime/secure_sum.py)."""
    infos = [_done_info(r) for r in reports]
    secure = {r.sender: dict(i["secagg"]) for r, i in zip(reports, infos) if isinstance(i.get("secagg"), Mapping)}
    found = {"withheld": summed_withheld([i.get("device_withheld") for i in infos]),
             "dp_releases": most_releases([i.get("device_dp_releases") for i in infos]), "secagg": secure}
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
