"""Plots of a run (matplotlib, headless): accuracy and bytes per round (the spectrum per round is
runtime/outputs.py's: the cloud writes it too)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Sequence

MARKS = {"wc": ("W_c averaged", "tab:green"), "we": ("W_e averaged", "tab:purple")}
"""The H-SFP averaging directives (`directives["average"]`) drawn as vertical dotted lines."""

UNITS = (("MB", 1e6), ("KB", 1e3))


def byte_unit(largest: float) -> tuple[str, float]:
    """("MB", 1e6) when the largest value is at least 1 MB, else ("KB", 1e3) (decimal units)."""
    for name, size in UNITS:
        if largest >= size:
            return name, size
    return UNITS[-1]


def accuracy_ylabel(history: Sequence[dict[str, Any]], personalised: bool, accuracy_label: str | None) -> str:
    """`accuracy_label` when given; otherwise says whose accuracy it is: personalised (FedProto:
    each device's own model on its own held-out data), a linear probe's (self-supervised methods,
    whose records carry `probe_accuracy`), or the global model's test accuracy."""
    if accuracy_label:
        return accuracy_label
    if personalised or any(h.get("personalised") for h in history):
        return "personalised accuracy\n(devices' own held-out data)"
    if any("probe_accuracy" in h for h in history):
        return "linear-probe test accuracy"
    return "test accuracy"


def averaged(history: Sequence[dict[str, Any]]) -> dict[str, list[int]]:
    """The rounds whose directives average each part: {"wc": [rounds], "we": [rounds]}."""
    out: dict[str, list[int]] = {key: [] for key in MARKS}
    for h in history:
        parts = (h.get("directives") or {}).get("average") or []
        parts = [parts] if isinstance(parts, str) else list(parts)
        for key in MARKS:
            if key in parts:
                out[key].append(h["round"])
    return out


def cloud_received_per_round(history: Sequence[dict[str, Any]]) -> list[float]:
    """Payload bytes the cloud received during each round: differences of its cumulative
    counters snapshot (`bytes["in"]`); NaN for a record without one."""
    out, before = [], 0.0
    for h in history:
        received = (h.get("bytes") or {}).get("in")
        if received is None:
            out.append(float("nan"))
            continue
        total = float(sum(v.get("payload", 0) for v in received.values()))
        out.append(total - before)
        before = total
    return out


def run_figure(history: Sequence[dict[str, Any]], title: str = "", *, chance: float | None = None,
               personalised: bool = False, accuracy_label: str | None = None,
               device_bytes: Sequence[tuple[int, int]] | None = None) -> Any:
    """The run's figure (a matplotlib Figure, not registered with pyplot): accuracy per round with
    the chance level and the rounds that averaged W_c / W_e, and bytes per device per round.

    `device_bytes`: one (up, down) pair per history record, the payload bytes a device sent and
    received in that round (mean over devices). Without it the second panel shows the payload
    bytes the cloud received in each round.
    """
    from matplotlib.figure import Figure

    if device_bytes is not None and len(device_bytes) != len(history):
        raise ValueError(f"device_bytes has {len(device_bytes)} rounds, history {len(history)}")
    rounds = [h["round"] for h in history]
    acc = [float(h.get("accuracy", math.nan)) for h in history]  # a method may report no accuracy
    fig = Figure(figsize=(10, 3.8), dpi=100, layout="constrained")
    ax_acc, ax_bytes = fig.subplots(1, 2, gridspec_kw={"width_ratios": (3, 2)})
    if title:
        fig.suptitle(title)

    ax_acc.plot(rounds, acc, marker="o", color="tab:blue", label="accuracy")  # NaN: a gap
    if chance is not None:
        ax_acc.axhline(chance, linestyle="--", color="grey", linewidth=1, label=f"chance ({chance:.2g})")
    marks = averaged(history)
    both = set(marks["wc"]) & set(marks["we"])
    for key, shift in (("wc", -0.06), ("we", 0.06)):
        label, colour = MARKS[key]
        for i, r in enumerate(marks[key]):  # side by side when a round averages both
            ax_acc.axvline(r + (shift if r in both else 0.0), linestyle=":", color=colour, linewidth=1.2,
                           label=label if i == 0 else "_nolegend_")
    finite = [a for a in acc if math.isfinite(a)]
    ax_acc.set_ylim(0.0, max([1.0, *finite]) * 1.05)
    if not finite:
        ax_acc.text(0.5, 0.5, "no accuracy reported", transform=ax_acc.transAxes, ha="center", color="grey")
    ax_acc.set(xlabel="round", ylabel=accuracy_ylabel(history, personalised, accuracy_label), title="accuracy")
    ax_acc.legend(loc="best", fontsize="small", framealpha=0.8)

    if device_bytes is not None:
        series = {"up": [float(u) for u, _ in device_bytes], "down": [float(d) for _, d in device_bytes]}
        what, heading = "per device per round", "bytes per device per round"
    else:
        series = {"received by the cloud": cloud_received_per_round(history)}
        what, heading = "received by the cloud per round", "cloud uplink per round (not cumulative)"
    largest = max([v for values in series.values() for v in values if math.isfinite(v)], default=0.0)
    unit, size = byte_unit(largest)
    width = 0.8 / len(series)
    colours = {"up": "tab:orange", "down": "tab:cyan", "received by the cloud": "tab:orange"}
    for i, (name, values) in enumerate(series.items()):
        offset = (i - (len(series) - 1) / 2) * width
        ax_bytes.bar([r + offset for r in rounds], [v / size for v in values], width=width,
                     color=colours[name], label=name)
    ax_bytes.set_ylim(0.0, max(1.0, largest / size) * 1.25)  # room for the legend above the bars
    ax_bytes.set(xlabel="round", ylabel=f"{unit} {what}", title=heading)
    ax_bytes.legend(loc="upper right", ncols=len(series), fontsize="small", framealpha=0.8)

    for ax in (ax_acc, ax_bytes):
        if rounds and len(rounds) <= 20:
            ax.set_xticks(rounds)
        else:
            from matplotlib.ticker import MaxNLocator

            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    return fig


def plot_run(history: Sequence[dict[str, Any]], path: Path, title: str = "", *, chance: float | None = None,
             personalised: bool = False, accuracy_label: str | None = None,
             device_bytes: Sequence[tuple[int, int]] | None = None) -> None:
    """Write `run_figure(...)` to `path` as a PNG (dpi 100)."""
    run_figure(history, title, chance=chance, personalised=personalised, accuracy_label=accuracy_label,
               device_bytes=device_bytes).savefig(path, dpi=100)
