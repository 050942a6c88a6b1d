"""Where a training device's memory goes: RSS after each stage of its start and its training.

`splitedge bench device-memory` runs, per backend, one fresh interpreter (``--device-python``
for the torch device, e.g. a venv with the CPU-only wheel) that records its RSS after: the bare
interpreter; numpy, msgpack and paho-mqtt; the engine (torch, or the numpy layers of
methods/thin for the thin device); splitedge's device modules; the H-SFP device part with its models; the local data
(``--images`` uint8 images of the data set); then its peak (VmHWM) after one local epoch of the
device's real training code (``HSFPTorchDevice.train_epoch`` / the thin trainer's). Each
stage's increment is what it costs; the environment is the device unit's (MALLOC_ARENA_MAX=2).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from splitedge.bench.ram import device_environment, interpreter_info, write_shard, RamSettings
from splitedge.bench.lib.report import pyplot, save_figure, table

PROBE = r"""
import json, sys, time
def rss():
    status = open("/proc/self/status").read()
    return {k: int(status.split(k + ":")[1].split()[0]) / 1024 for k in ("VmRSS", "VmHWM")}
stages = [("interpreter", rss())]
backend, shard, model, batch, chunk = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
import numpy as np, msgpack, paho.mqtt.client
stages.append(("numpy, msgpack, paho-mqtt", rss()))
if backend == "torch":
    import torch
    torch.set_num_threads(1)
else:
    import splitedge.methods.thin.graphs
stages.append(("engine (torch)" if backend == "torch" else "engine (numpy layers)", rss()))
import splitedge.device.agent
from splitedge.methods.registry import create_method
from splitedge.methods.contract import DeviceContext
from splitedge.methods.data.local import open_local_data
stages.append(("splitedge device modules", rss()))
x, y = open_local_data(shard, stream=backend != "torch")  # the thin device streams its shard
stages.append(("local data (uint8 in memory)" if backend == "torch" else "local data (streamed from the shard)", rss()))
c = x.shape[-1]
config = {"model": {"model": model, "num_classes": 10, "channels": int(c), "image_size": int(x.shape[1]),
                    "mean": [0.5] * c, "std": [0.25] * c}, "method": {"device_batch": batch}}
method = create_method("hsfp", config)
rng = np.random.default_rng(0)
ctx = DeviceContext("d0", method, rng, **({} if chunk == "default" else {"train_chunk": int(chunk)}))
dev = method.device_part(ctx, (x, y), backend=backend)
stages.append(("H-SFP device part and its models", rss()))
start = time.process_time()
if backend == "torch":
    dev.train_epoch()
else:
    trainer = dev.trainer
    trainer.load({**trainer.weights(), **{k: (rng.standard_normal(v.shape) * 0.1).astype(v.dtype)
                                          for k, v in trainer.weights().items() if v.dtype.kind == "f"}})
    trainer.train_epoch(x, y, [0.5] * c, [0.25] * c, batch, rng)
seconds = time.process_time() - start
after = rss()
stages.append(("one local epoch (peak)", {"VmRSS": after["VmHWM"], "VmHWM": after["VmHWM"]}))
print(json.dumps({"stages": stages, "epoch_cpu_s": seconds, "images": int(len(y)),
                  "torch_imported": "torch" in sys.modules}))
"""


@dataclass
class Settings:
    dataset: str = "cifar10"
    data: str | None = None
    model: str = "cnn"
    images: int = 5000
    batch: int = 64
    backends: tuple[str, ...] = ("torch", "onnx")
    device_python: str | None = None
    train_chunk: int | None = None  # the thin trainer's chunk (None: the device's default)

    @classmethod
    def from_args(cls, a: Any) -> "Settings":
        return cls(dataset=a.dataset, data=a.data, model=a.model or "cnn", images=a.images or 5000,
                   batch=int(dict(kv.split("=", 1) for kv in (getattr(a, "set", None) or [])).get("device_batch", 64)),
                   backends=tuple(a.backends),
                   device_python=os.path.abspath(a.device_python) if a.device_python else None,
                   train_chunk=getattr(a, "train_chunk", None))


def measure(s: Settings, backend: str, shard: Path, env: dict[str, str]) -> dict[str, Any]:
    python = (s.device_python or sys.executable) if backend == "torch" else sys.executable
    proc = subprocess.run([python, "-c", PROBE, backend, str(shard), s.model, str(s.batch),
                           "default" if s.train_chunk is None else str(s.train_chunk)], capture_output=True,
                          text=True, env={**os.environ, **env}, timeout=1800)
    if proc.returncode:
        raise RuntimeError(f"device-memory {backend}: the probe failed:\n{proc.stderr[-1500:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    rows, before = [], 0.0
    for name, mem in out["stages"]:
        rows.append({"stage": name, "rss_mb": mem["VmRSS"], "added_mb": mem["VmRSS"] - before})
        before = mem["VmRSS"]
    return {"backend": backend, "python": interpreter_info(python), "stages": rows,
            "epoch_cpu_s": out["epoch_cpu_s"], "train_chunk": s.train_chunk, "images": out["images"], "torch_imported": out["torch_imported"]}


def run(s: Settings) -> tuple[dict[str, Any], dict[str, Any]]:
    env, source = device_environment()
    with tempfile.TemporaryDirectory(prefix="bench-devmem-") as tmp:
        shard = Path(tmp) / "shard.npz"
        write_shard(RamSettings(dataset=s.dataset, data=s.data, images=s.images), shard)
        runs = [measure(s, backend, shard, env) for backend in s.backends]
    return {**vars(s), "backends": list(s.backends), "env": env, "env_source": source}, {"runs": runs}


def markdown(results: dict[str, Any]) -> str:
    out = ["## Device memory, stage by stage (RSS MB after each; the last row is the peak of the epoch)\n"]
    for r in results["runs"]:
        py = r["python"]
        chunk = "" if r["backend"] == "torch" else f", W_c trained {_chunk_words(r.get('train_chunk'))}"
        out += [f"### {r['backend']} device (Python {py['python']}, torch {py['torch'] or 'not installed'}{chunk})\n",
                table(["stage", "RSS MB", "added MB"], [(x["stage"], x["rss_mb"], x["added_mb"]) for x in r["stages"]]),
                f"\nOne local epoch over {r['images']} images: {r['epoch_cpu_s']:.1f} CPU s; torch in the process: "
                f"{'yes' if r.get('torch_imported') else 'no'}.\n"]
    return "\n".join(out)


def _chunk_words(chunk: int | None) -> str:
    if chunk is None:
        from splitedge.methods.contract import TRAIN_CHUNK as chunk
    return "on whole batches" if chunk == 0 else f"{chunk} samples at a time (--train-chunk)"


def plot(results: dict[str, Any], out_dir: Path) -> list[Path]:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for i, r in enumerate(results["runs"]):
        bottom = 0.0
        for j, x in enumerate(r["stages"]):
            ax.bar(i, max(x["added_mb"], 0), bottom=bottom, color=f"C{j}", label=x["stage"] if i == 0 else None)
            bottom += max(x["added_mb"], 0)
    ax.set_xticks(range(len(results["runs"])), [r["backend"] for r in results["runs"]])
    ax.set_ylabel("RSS (MB), stacked by stage")
    ax.legend(fontsize=7)
    return save_figure(fig, out_dir / "device_memory.png")
