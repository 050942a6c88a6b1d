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
