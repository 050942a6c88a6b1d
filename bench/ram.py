"""Peak RSS of each role as its own OS process, during real rounds.

Per method (``--methods``, default H-SFP) and device backend (torch; onnx when
``methods.thin.graphs`` imports and the method has a thin device part), a private Mosquitto,
one ``splitedge cloud``, one ``splitedge edge`` and one ``splitedge device`` reading an .npz
shard run a few rounds while :class:`bench.lib.procmem.PeakSampler` watches every pid. The goals
come from the issues: with CIFAR-10 W_c and 5,000 local images a thin (onnx) device that only
sends statistics (`--set local_epochs=0`) stays within 80 MB, a thin device that trains its W_c
(the default) within 100 MB, and a torch device within 300 MB.

The device runs with the environment its systemd unit sets (``Environment=`` in
deploy/splitedge-device.service, e.g. MALLOC_ARENA_MAX=2), and optionally under another
interpreter (``--device-python``, e.g. a venv with the CPU-only torch wheel a Pi uses) running
this same checkout.
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from splitedge.bench.lib.procmem import PeakSampler, REPO, spawn_splitedge, wait_all
from splitedge.bench.lib.report import pyplot, table, save_figure
from splitedge.methods.hsfp.device import WC_IN_USE

log = logging.getLogger(__name__)

MB = 1024 * 1024
GOALS_MB = {"onnx": 80, "onnx-trainer": 100, "torch": 300}  # device only; defined for cifar10 with 5,000 images
GOAL_DATASET, GOAL_IMAGES = "cifar10", 5000
DEVICE_UNIT = REPO / "deploy" / "splitedge-device.service"
# The unit's environment, for installs without the repo's deploy/ folder (a wheel); a test keeps
# the two equal.
DEVICE_UNIT_ENV = {"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "MALLOC_ARENA_MAX": "2"}


def device_environment() -> tuple[dict[str, str], str]:
    """The device's environment and where it came from: deploy/'s unit in a checkout, else the
    copy above."""
    if DEVICE_UNIT.is_file():
        return unit_environment(DEVICE_UNIT), str(DEVICE_UNIT.relative_to(REPO))
    return dict(DEVICE_UNIT_ENV), "bench.ram.DEVICE_UNIT_ENV (deploy/ is not installed)"


def unit_environment(unit: Path = DEVICE_UNIT) -> dict[str, str]:
    """The variables a systemd unit's ``Environment=`` lines set (not its EnvironmentFile)."""
    env: dict[str, str] = {}
    for line in unit.read_text().splitlines():
        if line.startswith("Environment="):
            for item in shlex.split(line[len("Environment="):]):
                key, _, value = item.partition("=")
                env[key] = value
    return env


def interpreter_info(python: str) -> dict[str, str | None]:
    """Path, Python and torch version of the interpreter the device runs under (torch None when absent)."""
    probe = ("import sys, importlib.metadata as m\ntry:\n t = m.version('torch')\nexcept m.PackageNotFoundError:\n"
             " t = None\nprint(sys.version.split()[0]); print(t)")
    out = subprocess.run([python, "-c", probe], capture_output=True, text=True, check=True).stdout.split()
    return {"path": python, "python": out[0], "torch": None if out[1] == "None" else out[1]}


@dataclass
class RamSettings:
    dataset: str = "digits"
    data: str | None = None
    model: str | None = None
    images: int = 1000
    rounds: int = 2
    backends: tuple[str, ...] = ("torch", "onnx")
    max_test: int | None = 500
    seed: int = 0
    timeout_s: float = 600.0
    interval_s: float = 0.05
    device_python: str | None = None  # interpreter for the device process (default: this one)
    device_mem_cap_mb: float | None = None  # run the device in a memory cgroup of this size (bench/memcap.py)
    train_chunk: int | None = None  # the thin device's --train-chunk (None: its default)
    # H-SFP's slow scale inside the measured rounds: with ic=1 every round after the first brings
    # a new averaged W_c, so the device's swap (onnx) or reload (torch) and its recomputed
    # moments are part of what is measured, not only the first round's moments.
    ic: int = 1
    settings: tuple[str, ...] = ()  # more method settings, KEY=VALUE, passed to the cloud's --set
    methods: tuple[str, ...] = ("hsfp",)  # each measured on every backend it has a device part for

    @property
    def device_trains(self) -> bool:
        """Whether the measured device trains W_c: unless the settings say local_epochs=0."""
        return dict(kv.split("=", 1) for kv in self.settings if "=" in kv).get("local_epochs", "1").strip() != "0"

    @classmethod
    def from_args(cls, a: argparse.Namespace) -> RamSettings:
        images = a.images or (300 if a.quick else (GOAL_IMAGES if a.dataset == GOAL_DATASET else 1000))
        return cls(dataset=a.dataset, data=a.data, model=a.model, images=images,
                   rounds=a.rounds or (1 if a.quick else 2), backends=tuple(a.backends),
                   max_test=a.max_test or (200 if a.quick else 500), seed=a.seed,
                   timeout_s=300.0 if a.quick else 900.0,
                   device_python=os.path.abspath(a.device_python) if a.device_python else None,
                   device_mem_cap_mb=getattr(a, "device_mem_cap", None), train_chunk=getattr(a, "train_chunk", None),
                   settings=tuple(getattr(a, "set", None) or ()),
                   methods=known_methods(tuple(getattr(a, "methods", None) or ()) or ("hsfp",)))


def known_methods(methods: tuple[str, ...]) -> tuple[str, ...]:
    """`methods`, each a registered one (ValueError naming the choices, before any work)."""
    from splitedge.methods.registry import get_method

    for m in methods:
        get_method(m)
    return methods


def runs_on(method: str, backend: str) -> bool:
    """Whether `method` has a device part for `backend` (a thin device leaves a torch-only run)."""
    from splitedge.methods.registry import get_method

    backends = get_method(method).device_backends()
    return backends is None or backend in backends


def takes_setting(method: str, name: str) -> bool:
    """Whether `method`'s config has the setting `name` (H-SFP's --ic is not FedAvg's)."""
    import dataclasses

    from splitedge.methods.registry import get_method

    return name in {f.name for f in dataclasses.fields(get_method(method).Config)}


def onnx_available() -> bool:
    """The thin backend exists in this checkout (a separate interpreter, so this one stays clean)."""
    probe = subprocess.run([sys.executable, "-c", "import splitedge.methods.thin.graphs"], capture_output=True)
    return probe.returncode == 0


def write_shard(s: RamSettings, path: Path) -> int:
    """The device's local data: the first ``images`` training images (fewer if the set is smaller)."""
    from splitedge.methods.data.datasets import load_dataset, save_shard

    (x, y), _, _ = load_dataset(s.dataset, s.data, seed=s.seed)
    n = min(s.images, len(y))
    save_shard(path, x[:n], y[:n])
    return n


def measure_backend(s: RamSettings, backend: str, shard: Path, tmp: Path,
                    device_env: dict[str, str] | None = None, method: str = "hsfp") -> dict[str, Any]:
    """One federation of `method` (cloud, edge, device) on its own broker; peaks per role. The
    device runs under ``s.device_python`` with ``device_env`` added to its environment."""
    from splitedge.protocol.broker import MosquittoBroker

    from splitedge.bench.memcap import MemoryCap

    run_id = f"bench-ram-{method}-{backend}"
    tmp = tmp / method
    tmp.mkdir(exist_ok=True)
    cap = MemoryCap(s.device_mem_cap_mb) if s.device_mem_cap_mb else None
    common = ["--run", run_id]
    data = ["--dataset", s.dataset] + (["--data", s.data] if s.data else []) + (["--model", s.model] if s.model else [])
    with MosquittoBroker(sys_interval=10) as broker:
        url = ["--broker", broker.url]
        sampler = PeakSampler(s.interval_s)
        if broker.pid:
            sampler.watch("broker", broker.pid)
        # With local_epochs=0 a thin device does not train, so in a federation of thin devices alone W_c
        # would never change; a torch peer on the same edge provides the W_c updates whose averages the
        # thin one swaps in (kept when it trains too, so both rows measure the same federation).
        peer = backend != "torch"
        procs = {"cloud": spawn_splitedge(["cloud", *url, *common, "--edges", "1", "--devices", str(1 + peer),
                                           "--rounds",
                                           str(s.rounds), "--max-test", str(s.max_test), "--join-timeout", "300",
                                           "--method", method,
                                           *(["--ic", str(s.ic)] if takes_setting(method, "ic") else []), *data,
                                           *(arg for kv in s.settings for arg in ("--set", kv))],
                                          tmp / f"{backend}-cloud.log")}
        procs["edge"] = spawn_splitedge(["edge", *url, *common, "--id", "e0"], tmp / f"{backend}-edge.log")
        chunk = [] if s.train_chunk is None or backend == "torch" else ["--train-chunk", str(s.train_chunk)]
        procs["device"] = spawn_splitedge(["-v", "device", *url, *common, "--id", "d0", "--edge", "e0",
                                           "--data", str(shard), "--backend", backend, *chunk],
                                          tmp / f"{backend}-device.log",
                                          python=s.device_python, env=device_env,
                                          preexec=cap.join if cap is not None else None)
        if peer:
            procs["torch peer"] = spawn_splitedge(["device", *url, *common, "--id", "d1", "--edge", "e0", "--data",
                                                   str(shard), "--backend", "torch"], tmp / f"{backend}-peer.log")
        for name, proc in procs.items():
            sampler.watch(name, proc.pid)
        sampler.start()
        codes = wait_all(procs, "cloud", s.timeout_s)
        peaks = sampler.stop()
    rows = []
    for role, peak in peaks.items():
        rss, hwm, uss = peak["peak_rss_bytes"], peak["vm_hwm_bytes"], peak["peak_uss_bytes"]
        row = {"role": role, "backend": backend, "peak_rss_mb": rss / MB, "vm_hwm_mb": hwm / MB if hwm else None,
               "peak_uss_mb": uss / MB if uss else None,
               "peak_mb": max(rss, hwm or 0) / MB, "samples": peak["samples"], "exit_code": codes.get(role),
               "cpu_s": peak.get("cpu_s"), "cpu_s_per_round": (peak["cpu_s"] / s.rounds) if peak.get("cpu_s") else None,
               "trains": s.device_trains if role == "device" else None}
        row.update(goal(role, backend, row["peak_mb"], s))
        rows.append(row)
    device_log = (tmp / f"{backend}-device.log").read_text(errors="replace")
    result = {"method": method, "backend": backend, "rows": rows, "completed": codes.get("cloud") == 0,
              "device_wc_versions_used": device_log.count(WC_IN_USE)}
    if cap is not None:
        result["device_mem_cap"] = {"limit_mb": s.device_mem_cap_mb, "events": cap.events(),
                                    "device_exit": codes.get("device")}
        cap.close()
    if not result["completed"]:  # keep the evidence: the temp folder goes away
        result["log_tails"] = {role: (tmp / f"{backend}-{role.replace('torch ', '')}.log").read_text(
            errors="replace")[-1500:] for role in procs}
        for role, tail in result["log_tails"].items():
            if codes.get(role):
                log.warning("ram: %s %s exited %s; its log ends:\n%s", backend, role, codes[role], tail[-600:])
        log.warning("ram: %s run did not complete (exit codes %s)", backend, codes)
    return result


def goal(role: str, backend: str, peak_mb: float, s: RamSettings) -> dict[str, Any]:
    """The issue's goal for a device; ``goal_applies`` only for CIFAR-10 with >= 5,000 images."""
    key = "onnx-trainer" if backend == "onnx" and s.device_trains else backend
    if role != "device" or key not in GOALS_MB:
        return {"goal_mb": None, "goal_applies": False, "within_goal": None}
    applies = s.dataset == GOAL_DATASET and s.images >= GOAL_IMAGES
    return {"goal_mb": GOALS_MB[key], "goal_applies": applies, "within_goal": peak_mb <= GOALS_MB[key]}


def run(s: RamSettings) -> tuple[dict[str, Any], dict[str, Any]]:
    if s.device_mem_cap_mb:  # a cap that cannot be set says so before any work starts
        from splitedge.bench.memcap import MemoryCap

        MemoryCap(s.device_mem_cap_mb).close()
    skipped: dict[str, str] = {}
    backends = list(s.backends)
    if "onnx" in backends and not onnx_available():
        backends.remove("onnx")
        skipped["onnx"] = "methods.thin.graphs does not import in this checkout"
    device_env, env_source = device_environment()
    device = {**interpreter_info(s.device_python or sys.executable), "env": device_env, "env_source": env_source}
    runs = []
    with tempfile.TemporaryDirectory(prefix="bench-ram-") as tmp_name:
        tmp = Path(tmp_name)
        images = write_shard(s, tmp / "shard.npz")
        for method in s.methods:
            for backend in backends:
                if not runs_on(method, backend):
                    skipped[f"{method} on {backend}"] = f"{method} has no device part for the {backend} backend"
                    continue
                log.info("ram: %s, %s device, %d images, %s (torch %s)", method, backend, images, device["path"],
                         device["torch"])
                runs.append(measure_backend(s, backend, tmp / "shard.npz", tmp, device_env, method))
    config = {**vars(s), "backends": list(s.backends), "methods": list(s.methods), "images_written": images,
              "device": device}
    return config, {"runs": runs, "skipped": skipped, "goals_mb": GOALS_MB, "device": device,
                    "goal_condition": f"{GOAL_DATASET} W_c with {GOAL_IMAGES} local images",
                    "schedule": f"{s.rounds} rounds of {', '.join(s.methods)}"
                                + (f"; H-SFP's W_c averaged every {s.ic} (the device loads each new W_c and "
                                   "recomputes its moments within the measured rounds)"
                                   if any(takes_setting(m, "ic") for m in s.methods) else "")
                                + (f", settings {' '.join(s.settings)}" if s.settings else "")}


def markdown(results: dict[str, Any]) -> str:
    rows = [(run_.get("method", "hsfp"), r["backend"], r["role"], {True: "yes", False: "no"}.get(r.get("trains")), r["peak_rss_mb"],
             r["vm_hwm_mb"], r["peak_uss_mb"], r.get("cpu_s_per_round"), r["goal_mb"],
             ("yes" if r["within_goal"] else "NO") if r["goal_mb"] else None,
             "yes" if r["goal_applies"] else ("no" if r["goal_mb"] else None), r["exit_code"])
            for run_ in results["runs"] for r in run_["rows"]]
    out = ["## Peak memory per role (MB; psutil RSS every 50 ms, the kernel's VmHWM, USS every ~0.5 s)\n",
           table(["method", "device backend", "role", "trains W_c", "peak RSS MB", "VmHWM MB", "peak USS MB",
                  "CPU s / round", "goal MB", "within goal", "goal applies", "exit"], rows),
           "\nCPU s / round: the process's CPU seconds (start-up and imports included) over the rounds run.",
           f"\nGoals (checked against max(peak RSS, VmHWM)) hold for {results['goal_condition']}; on other "
           "settings they are shown for reference. RSS includes shared library pages; USS is this process only."]
    if results.get("schedule"):
        out.append(f"\nMeasured over {results['schedule']}.")
        out += [f"- {r.get('method', 'hsfp')}, {r['backend']} device: {r.get('device_wc_versions_used', 0)} new "
                "global W_c put in use" for r in results["runs"] if takes_setting(r.get("method", "hsfp"), "ic")]
    for r in results["runs"]:
        if r.get("device_mem_cap"):
            c = r["device_mem_cap"]
            out.append(f"- {r['backend']} device under a hard memory cap of {c['limit_mb']:g} MB (a memory cgroup): "
                       f"exit {c['device_exit']}, run completed: {'yes' if r['completed'] else 'NO'}, cap events {c['events']}")
    device = results.get("device")
    if device:
        env = " ".join(f"{k}={v}" for k, v in device["env"].items()) or "(none)"
        out += [f"\nDevice process: `{device['path']}` (Python {device['python']}, torch {device['torch'] or 'not installed'})"
                f", environment from {device['env_source']}: `{env}`; cloud and edge run under the bench's own "
                "interpreter with OMP_NUM_THREADS=1."]
    out += [f"- {b} skipped: {why}" for b, why in results["skipped"].items()]
    return "\n".join(out)


def plot(results: dict[str, Any], out_dir: Path) -> list[Path]:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    labels, values = [], []
    many = len({x.get("method") for x in results["runs"]}) > 1
    for run_ in results["runs"]:
        for r in run_["rows"]:
            labels.append(f"{r['role']}\n({run_.get('method', 'hsfp') + ', ' if many else ''}{r['backend']})")
            values.append(r["peak_mb"])
    ax.bar(range(len(values)), values)
    ax.set_xticks(range(len(values)), labels, fontsize=7)
    ax.set_ylabel("peak RSS (MB)")
    return save_figure(fig, out_dir / "ram.png")


Settings = RamSettings
