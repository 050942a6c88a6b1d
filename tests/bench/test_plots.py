"""The run plot (splitedge/plots.py): accuracy with chance and averaging marks, bytes per round,
checked on the matplotlib Figure rather than by parsing the PNG."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from matplotlib.colors import to_rgba

from splitedge.plots import MARKS, byte_unit, cloud_received_per_round, plot_run, run_figure


def cumulative_in(total: int) -> dict:
    """A cloud counters snapshot that has received `total` payload bytes so far."""
    return {"in": {"features": {"messages": 1, "payload": total - 100, "packet": total},
                   "done": {"messages": 1, "payload": 100, "packet": 120}},
            "out": {}, "control": {"out": 0, "in": 0}}


def synthetic_history() -> list[dict]:
    """Four H-SFP-style rounds: W_c averaged every round, W_e at rounds 2 and 4, round 3 without accuracy."""
    accuracy = [0.3, 0.55, float("nan"), 0.8]
    cumulative = [2_000, 5_000, 9_000, 14_000]
    return [{"round": r, "accuracy": a, "directives": {"average": ["wc", "we"] if r % 2 == 0 else ["wc"]},
             "versions": {}, "round_seconds": 1.0, "bytes": cumulative_in(c)}
            for r, a, c in zip(range(1, 5), accuracy, cumulative)]


DEVICE_BYTES = [(1_500_000, 3_000_000), (1_400_000, 2_900_000), (1_600_000, 3_100_000), (1_500_000, 3_000_000)]


def legend_labels(ax) -> list[str]:
    return [t.get_text() for t in ax.get_legend().get_texts()]


def vertical_lines(ax, colour: str) -> list[float]:
    """x of the axis-spanning vertical lines drawn in `colour`."""
    return [line.get_xdata()[0] for line in ax.get_lines()
            if to_rgba(line.get_color()) == to_rgba(colour) and line.get_xdata()[0] == line.get_xdata()[1]]


def test_plot_run_writes_a_png(tmp_path: Path) -> None:
    # Execute
    plot_run(synthetic_history(), tmp_path / "plot.png", title="hsfp on digits", chance=0.1,
             device_bytes=DEVICE_BYTES)
    # Assert
    data = (tmp_path / "plot.png").read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 10_000


def test_accuracy_panel_has_chance_line_averaging_marks_once_each_and_a_gap_for_nan() -> None:
    # Execute
    fig = run_figure(synthetic_history(), "hsfp on digits, 4 devices, 2 edges, IID, 4 rounds", chance=0.1,
                     device_bytes=DEVICE_BYTES)
    ax = fig.axes[0]
    # Assert
    assert fig._suptitle.get_text() == "hsfp on digits, 4 devices, 2 edges, IID, 4 rounds"
    labels = legend_labels(ax)
    assert labels.count("W_c averaged") == 1 and labels.count("W_e averaged") == 1
    assert "chance (0.1)" in labels
    chance = [line for line in ax.get_lines() if list(line.get_ydata()) == [0.1, 0.1]]
    assert len(chance) == 1 and chance[0].get_linestyle() == "--"
    assert len(vertical_lines(ax, MARKS["wc"][1])) == 4
    assert sorted(round(x) for x in vertical_lines(ax, MARKS["we"][1])) == [2, 4]
    marks = [line for line in ax.get_lines() if to_rgba(line.get_color()) in (to_rgba(c) for _, c in MARKS.values())]
    assert len(marks) == 6 and all(line.get_linestyle() == ":" for line in marks)
    accuracy = next(line for line in ax.get_lines() if line.get_label() == "accuracy")
    assert math.isnan(accuracy.get_ydata()[2])  # left as a gap, not zero or interpolated
    assert ax.get_ylim()[0] == 0 and 1.0 <= ax.get_ylim()[1] <= 1.1
    assert list(ax.get_xticks()) == [1, 2, 3, 4]


def test_bytes_panel_shows_up_and_down_per_device_in_mb() -> None:
    # Execute
    ax = run_figure(synthetic_history(), device_bytes=DEVICE_BYTES).axes[1]
    # Assert
    assert ax.get_ylabel() == "MB per device per round"
    assert legend_labels(ax) == ["up", "down"]
    ups, downs = ax.containers
    assert [round(b.get_height(), 2) for b in ups] == [1.5, 1.4, 1.6, 1.5]
    assert [round(b.get_height(), 2) for b in downs] == [3.0, 2.9, 3.1, 3.0]


def test_without_device_bytes_the_panel_shows_what_the_cloud_received_per_round_in_kb() -> None:
    # Execute
    ax = run_figure(synthetic_history()).axes[1]
    # Assert
    assert ax.get_ylabel() == "KB received by the cloud per round"
    (bars,) = ax.containers
    assert [b.get_height() for b in bars] == [2.0, 3.0, 4.0, 5.0]  # differences, not the cumulative counter


@pytest.mark.parametrize("largest, unit", [(0, "KB"), (999_999, "KB"), (1_000_000, "MB"), (5e8, "MB")])
def test_byte_unit_switches_from_kb_to_mb_at_one_megabyte(largest: float, unit: str) -> None:
    assert byte_unit(largest)[0] == unit


def test_personalised_and_explicit_labels_name_the_accuracy() -> None:
    history = synthetic_history()
    assert "test accuracy" == run_figure(history).axes[0].get_ylabel()
    assert "personalised" in run_figure(history, personalised=True).axes[0].get_ylabel()
    assert run_figure(history, accuracy_label="probe").axes[0].get_ylabel() == "probe"
    probe = [{**h, "probe_accuracy": h["accuracy"]} for h in history]
    assert "linear-probe" in run_figure(probe).axes[0].get_ylabel()


def test_records_without_bytes_or_accuracy_still_plot() -> None:
    history = [{"round": 1}, {"round": 2, "bytes": cumulative_in(3_000)}]
    assert [math.isnan(v) for v in cloud_received_per_round(history)] == [True, False]
    run_figure(history)  # no accuracy at all: an empty panel that says so


def test_device_bytes_must_cover_every_round() -> None:
    with pytest.raises(ValueError, match="device_bytes has 1 rounds"):
        run_figure(synthetic_history(), device_bytes=DEVICE_BYTES[:1])
