"""What one hostile device does to a federation, and what each robust rule keeps of it.

Per robust rule (the run's `robust` setting, docs/methods.md "Robust merging") and seed, the
same federation twice on a fresh Mosquitto: clean, and with one extra device of edge e0 running
`--attack` (bench/lib/rogues.py). Reports final and best accuracy of both, the drop, and what the
receivers refused; the clean column is the rule's cost on clean data.

Attacks (bench/lib/rogues.py): `scale-weights`, a device sending 100x the global model as its
update, every value inside the absolute bound (the reliability issue's row: FedAvg on digits fell
from 97.5 to 66.4 % and froze); `scale-moments`, an H-SFP device sending the moments of its own
images through the relayed W_c with every class mean 100x (the trust issue's row: `hsfp` on
digits fell from 82.5 to 9.7 %).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from splitedge.bench.lib.plotstyle import Series, draw, new_figure
from splitedge.bench.lib.report import Progress, save_figure, table
from splitedge.bench.lib.rogues import ATTACKS
from splitedge.bench.lib.simrun import FederationSettings, parse_sets, run_on_mosquitto
from splitedge.methods.moments import ROBUST_MERGES


@dataclass
class PoisonSettings(FederationSettings):
    method: str = "fedavg"
    attack: str = "scale-weights"
    rules: tuple[str, ...] = ROBUST_MERGES
    seeds: tuple[int, ...] = (0, 1)
    alpha: float | None = None
    deadline_s: float = 60.0
    settings: dict[str, str] = field(default_factory=dict)  # method settings every row shares (--set)

    @classmethod
    def from_args(cls, a: argparse.Namespace) -> PoisonSettings:
        rules = tuple(a.rules) or ROBUST_MERGES
        unknown = [r for r in rules if r not in ROBUST_MERGES]
        if unknown:
            raise ValueError(f"--rules: {unknown} are not robust rules; pick from {', '.join(ROBUST_MERGES)}")
        attack = a.attack or "scale-weights"
        if attack not in ATTACKS:
            raise ValueError(f"--attack {attack!r}: pick one of {', '.join(ATTACKS)}")
        sets = parse_sets(a.set)
        seeds = tuple(int(v) for v in a.seeds) or (a.seed, a.seed + 1)
        return cls(method=(a.methods or ("fedavg",))[0], attack=attack, rules=rules, seeds=seeds,
                   dataset=a.dataset, data=a.data, model=a.model, devices=a.devices or 8, edges=a.edges or 2,
                   rounds=a.rounds or (3 if a.quick else 6), max_train=a.max_train, max_test=a.max_test or 300,
                   alpha=a.alpha, settings=sets, deadline_s=a.deadline or 60.0)


def one_run(s: PoisonSettings, rule: str, seed: int, attacked: bool) -> dict[str, Any]:
    """One federation under `rule`, with the attacker or without; its accuracy and refusals."""
    import dataclasses

    run = f"poison-{rule}-s{seed}-{'attacked' if attacked else 'clean'}"
    sim = dataclasses.replace(s, seed=seed).sim(s.method, s.alpha, run=run, overrides={**s.settings, "robust": rule})
    sim = dataclasses.replace(sim, deadline_s=s.deadline_s)
    peers: list[Any] = []

    def attach(url: str, run_id: str) -> Any:
        peers.append(ATTACKS[s.attack](url, run_id))
        return peers[-1]

    res = run_on_mosquitto(sim, check_sys=False, attach=attach if attacked else None)
    last = res["per_round"][-1] if res["per_round"] else {}
    refused: dict[str, int] = {}
    for by_rule in (last.get("rejected") or {}).values():
        for name, n in by_rule.items():
            refused[name] = refused.get(name, 0) + int(n)
    summary = res["summary"]
    return {"rule": rule, "seed": seed, "attacked": attacked, "final_accuracy": summary["final_accuracy"],
            "served_accuracy": summary.get("served_accuracy", summary["final_accuracy"]),
            "served_head": summary.get("served_head", "own"),
            "best_accuracy": summary["best_accuracy"], "accuracy_per_round": summary["accuracy_per_round"],
            "refused": refused, "refused_by_node": last.get("rejected") or {},
            "attacker_messages": peers[0].sent if peers else 0}


def run(s: PoisonSettings, progress: Progress | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    config = {"method": s.method, "attack": s.attack, "rules": list(s.rules), "seeds": list(s.seeds),
              "dataset": s.dataset, "model": s.model, "devices": s.devices, "edges": s.edges, "rounds": s.rounds,
              "alpha": s.alpha, "max_train": s.max_train, "max_test": s.max_test, "settings": s.settings}
    results: dict[str, Any] = {"runs": []}
    for seed in s.seeds:
        for rule in s.rules:
            for attacked in (False, True):
                results["runs"].append(one_run(s, rule, seed, attacked))
                if progress is not None:
                    progress(config, results)
    return config, results


def _pct(v: Any) -> str:
    return "-" if v is None else f"{100 * float(v):.1f} %"


def markdown(results: dict[str, Any]) -> str:
    runs = results["runs"]
    seeds = sorted({r["seed"] for r in runs})
    rows = []
    for rule in dict.fromkeys(r["rule"] for r in runs):
        def cell(attacked: bool, key: str = "served_accuracy") -> list[Any]:
            return [next((r.get(key, r["final_accuracy"]) for r in runs
                          if r["rule"] == rule and r["seed"] == sd and r["attacked"] == attacked), None) for sd in seeds]
        clean, hit = cell(False), cell(True)
        pairs = [(c, h) for c, h in zip(clean, hit) if c is not None and h is not None]
        drop = sum(c - h for c, h in pairs) / len(pairs) if pairs else None
        refused = [r["refused"] for r in runs if r["rule"] == rule and r["attacked"]]
        rows.append((f"`{rule}`", " / ".join(_pct(v) for v in clean), " / ".join(_pct(v) for v in hit),
                     "-" if drop is None else f"{100 * drop:.1f}",
                     "; ".join(", ".join(f"{k} {v}" for k, v in sorted(x.items())) or "none" for x in refused)))
    seeds_text = " / ".join(str(sd) for sd in seeds)
    heads = sorted({r.get("served_head", "own") for r in runs})
    return "\n".join([
        f"## Final accuracy of the served model ({' or '.join(heads)} head), clean and with the attacker "
        f"(seeds {seeds_text})\n",
        table(["robust", "clean", "attacked", "drop (points, mean)", "refused in the attacked run (per seed)"], rows),
        "",
        "clean: the rule's cost on clean data (compare with `none`). drop: clean minus attacked, mean over seeds "
        "(positive: the attack cost that much). refused: messages the receivers refused by rule, summed over nodes.",
        "", "## Per round (the model's own head)\n",
        table(["robust", "seed", "run", *[f"r{i + 1}" for i in range(max(len(r["accuracy_per_round"]) for r in runs))]],
              [(r["rule"], r["seed"], "attacked" if r["attacked"] else "clean",
                *[_pct(a) for a in r["accuracy_per_round"]]) for r in runs]),
    ])


def plot(results: dict[str, Any], out_dir: Path) -> list[Path]:
    curves = [Series(f"{r['rule']} {'attacked' if r['attacked'] else 'clean'}", r["accuracy_per_round"],
                     split=f"seed {r['seed']}") for r in results["runs"]]
    fig = new_figure(curves)
    draw(fig.axes[0], curves, xlabel="round", ylabel="test accuracy")
    return save_figure(fig, out_dir / "poison.png")


Settings = PoisonSettings
