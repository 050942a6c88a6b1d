"""How many device `moments` messages one edge checks and merges per CPU-second, against a
plain numpy floor that does the same checks and the same float64 accumulation (issue 58, item 3).

Inputs: `count` device messages (classes x dim, the wire dtype, every class on every device;
methods/moments' bodies as bench/mqtt_load builds them), each encoded and decoded on its own
(so every message has arrays of its own, read-only views of its payload as the transport hands
them over). Timing starts from the decoded bodies: the codec and its schema are not measured.

- `splitedge`: what the H-SFP edge runs per message, HSFPEdge.check's `check_wc_moments`
  (space, dimension, class range, wire dtype, W_c version) and `moments_from_body` (the
  ClassMoments checks: integer classes and counts, unique classes >= 0, counts >= 1, finite
  means and variances, variances >= 0), then the round's merge, `robust_merge(parts, "none")`
  (what HSFPMethod.merge_moments runs with the default `robust`).
- `floor`: the same checks written inline in plain numpy on the body's arrays, then the same
  float64 accumulation (pooled count; mean += mu_k n_k / n; M2 += (n_k - 1) var_k +
  n_k (mu_k - mean)^2; var = M2 / (n - 1)) in preallocated arrays, in place, rows as slices:
  no objects, no copies of the inputs.
- `before` (with --before [COMMIT], default 52b8928): the `splitedge` path with
  methods/moments.py as it was at COMMIT (`git show COMMIT:methods/moments.py`, loaded as a
  module of its own), the merge before issue 58.

Every path's result is checked equal to the floor's, to the bit, before anything is timed.
Each measurement repeats whole merges until `min_cpu` CPU seconds (time.process_time) passed;
the paths take turns in every repetition (in a rotating order), and a ratio is the median
over repetitions of floor rate / path rate taken in the same repetition (a loaded shared box:
a pair measured together shares its load).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import subprocess
import time
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from splitedge.bench.lib.report import pyplot, save_figure, table

BEFORE = "52b8928"
"""main before issue 58: the commit the issue measured."""
WC = "wc"
VERSION = 1  # the W_c version the bodies carry and the edge holds


@dataclass
class MergeSettings:
    counts: tuple[int, ...] = (10, 100, 600)
    dim: int = 8192  # cnn W_c on CIFAR-10
    classes: int = 10
    dtype: str = "f4"
    repeats: int = 7
    min_cpu: float = 1.0  # CPU seconds per measurement
    before: str | None = None  # a commit whose merge is measured too
    seed: int = 0

    @classmethod
    def from_args(cls, a: argparse.Namespace) -> MergeSettings:
        counts = tuple(int(c) for c in a.counts) if a.counts else ((10, 100) if a.quick else (10, 100, 600))
        dim = int(a.dims[0]) if a.dims else 8192
        return cls(counts=counts, dim=dim, repeats=3 if a.quick else 7, min_cpu=0.2 if a.quick else 1.0,
                   before=getattr(a, "before", None), seed=a.seed)


Settings = MergeSettings


# -- inputs -------------------------------------------------------------------------------------

def decoded_bodies(count: int, s: MergeSettings) -> list[Mapping[str, Any]]:
    """`count` device moments bodies, each decoded from its own payload."""
    from splitedge.bench.lib.mqtt_load import moments_payloads
    from splitedge.protocol.codec import decode

    return [decode(payload).body for _, payload in moments_payloads(count, s.dim, s.classes, s.dtype, seed=s.seed)]


# -- the paths ------------------------------------------------------------------------------------

Merged = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]  # classes, counts, mean, var
MergePath = Callable[[Sequence[Mapping[str, Any]]], Merged]


def edge_path(moments: Any, s: MergeSettings) -> MergePath:
    """The edge's checks, moments_from_body and merge from the `moments` module given."""
    from splitedge.methods.hsfp.edge import check_wc_moments

    def merge(bodies: Sequence[Mapping[str, Any]]) -> Merged:
        parts = []
        for body in bodies:
            check_wc_moments(body, s.dim, s.classes, s.dtype, wc=VERSION)
            parts.append(moments.moments_from_body(body))
        m = moments.robust_merge(parts, "none")
        return m.classes, m.counts, m.mean, m.var

    return merge


def floor_path(s: MergeSettings) -> MergePath:
    """Plain numpy: the same checks and the same float64 accumulation, nothing else."""
    wire = np.dtype(s.dtype).newbyteorder("<")
    dim, num_classes = s.dim, s.classes

    def merge(bodies: Sequence[Mapping[str, Any]]) -> Merged:
        held = []
        for b in bodies:
            c, n, mu, v = b["classes"], b["counts"], b["mean"], b["var"]
            cl = c.tolist()
            if (b["space"] != WC or int(b["versions"].get(WC, 0)) > VERSION or c.dtype.kind not in "iu"
                    or n.dtype.kind not in "iu" or c.shape != (len(cl),) or n.shape != c.shape
                    or mu.shape != (len(cl), dim) or v.shape != mu.shape or mu.dtype != wire or v.dtype != wire
                    or len(set(cl)) != len(cl) or (cl and (min(cl) < 0 or max(cl) >= num_classes or n.min() < 1))):
                raise ValueError("malformed moments")
            if not (np.isfinite(mu).all() and np.isfinite(v).all()) or (v < 0).any():
                raise ValueError("non-finite moments or a negative variance")
            held.append((c, n, mu, v))
        classes = np.unique(np.concatenate([h[0] for h in held]))
        rows = []
        for c, *_ in held:
            at = np.searchsorted(classes, c)
            k = len(at)
            consecutive = k and at[-1] - at[0] == k - 1 and (k < 3 or (np.diff(at) == 1).all())
            rows.append(slice(int(at[0]), int(at[0]) + k) if consecutive else at)
        counts = np.zeros(len(classes), np.int64)
        for (_, n, _, _), at in zip(held, rows):
            counts[at] += n
        k_max = max(len(h[0]) for h in held)
        mean, m2 = np.zeros((len(classes), dim)), np.zeros((len(classes), dim))
        t1, t2 = np.empty((k_max, dim)), np.empty((k_max, dim))
        for (c, n, mu, _), at in zip(held, rows):
            term = np.multiply(mu, (n / counts[at])[:, None], out=t1[:len(c)])
            if isinstance(at, slice):
                np.add(mean[at], term, out=mean[at])
            else:
                mean[at] += term
        for (c, n, mu, v), at in zip(held, rows):
            nf = n.astype(np.float64)[:, None]
            a = np.multiply(v, nf - 1.0, out=t1[:len(c)])
            b = np.subtract(mu, mean[at], out=t2[:len(c)])
            np.square(b, out=b)
            np.multiply(b, nf, out=b)
            np.add(a, b, out=a)
            if isinstance(at, slice):
                np.add(m2[at], a, out=m2[at])
            else:
                m2[at] += a
        np.maximum(m2, 0.0, out=m2)
        np.divide(m2, np.maximum(counts - 1, 1)[:, None].astype(np.float64), out=m2)
        m2[counts <= 1] = 0.0
        return classes, counts, mean, m2

    return merge


def module_at(commit: str) -> types.ModuleType:
    """methods/moments.py as it was at `commit`, as a module of its own (splitedge's other
    modules stay this checkout's)."""
    root = Path(__file__).resolve().parents[1]
    try:
        text = subprocess.run(["git", "-C", str(root), "show", f"{commit}:methods/moments.py"], check=True,
                              capture_output=True, text=True).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        raise ValueError(f"--before {commit}: cannot read methods/moments.py at that commit ({detail})") from exc
    module = types.ModuleType(f"splitedge_moments_{commit}")
    module.__file__ = f"{commit}:methods/moments.py"
    exec(compile(text, module.__file__, "exec"), module.__dict__)  # noqa: S102 - this repository's own history
    return module


# -- measuring ----------------------------------------------------------------------------------

def measure(merge: MergePath, bodies: Sequence[Mapping[str, Any]], min_cpu: float) -> dict[str, float]:
    """Whole merges repeated until min_cpu CPU seconds: messages per CPU-second (and per wall second)."""
    runs, cpu0, wall0 = 0, time.process_time(), time.perf_counter()
    while True:
        merge(bodies)
        runs += 1
        cpu = time.process_time() - cpu0
        if cpu >= min_cpu:
            break
    wall = time.perf_counter() - wall0
    return {"runs": runs, "cpu_s": cpu, "wall_s": wall, "per_cpu_s": len(bodies) * runs / cpu,
            "per_wall_s": len(bodies) * runs / wall}


def same(a: Merged, b: Merged) -> bool:
    return all(np.array_equal(x, y) and x.dtype == y.dtype for x, y in zip(a, b))


def run(s: MergeSettings) -> tuple[dict[str, Any], dict[str, Any]]:
    from splitedge.methods import moments

    paths: dict[str, MergePath] = {"floor": floor_path(s), "splitedge": edge_path(moments, s)}
    if s.before:
        paths["before"] = edge_path(module_at(s.before), s)
    names = list(paths)
    rows = []
    for count in s.counts:
        bodies = decoded_bodies(count, s)
        reference = paths["floor"](bodies)
        identical = {name: same(paths[name](bodies), reference) for name in names if name != "floor"}
        if not all(identical.values()):
            raise AssertionError(f"{count} messages: results differ from the floor's: {identical}")
        runs: dict[str, list[dict[str, float]]] = {name: [] for name in names}
        for rep in range(s.repeats):
            order = names[rep % len(names):] + names[:rep % len(names)]
            for name in order:
                runs[name].append(measure(paths[name], bodies, s.min_cpu))
        del bodies
        row = {"messages": count, "identical": identical, "runs": runs,
               "per_cpu_s": {n: statistics.median(r["per_cpu_s"] for r in runs[n]) for n in names},
               "ratio": {n: statistics.median(f["per_cpu_s"] / r["per_cpu_s"] for f, r in zip(runs["floor"], runs[n]))
                         for n in names if n != "floor"}}
        rows.append(row)
        print(f"bench merge: {count} messages: " + ", ".join(
            f"{n} {row['per_cpu_s'][n]:.0f}/CPU-s" + (f" ({row['ratio'][n]:.2f}x the floor)" if n != "floor" else "")
            for n in names), flush=True)
    return dataclasses.asdict(s), {"rows": rows, "paths": names}


# -- reporting ----------------------------------------------------------------------------------

def markdown(results: dict[str, Any]) -> str:
    names = results["paths"]
    shown = [n for n in ("splitedge", "before") if n in names]
    headers = ["messages", "floor msg/CPU-s"]
    for n in shown:
        headers += [f"{n} msg/CPU-s", f"{n} / floor (CPU)"]
    headers.append("same result as the floor")
    rows = []
    for r in results["rows"]:
        cells: list[Any] = [r["messages"], round(r["per_cpu_s"]["floor"])]
        for n in shown:
            cells += [round(r["per_cpu_s"][n]), f"{r['ratio'][n]:.2f}x"]
        cells.append(", ".join(f"{n}: {'bit for bit' if ok else 'NO'}" for n, ok in r["identical"].items()))
        rows.append(cells)
    spread = [(r["messages"], n, min(x["per_cpu_s"] for x in r["runs"][n]), max(x["per_cpu_s"] for x in r["runs"][n]))
              for r in results["rows"] for n in names]
    return "\n".join([
        "Messages checked and merged per CPU-second by one edge, from decoded bodies (medians over the "
        "repetitions; a ratio is the median of floor rate / path rate measured in the same repetition, "
        "so 1.00x is at the floor). `splitedge` is the edge's checks, `moments_from_body` and "
        "`robust_merge(parts, \"none\")`; `floor` the same checks and float64 accumulation in plain numpy; "
        "`before` the splitedge path with methods/moments.py of the commit given to --before.",
        "",
        table(headers, rows),
        "",
        "Spread over the repetitions (messages per CPU-second):",
        "",
        table(["messages", "path", "lowest", "highest"], [(m, n, round(lo), round(hi)) for m, n, lo, hi in spread]),
    ])


def plot(results: dict[str, Any], out_dir: Path) -> list[Path]:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    counts = [r["messages"] for r in results["rows"]]
    for n in results["paths"]:
        ax.plot(counts, [r["per_cpu_s"][n] for r in results["rows"]], marker="o", label=n)
    ax.set_xscale("log")
    ax.set_xlabel("messages per merge")
    ax.set_ylabel("messages per CPU-second")
    ax.set_ylim(bottom=0)
    ax.legend()
    return save_figure(fig, out_dir / "merge.png")
