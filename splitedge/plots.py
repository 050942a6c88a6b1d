"""Plots of a run: accuracy and cumulative bytes per round (matplotlib, headless)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def plot_run(history: list[dict[str, Any]], path: Path, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rounds = [h["round"] for h in history]
    acc = [h.get("accuracy", float("nan")) for h in history]  # a method may report no accuracy
    sent = [sum(v["payload"] for v in h["bytes"]["in"].values()) / 1e6 for h in history]
    fig, ax = plt.subplots(1, 2, figsize=(9, 3.5))
    ax[0].plot(rounds, acc, marker="o")
    ax[0].set(xlabel="round", ylabel="test accuracy", title=title or "accuracy")
    ax[1].plot(rounds, sent, marker="o", color="tab:orange")
    ax[1].set(xlabel="round", ylabel="MB received by the cloud (cumulative)", title="uplink into the cloud")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_spectra_per_round(history: list[dict[str, Any]], path: Path, title: str = "") -> Path | None:
    """The representation's singular-value spectrum at every round that reported one (dimensional
    collapse made visible); None when no round did."""
    curves = {f"round {h['round']}": h["spectrum"] for h in history if h.get("spectrum")}
    if not curves:
        return None
    from splitedge.methods.report import plot_spectra

    return plot_spectra(curves, path, title=title or "representation per round")
