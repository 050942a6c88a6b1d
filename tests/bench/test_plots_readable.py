"""Plots a person can read (issue 31, item 8), checked on the matplotlib Figures the plot
functions build from synthetic results: a 40-round spectrum has a colour scale, not a legend
entry per round; a method has one colour in every bench plot and no two methods of a plot share
one; a one-round run is drawn as bars; and no plot raises a matplotlib warning."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Iterator

import matplotlib
import numpy as np
import pytest

matplotlib.use("Agg")

from matplotlib.colors import to_hex  # noqa: E402 - after the backend is chosen
from matplotlib.lines import Line2D  # noqa: E402

from splitedge.bench import accuracy, bandwidth, cluster, compare, hsfp_diagnose, ssl  # noqa: E402
from splitedge.bench.lib.plotstyle import method_colour, method_colours, palette  # noqa: E402
from splitedge.methods.registry import list_methods  # noqa: E402
from splitedge.runtime.outputs import plot_spectra_per_round, spectra_per_round_figure  # noqa: E402

SPLITS = ("IID", "Dirichlet(0.3)")
CALIBRATED = ("hsfp", "hsfp-cal", "fedavg")


@pytest.fixture(autouse=True)
def warnings_are_errors() -> Iterator[None]:
    """Any warning while a plot is built or saved fails the test."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        yield


def spectrum(rng: np.random.Generator, r: int, dim: int = 64) -> list[float]:
    """A normalised spectrum that collapses as the rounds go by, with float round-off zeros."""
    values = np.sort(rng.random(dim) ** (1 + r / 5))[::-1]
    values[-3:] = 1e-18
    return [float(v) for v in values / values.sum()]


def runs(rounds: int, *, methods: list[str] | None = None, seed: int = 0) -> list[dict[str, Any]]:
    """A bench accuracy run's rows: every method on two splits, calibrated curves for some."""
    rng = np.random.default_rng(seed)
    out = []
    for m in methods or list_methods():
        for split in SPLITS:
            acc = [float(a) for a in np.clip(np.cumsum(rng.random(rounds) * 0.1), 0.0, 1.0)]
            out.append({"method": m, "base_method": m, "split": split, "accuracy_per_round": acc,
                        "accuracy_calibrated_per_round": [a + 0.05 for a in acc] if m in CALIBRATED else None,
                        "representation": {"spectrum": spectrum(rng, 3, dim=32)},
                        "per_round": [{"personalised_accuracy": a,
                                       "bytes": {"device": {"out_payload": 1e6 * (i + 1), "in_payload": 2e6 * (i + 1)}}}
                                      for i, a in enumerate(acc)]})
    out.append({"method": "broken", "split": "IID", "error": "it failed"})
    return out


def bandwidth_results(rounds: int) -> dict[str, Any]:
    return {"methods": [r for r in runs(rounds) if r.get("split") == "IID"]}


def compare_results() -> dict[str, Any]:
    rows = [r for r in runs(3) if "error" not in r]
    return {"rows": [{"method": r["method"], "split": r["split"], "central": False, "calibrated_final": [None],
                      "own_final": [r["accuracy_per_round"][-1]], "rounds": [3], "up_per_round": 1e5 * (i + 1),
                      "down_per_round": 2e5} for i, r in enumerate(rows)]
            + [{"method": "central", "split": "IID", "central": True, "calibrated_final": [None], "own_final": [0.9],
                "rounds": [1], "up_per_round": 0, "down_per_round": 0}]}


def diagnose_results(rounds: int) -> dict[str, Any]:
    stacks = ["hsfp", "oracle-edge", "oracle"]
    return {"stacks": stacks, "rounds": [{"round": r, **{s: {"accuracy": 0.1 * r + 0.01 * k} for k, s in enumerate(stacks)}}
                                         for r in range(1, rounds + 1)]}


def render(fig: Any) -> None:
    """Draw the figure (layout and legend placement run then, as when it is saved)."""
    fig.canvas.draw()


def series_lines(ax: Any) -> list[Line2D]:
    """The Axes' data lines (legend handles built apart are not among them)."""
    return [line for line in ax.get_lines() if len(line.get_xdata())]


def line_colours(ax: Any) -> set[str]:
    return {to_hex(line.get_color()) for line in series_lines(ax)}


def legend_entries(ax: Any) -> dict[str, str]:
    """Legend label -> colour of its line handle."""
    legend = ax.get_legend()
    return {t.get_text(): to_hex(h.get_color()) for t, h in zip(legend.get_texts(), legend.legend_handles)}


# -- spectrum per round (written by the cloud and the sim) --------------------------------------

def test_forty_rounds_of_spectra_get_a_colorbar_not_a_legend(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    history = [{"round": r, "spectrum": spectrum(rng, r)} for r in range(1, 41)] + [{"round": 41, "accuracy": 0.5}]

    fig = spectra_per_round_figure(history, title="fedavg on cifar10")
    render(fig)

    ax, bar = fig.axes  # the plot and its colorbar
    assert ax.get_legend() is None
    assert "round" in bar.get_ylabel()
    assert len(series_lines(ax)) == 40
    assert len(line_colours(ax)) > 20  # a colour scale: the rounds do not cycle through ten colours
    ticks = [t for t in bar.get_yticks() if 1 <= t <= 40]
    assert ticks and all(float(t).is_integer() for t in ticks)
    path = plot_spectra_per_round(history, tmp_path / "spectrum.png")
    assert path is not None and path.stat().st_size > 1000


def test_one_round_of_spectrum_and_none() -> None:
    fig = spectra_per_round_figure([{"round": 1, "spectrum": [0.6, 0.3, 0.1]}])
    render(fig)
    assert len(series_lines(fig.axes[0])) == 1
    assert spectra_per_round_figure([{"round": 1, "accuracy": 0.2}]) is None


# -- one colour per method ----------------------------------------------------------------------

def test_method_colours_are_fixed_and_distinct() -> None:
    names = [*list_methods(), "central", "variant-a", "variant-b", "oracle"]
    colours = method_colours(names)
    assert len({to_hex(c) for c in colours.values()}) == len(names)
    assert len({to_hex(c) for c in palette()}) == len(palette()) >= 40
    for m in list_methods():  # a registered method's colour does not depend on the plot's other rows
        assert to_hex(method_colour(m)) == to_hex(colours[m]) == to_hex(method_colours(["x", m, "y"])[m])


def test_a_remark_keeps_the_colour_and_the_bounds_have_their_own() -> None:
    """The matrix plot labels FedProto "fedproto (personalised)" and the cells' plots "fedproto";
    the bounds appear beside different variants in each plot: neither may change colour."""
    assert to_hex(method_colours(["fedproto (personalised)", "a"])["fedproto (personalised)"]) == \
        to_hex(method_colour("fedproto"))
    assert to_hex(method_colours(["x (one)", "x (two)", "b"])["x (one)"]) == \
        to_hex(method_colours(["x (one)", "x (two)", "b"])["x (two)"])
    for bound in ("upper", "lower"):
        seen = {to_hex(method_colours([bound, *others])[bound]) for others in ([], ["fedavg", "zz"], ["aa", "b"])}
        assert len(seen) == 1 and not seen & {to_hex(method_colour(m)) for m in list_methods()}


def test_accuracy_plot_legend_names_each_method_once() -> None:
    fig = accuracy.figure({"runs": runs(12)})
    render(fig)
    ax = fig.axes[0]
    methods = list_methods()
    entries = legend_entries(ax)
    assert set(methods) <= set(entries)
    assert len(entries) <= len(methods) + len(SPLITS) + 1  # methods, splits, "calibrated": not one per curve
    assert len({entries[m] for m in methods}) == len(methods)  # no two methods share a colour
    assert len(series_lines(ax)) == 2 * len(methods) + 2 * len(CALIBRATED)


@pytest.mark.parametrize("rounds", [1, 5])
def test_a_method_has_the_same_colour_in_every_bench_plot(rounds: int) -> None:
    """accuracy.png, bandwidth.png, cluster.png and the compare and spectrum plots agree."""
    figures = {"accuracy": accuracy.figure({"runs": runs(rounds)}),
               "bandwidth": bandwidth.figure(bandwidth_results(rounds)),
               "cluster": cluster.figure({"runs": runs(rounds)}),
               "compare": compare.figure(compare_results()),
               "spectrum": ssl.spectrum_figure({"runs": runs(rounds)})}
    seen: dict[str, dict[str, str]] = {}
    for name, fig in figures.items():
        render(fig)
        seen[name] = drawn_colours(fig.axes[0])
    for m in list_methods():
        assert {name: colours[m] for name, colours in seen.items()} == {name: to_hex(method_colour(m)) for name in seen}
    for colours in seen.values():
        assert len(set(colours.values())) == len(colours)


def drawn_colours(ax: Any) -> dict[str, str]:
    """Method -> colour as the Axes shows it: the legend's entries for lines, or each bar's
    colour by its tick label (bars carry no legend)."""
    if ax.get_legend() is not None:
        return {k: v for k, v in legend_entries(ax).items() if k not in SPLITS and k != "calibrated"}
    labels = [t.get_text() for t in ax.get_yticklabels()]  # in the order the bars were drawn
    out: dict[str, str] = {}
    for label, patch in zip(labels, ax.patches):
        method = label.split(" ")[0]
        assert out.setdefault(method, to_hex(patch.get_facecolor())) == to_hex(patch.get_facecolor())
    return out


def test_hsfp_diagnose_stacks_are_distinct_and_hsfp_keeps_its_colour() -> None:
    fig = hsfp_diagnose.figure(diagnose_results(6))
    render(fig)
    entries = legend_entries(fig.axes[0])
    assert set(entries) == {"hsfp", "oracle-edge", "oracle"} and len(set(entries.values())) == 3
    assert entries["hsfp"] == to_hex(method_colour("hsfp"))


# -- one-round runs as bars -----------------------------------------------------------------

@pytest.mark.parametrize("build", [
    lambda: accuracy.figure({"runs": runs(1)}),
    lambda: bandwidth.figure(bandwidth_results(1)),
    lambda: cluster.figure({"runs": runs(1)}),
    lambda: hsfp_diagnose.figure(diagnose_results(1)),
], ids=["accuracy", "bandwidth", "cluster", "hsfp_diagnose"])
def test_one_round_gives_bars_not_one_point_lines(build: Any) -> None:
    fig = build()
    render(fig)
    ax = fig.axes[0]
    assert ax.patches and not series_lines(ax)
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert len(labels) == len(ax.patches) == len(set(labels))  # one labelled bar per run


def test_one_round_accuracy_bars_hatch_the_calibrated_head() -> None:
    fig = accuracy.figure({"runs": runs(1, methods=["fedavg", "scaffold"])})
    render(fig)
    hatched = [p for p in fig.axes[0].patches if p.get_hatch()]
    assert len(hatched) == len(SPLITS)  # fedavg's calibrated head on each split


# -- the files ----------------------------------------------------------------------------------

def test_bench_plots_write_pngs_without_warnings(tmp_path: Path) -> None:
    for rounds in (1, 4):
        out = tmp_path / str(rounds)
        out.mkdir()
        written = [*accuracy.plot({"runs": runs(rounds)}, out), *bandwidth.plot(bandwidth_results(rounds), out),
                   *cluster.plot({"runs": runs(rounds)}, out), *compare.plot(compare_results(), out),
                   *hsfp_diagnose.plot(diagnose_results(rounds), out), *ssl.plot({"runs": runs(rounds)}, out)]
        assert {p.name for p in written} == {"accuracy.png", "bandwidth.png", "cluster.png", "accuracy-vs-bytes.png",
                                             "hsfp_diagnose.png", "spectrum.png"}
        assert all(p.stat().st_size > 1000 for p in written)


def test_no_finished_runs_still_plots(tmp_path: Path) -> None:
    assert accuracy.plot({"runs": [{"method": "fedavg", "split": "IID", "error": "x"}]}, tmp_path)
    assert compare.plot({"rows": []}, tmp_path)


# -- the machine a bench ran on: measured, not a sentence written for one box -------------------

def test_bench_reports_state_the_measured_machine() -> None:
    from splitedge.bench import scale_clients
    from splitedge.bench.lib import report

    doc = report.document("accuracy", ["bench", "accuracy"], {}, {}, 1.0)
    header = report.header_markdown(doc)
    assert "2-core" not in header and f"{doc['machine']['cpu_count']} x" in header and "load average" in header
    facts = scale_clients.machine_facts([0.5, 0.4, 0.3])
    assert facts["cpu_count"] and facts["loadavg_at_start"] == [0.5, 0.4, 0.3]
    line = scale_clients.machine_line(facts)
    assert line.startswith(f"{facts['cpu_count']} CPUs") and "0.5 / " in line
    assert scale_clients.machine_line(None) == "not recorded by this run"
    assert "2-core" not in scale_clients.NOTES
