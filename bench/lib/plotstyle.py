"""How bench plots look, in one place, so a reader can compare them side by side.

A method keeps its colour in every bench plot (accuracy.png, bandwidth.png, cluster.png, the
compare plot...) and no two methods of one plot share one; a label splits on marker shape, a
calibrated head on a dashed line; the legend names each method, split and style once, outside
the axes, instead of one entry per curve over the data. A run of one round has one point per
curve, which a line plot draws on an x axis from 0.96 to 1.04: it gets one bar per curve.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cache
from typing import Any, Iterable, Sequence

HEADLINE = ("hsfp", "hsfp-cal", "fedavg")
"""The project's own comparison: these take the palette's first (strongest) colours."""

FIXED = {"central": "black", "upper": "black", "lower": "dimgrey"}
"""Bounds that are not methods keep a colour no method gets: the plans label them `upper`
(central training) and `lower` (a random network with the calibrated head)."""

MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*", "<", ">")
"""One marker shape per split (IID, Dirichlet(0.3), ...) in order of first appearance."""

DASHED = "--"


@cache
def palette() -> tuple[tuple[float, ...], ...]:
    """60 distinct colours: tab20's ten strong then its ten light ones, then tab20b and tab20c
    (groups of four shades of a hue) hue by hue, so that neighbouring slots differ in hue."""
    from matplotlib import colormaps

    tab20 = colormaps["tab20"].colors
    shades = (*colormaps["tab20b"].colors, *colormaps["tab20c"].colors)
    return (*tab20[0::2], *tab20[1::2], *(shades[i + k] for k in range(4) for i in range(0, len(shades), 4)))


def registry_order() -> list[str]:
    """The registered methods, headline ones first, the rest by name: a method's colour slot."""
    from splitedge.methods.registry import list_methods

    known = list_methods()
    return [m for m in HEADLINE if m in known] + [m for m in known if m not in HEADLINE]


def method_colours(names: Iterable[str]) -> dict[str, Any]:
    """A colour per label, distinct within `names` (labels that differ only by a remark in
    brackets share theirs). A registered method has the same colour in every plot (its registry
    slot), the bounds `upper` and `lower` fixed ones; the other labels (variants, diagnose
    stacks), by name, take the slots after the registry's in turn: the same in every plot of one
    bench run, whose plots show the same rows. Past the palette's 60 colours they repeat."""
    order, colours = registry_order(), palette()
    base = {n: base_label(n) for n in names}
    others = sorted({b for b in base.values() if b not in FIXED and b not in order})

    def colour(b: str) -> Any:
        if b in FIXED:
            return FIXED[b]
        return colours[(order.index(b) if b in order else len(order) + others.index(b)) % len(colours)]
    return {n: colour(b) for n, b in base.items()}


def base_label(name: str) -> str:
    """A label without its remark: "fedproto (personalised)" is drawn in fedproto's colour."""
    return name.split(" (", 1)[0]


def method_colour(name: str) -> Any:
    """One label's colour, as `method_colours` gives it in any plot (a registered method's is fixed)."""
    return method_colours([name])[name]


@dataclass
class Series:
    """One curve of a bench plot: whose it is (method label, split) and its points."""

    method: str
    y: Sequence[float | None]
    x: Sequence[float] | None = None  # None: rounds 1..n
    split: str = ""
    dashed: bool = False  # e.g. the calibrated head, drawn as a dashed line or a hatched bar
    note: str = ""  # a bar's extra words (one-round plots), e.g. the bytes it cost
    size: float | None = None  # its markers' size in points (None: the plot's), e.g. from device RAM

    xs: list[float] = field(init=False)
    ys: list[float] = field(init=False)

    def __post_init__(self) -> None:
        self.ys = [math.nan if v is None else float(v) for v in self.y]
        self.xs = [float(v) for v in self.x] if self.x is not None else [float(i) for i in range(1, len(self.ys) + 1)]
        if len(self.xs) != len(self.ys):
            raise ValueError(f"{self.method} {self.split}: {len(self.xs)} x values for {len(self.ys)} y values")


def one_point(series: Sequence[Series]) -> bool:
    """Every curve has at most one point (a one-round run): bars read better than lines."""
    return bool(series) and all(len(s.ys) <= 1 for s in series)


def split_markers(series: Sequence[Series]) -> dict[str, str]:
    """A marker per split, in order of first appearance."""
    splits = list(dict.fromkeys(s.split for s in series))
    return {split: MARKERS[i % len(MARKERS)] for i, split in enumerate(splits)}


def new_figure(series: Sequence[Series], *, width: float = 8.0) -> Any:
    """A Figure (not registered with pyplot: no global state, no "too many figures" warning)
    with one Axes, tall enough for one bar per curve when the plot will be bars."""
    from matplotlib.figure import Figure

    height = max(3.0, 0.28 * len(series) + 1.2) if one_point(series) else 4.5
    fig = Figure(figsize=(width, height), dpi=100, layout="constrained")
    fig.add_subplot()
    return fig


def draw(ax: Any, series: Sequence[Series], *, xlabel: str, ylabel: str, dashed_label: str = "calibrated") -> None:
    """Lines coloured by method, or one bar per curve when every curve has a single point."""
    if not series:
        ax.text(0.5, 0.5, "no finished runs", transform=ax.transAxes, ha="center", color="grey")
        return
    if one_point(series):
        bars(ax, series, value_label=ylabel, dashed_label=dashed_label)
    else:
        lines(ax, series, dashed_label=dashed_label)
        ax.set(xlabel=xlabel, ylabel=ylabel)


def lines(ax: Any, series: Sequence[Series], *, dashed_label: str, markersize: float = 4.0) -> None:
    """One line per curve (a point per curve is a scatter): colour = method, marker = split,
    dashed = `dashed_label`; one legend entry per method, per split and for the dashed style,
    outside the axes."""
    colours = method_colours(s.method for s in series)
    markers = split_markers(series)
    for s in series:  # a long curve marks every few points only: its split still shows
        ax.plot(s.xs, s.ys, color=colours[s.method], marker=markers[s.split],
                markersize=markersize if s.size is None else s.size,
                markevery=max(1, len(s.ys) // 10), linestyle=DASHED if s.dashed else "-", linewidth=1.3)
    legend(ax, colours, markers if len(markers) > 1 else {}, dashed_label if any(s.dashed for s in series) else "")


def legend(ax: Any, colours: dict[str, Any], markers: dict[str, str], dashed_label: str) -> None:
    """Methods, then splits (grey markers), then the dashed style: each named once."""
    from matplotlib.lines import Line2D

    handles = [Line2D([], [], color=c, linewidth=2, label=name) for name, c in colours.items()]
    handles += [Line2D([], [], color="grey", marker=m, linestyle="none", label=split) for split, m in markers.items()]
    if dashed_label:
        handles.append(Line2D([], [], color="grey", linestyle=DASHED, label=dashed_label))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7, frameon=False,
              ncols=2 if len(handles) > 18 else 1)


def bar_label(s: Series, dashed_label: str) -> str:
    words = [s.method, s.split, dashed_label if s.dashed else ""]
    return " ".join(w for w in words if w)


def bars(ax: Any, series: Sequence[Series], *, value_label: str, dashed_label: str) -> None:
    """One horizontal bar per curve, labelled on the axis (no legend needed), the value (and the
    curve's note) written at its end; the dashed style is a hatched bar."""
    colours = method_colours(s.method for s in series)
    values = [s.ys[0] if s.ys else math.nan for s in series]
    finite = [v for v in values if math.isfinite(v)]
    top = max(finite, default=1.0) or 1.0
    positions = list(range(len(series)))[::-1]  # first curve on top
    for pos, s, v in zip(positions, series, values):
        shown = v if math.isfinite(v) else 0.0
        ax.barh(pos, shown, color=colours[s.method], hatch="//" if s.dashed else None,
                edgecolor="white" if s.dashed else None, height=0.75)
        text = (f"{v:.3g}" if math.isfinite(v) else "none") + (f"  {s.note}" if s.note else "")
        ax.text(shown + 0.01 * top, pos, text, va="center", fontsize=7)
    ax.set_yticks(positions, [bar_label(s, dashed_label) for s in series], fontsize=7)
    ax.set_xlim(0.0, top * 1.3)  # room for the value written after the longest bar
    ax.set_xlabel(value_label)
    rounds = {len(s.ys) for s in series}
    ax.set_title("one round: one bar per run" if rounds == {1} else "one point per run", fontsize=9)
