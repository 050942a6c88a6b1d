"""The plateau rule (methods/metrics/plateau.py, METHODS.md "Runs to a plateau")."""

from __future__ import annotations

from splitedge.methods.metrics.plateau import plateau_round, plateaued, summary


def test_a_climbing_run_has_not_plateaued_and_a_flat_one_has_from_round_20() -> None:
    climbing = [0.01 * r for r in range(1, 41)]  # +1 point a round
    assert plateau_round(climbing) is None and not summary(climbing)["plateaued"]
    flat_after_15 = [min(r, 15) * 0.03 for r in range(1, 41)]
    assert plateau_round(flat_after_15) == 25  # best of 16..25 equals the best of 1..15
    assert plateau_round(flat_after_15, start=30) == 30


def test_a_curve_flat_for_a_while_that_climbs_again_has_not_plateaued() -> None:
    """The rule must hold at the last round: one flat stretch does not count for good."""
    stalled_then_climbing = [0.3] * 25 + [0.3 + 0.01 * i for i in range(1, 21)]
    assert plateau_round(stalled_then_climbing[:25]) == 20  # flat by round 20
    assert plateau_round(stalled_then_climbing) is None and not summary(stalled_then_climbing)["plateaued"]
    assert not plateaued([{"accuracy": 0.5, "accuracy_calibrated": a} for a in stalled_then_climbing])
    flat_again = stalled_then_climbing + [0.5] * 12
    assert plateau_round(flat_again) == 55  # the round from which it stayed flat to the end


def test_half_a_point_over_ten_rounds_is_the_threshold() -> None:
    base = [0.5] * 20
    assert plateau_round(base + [0.504] * 10) == 20  # judged from round 20: already flat there
    assert plateau_round([0.4] * 10 + [0.5 + 0.0006 * i for i in range(30)]) is None  # 0.6 points per 10 rounds


def test_gaps_are_skipped_and_the_90pct_round_is_reported() -> None:
    curve = [None, 0.2, float("nan"), 0.45, 0.5, 0.5]
    s = summary(curve)
    assert s["final"] == 0.5 and s["best"] == 0.5 and s["round_to_90pct_of_final"] == 4
    assert summary([None, None])["final"] is None


def test_the_last_five_measured_rounds_are_averaged_past_gaps() -> None:
    curve = [0.1, 0.6, 0.4, None, 0.5, float("nan"), 0.3, 0.7, 0.5]
    assert abs(summary(curve)["last_mean"] - (0.4 + 0.5 + 0.3 + 0.7 + 0.5) / 5) < 1e-12
    assert abs(summary([0.2, 0.4])["last_mean"] - 0.3) < 1e-12  # fewer than five: all of them
    assert summary([None])["last_mean"] is None


def test_a_run_has_plateaued_when_each_of_its_curves_has() -> None:
    flat = [{"accuracy": 0.5} for _ in range(25)]
    assert plateaued(flat) and not plateaued(flat[:19])  # judged from round 20
    climbing = [{"accuracy": 0.5, "accuracy_calibrated": 0.01 * r} for r in range(25)]
    assert not plateaued(climbing)  # its calibrated head still climbs
    assert not plateaued([{"accuracy": None} for _ in range(30)])  # measured nothing: goes on to its budget
    # a clustered method's global model flat on the test split, its cluster models still climbing on
    # the devices' own data: not plateaued (CFLHKD used to stop here)
    clusters = [{"accuracy": 0.4, "personalised_accuracy": 0.3 + 0.01 * r} for r in range(25)]
    assert not plateaued(clusters)
    assert plateaued([{"accuracy": 0.4, "personalised_accuracy": 0.5} for _ in range(25)])


def test_the_cloud_stops_a_run_at_its_plateau(tmp_path) -> None:
    """digits with FedAvg flattens within a few rounds: a 40-round budget stops at the rule's
    first chance, round 20 or soon after, and says so."""
    import torch

    from splitedge.sim import SimSettings, run_sim

    torch.set_num_threads(1)
    summary = run_sim(SimSettings(rounds=40, devices=2, edges=1, method="fedavg", max_train=300, max_test=200,
                                  out=tmp_path, until_plateau=True))
    assert summary["stopped_on_plateau"] and 20 <= summary["rounds_done"] < 40, summary["accuracy_per_round"]
