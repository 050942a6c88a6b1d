"""What representations the methods learn: the accuracy suite's federations, reported with the
representation measures (linear probe, kNN, alignment, uniformity, effective rank) and the
normalised singular-value spectrum of each row's final representation (one curve per row).

Defaults cover the FedDecorr study (FedAvg-CE, SimSiam and align-uniform, each with and
without FedDecorr, IID and Dirichlet 0.3 / 0.05); `--methods align-uniform --variant
ssd-dsr=ssd:pd=false --variant ssd=ssd --alphas 0.1` is the SSD ablation.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from splitedge.bench import accuracy
from splitedge.bench.lib.plotstyle import Series, lines, new_figure
from splitedge.bench.lib.report import Progress, save_figure, table
from splitedge.bench.lib.simrun import REPRESENTATION_KEYS

DEFAULT_METHODS = ("fedavg", "simsiam", "align-uniform")
DEFAULT_VARIANTS = tuple(f"{m}+decorr={m}:feddecorr_beta=0.1" for m in DEFAULT_METHODS)
MEASURES = ("probe_accuracy", "knn_accuracy", "alignment", "uniformity", "effective_rank")


@dataclass
class SSLSettings(accuracy.AccuracySettings):
    @classmethod
    def from_args(cls, a: argparse.Namespace) -> "SSLSettings":
        if not a.methods:
            a.methods = DEFAULT_METHODS
            a.variant = [*DEFAULT_VARIANTS, *(a.variant or [])]
        a.alphas = a.alphas or "iid,0.3,0.05"
        base = accuracy.AccuracySettings.from_args(a)
        return cls(**vars(base))


def run(s: SSLSettings, progress: Progress | None = None,
        previous: dict[str, Any] | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """The accuracy suite's runs, each row with its final representation measures."""
    return accuracy.run_summarised(s, summarise, progress, previous)


def summarise(results: dict[str, Any]) -> None:
    """Each row's last reported representation measures, as `representation`."""
    for row in results["runs"]:
        reported = [r for r in row.get("per_round", []) if "spectrum" in r or "probe_accuracy" in r]
        last = reported[-1] if reported else (row.get("per_round") or [{}])[-1]
        row["representation"] = {k: last[k] for k in REPRESENTATION_KEYS if k in last}


def _cell(value: Any) -> Any:
    return "-" if value is None or value != value else round(float(value), 4)


def markdown(results: dict[str, Any]) -> str:
    ok = [r for r in results["runs"] if "error" not in r]
    rows = [(r["method"], r["split"], _cell(r["final_accuracy"]),
             *(_cell(r.get("representation", {}).get(k)) for k in MEASURES),
             round(r["device_payload_per_device_per_round"])) for r in ok]
    out = ["## Representation per method and split\n",
           table(["method", "split", "accuracy", "linear probe", "kNN", "alignment", "uniformity", "eff. rank",
                  "device B/device/round (up+down)"], rows),
           "",
           "accuracy: the global model on the test split for supervised rows (FedAvg), the linear probe for "
           "self-supervised ones. Linear probe and kNN (k=20, cosine, temperature 0.1) are fitted on one half of "
           "the test split and scored on the other; alignment (two augmented views), uniformity (t=2) and "
           "effective rank on the whole split, of the final global encoder (FedAvg: its penultimate features). "
           "Spectra: spectrum.png."]
    out += drops(ok)
    out += [f"- {r['method']}: settings {r['overrides']}" for r in ok if r.get("overrides") and r["split"] == ok[0]["split"]]
    out += [f"- {r['method']} / {r['split']} failed: {r['error']}" for r in results["runs"] if "error" in r]
    return "\n".join(out)


def drops(rows: list[dict[str, Any]]) -> list[str]:
    """A table of each method's accuracy drop from IID to each non-IID split (how robust it is
    to heterogeneity), when the run has an IID row for it."""
    iid = {r["method"]: r["final_accuracy"] for r in rows if r["split"] == "IID"}
    cells = [(r["method"], r["split"], _cell(iid[r["method"]] - r["final_accuracy"])) for r in rows
             if r["split"] != "IID" and r["method"] in iid and r["final_accuracy"] is not None]
    if not cells:
        return []
    return ["", "## Drop from IID\n", table(["method", "split", "accuracy IID - accuracy split"], cells)]


def spectrum_figure(results: dict[str, Any]) -> Any | None:
    """Each row's final normalised singular values, log y, coloured by method as in every bench
    plot (bench/lib/plotstyle.py), marker by split; None when no row has a spectrum. Values below
    FLOOR are left out (a log axis cannot show zeros; see plot_spectra)."""
    from splitedge.methods.metrics.report import FLOOR

    curves = [Series(r["method"], [v if v >= FLOOR else None for v in r["representation"]["spectrum"]],
                     split=r["split"]) for r in results["runs"]
              if "error" not in r and r.get("representation", {}).get("spectrum")]
    if not curves:
        return None
    fig = new_figure([])
    ax = fig.axes[0]
    lines(ax, curves, dashed_label="")
    ax.set(yscale="log", xlabel="index of the singular value (1-based)", ylabel="normalised singular values (sorted)",
           title="final representation")
    return fig


def plot(results: dict[str, Any], out_dir: Path) -> list[Path]:
    paths = accuracy.plot(results, out_dir)
    fig = spectrum_figure(results)
    if fig is not None:
        paths += save_figure(fig, out_dir / "spectrum.png")
    return paths


Settings = SSLSettings
refresh = accuracy.refresh
