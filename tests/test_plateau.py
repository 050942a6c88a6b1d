"""The plateau rule of the bench (bench/plateau.py, METHODS.md "Runs to a plateau")."""

from __future__ import annotations

from splitedge.bench.plateau import plateau_round, summary


def test_a_climbing_run_has_not_plateaued_and_a_flat_one_has_from_round_20() -> None:
    climbing = [0.01 * r for r in range(1, 41)]  # +1 point a round
    assert plateau_round(climbing) is None and not summary(climbing)["plateaued"]
    flat_after_15 = [min(r, 15) * 0.03 for r in range(1, 41)]
    assert plateau_round(flat_after_15) == 25  # best of 16..25 equals the best of 1..15
    assert plateau_round(flat_after_15, start=30) == 30


def test_half_a_point_over_ten_rounds_is_the_threshold() -> None:
    base = [0.5] * 20
    assert plateau_round(base + [0.504] * 10) == 20  # judged from round 20: already flat there
    assert plateau_round([0.4] * 10 + [0.5 + 0.0006 * i for i in range(30)]) is None  # 0.6 points per 10 rounds


def test_gaps_are_skipped_and_the_90pct_round_is_reported() -> None:
    curve = [None, 0.2, float("nan"), 0.45, 0.5, 0.5]
    s = summary(curve)
    assert s["final"] == 0.5 and s["best"] == 0.5 and s["round_to_90pct_of_final"] == 4
    assert summary([None, None])["final"] is None
