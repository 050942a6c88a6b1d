"""When a run has stopped climbing, and what its curve says (METHODS.md "Runs to a plateau"):
the bench's summary of a curve, and the cloud's `--until-plateau` stop.

A curve is flat at round r when the best accuracy of rounds r-window+1..r exceeds the best
before them by less than `tolerance` (0.5 points), judged from round `start` (20) on. A run has
plateaued when every curve it measures is flat at its last round: a curve that was flat for a
while and then climbed again has not (before, one flat stretch counted for good: a 200-device
FedAvg run's calibrated head was flat at round 23 and rose 5.3 points more by round 94).
Reported beside the final and best accuracy: the round from which the curve stayed flat to the
end, the round at which it first reached 90 % of its final accuracy, and the mean of its last
`LAST` measured rounds (a noisy curve's final round is one draw of it). Curves may have gaps
(rounds that measured nothing: None or NaN); those rounds are skipped.
"""

from __future__ import annotations

from typing import Any, Sequence

WINDOW, TOLERANCE, START = 10, 0.005, 20
LAST = 5
RULE = (f"plateaued: at its last round, the best accuracy of its last {WINDOW} rounds beat the best before "
        f"them by less than {100 * TOLERANCE:g} points (judged from round {START} on, methods/metrics/plateau.py); "
        f"rN: the round from which that held to the end")
"""The rule in words, for the bench's tables."""


def _measured(curve: Sequence[Any]) -> list[tuple[int, float]]:
    return [(i + 1, float(a)) for i, a in enumerate(curve) if a is not None and a == a]


def _flat_at(points: list[tuple[int, float]], r: int, window: int, tolerance: float) -> bool:
    """The rule over rounds r-window+1..r of the measured `points`."""
    last = [a for i, a in points if r - window < i <= r]
    before = [a for i, a in points if i <= r - window]
    return bool(last and before and max(last) - max(before) < tolerance)


def plateau_round(curve: Sequence[Any], *, window: int = WINDOW, tolerance: float = TOLERANCE,
                  start: int = START) -> int | None:
    """The first round from which the curve stayed flat to its end, or None when it is not
    flat at its last round (still climbing, or climbing again)."""
    points, first = _measured(curve), max(start, window + 1)
    r = len(curve)
    if r < first or not _flat_at(points, r, window, tolerance):
        return None
    while r > first and _flat_at(points, r - 1, window, tolerance):
        r -= 1
    return r


def summary(curve: Sequence[Any], **rule: Any) -> dict[str, Any]:
    """final, best, the mean of the last LAST rounds, the round reaching 90 % of final, and
    whether (and when) the run plateaued."""
    points = _measured(curve)
    if not points:
        return {"final": None, "best": None, "last_mean": None, "round_to_90pct_of_final": None,
                "plateaued": False, "plateau_round": None}
    last = [a for _, a in points[-LAST:]]
    final = points[-1][1]
    reached = next((i for i, a in points if a >= 0.9 * final), None)
    at = plateau_round(curve, **rule)
    return {"final": final, "best": max(a for _, a in points), "last_mean": sum(last) / len(last),
            "round_to_90pct_of_final": reached,
            "plateaued": at is not None, "plateau_round": at}


CURVES = ("accuracy", "accuracy_calibrated", "personalised_accuracy")
"""What a run's records may measure: its own accuracy, its calibrated head's, and (clustered and
personalised methods: CFLHKD) each device's model on its own held-out data, the figure those
methods are judged by. Before, CFLHKD stopped when its global model on the test split stopped
climbing, whatever its cluster models did."""


def curves(history: Sequence[dict[str, Any]]) -> list[list[Any]]:
    """A run's curves from its metrics records: its own accuracy and those of CURVES it measures."""
    out = [[h.get("accuracy") for h in history]]
    for key in CURVES[1:]:
        curve = [h.get(key) for h in history]
        if any(a is not None for a in curve):
            out.append(curve)
    return out


def plateaued(history: Sequence[dict[str, Any]], **rule: Any) -> bool:
    """True when every curve of the run is flat at its last round (the cloud stops there with
    `--until-plateau`); a run whose curve measured nothing goes on to its budget."""
    return all(any(a is not None and a == a for a in c) and plateau_round(c, **rule) is not None
               for c in curves(history))
