"""What a node's rounds cost it: CPU seconds, peak memory and bytes on its own connection.

A deployed device reports these with every round (its `done` info, key `cost`); its edge passes
its devices' on to the cloud, which writes them per device and round into metrics.jsonl and
sums them per device in a sim's summary.json. A device with private reports sends only its bytes,
and its edge passes them on only summed over such devices (`private_devices` of the edge's cost). CPU and memory are the process's: in a sim, where
every node shares one process, they describe the sim, not a device (`shared_process` says so);
bytes are always the node's own (each node has its own MQTT connection).
"""

from __future__ import annotations

import dataclasses
import resource
import sys
from collections.abc import Iterable, Mapping
from typing import Any

import psutil

from splitedge.protocol.done import DevicesDone, DoneInfo, dones


def peak_rss_bytes() -> int:
    """The process's peak resident set size so far, never below its resident size now (Linux
    ru_maxrss is in KiB, macOS in bytes). Linux folds each thread's cached RSS counts into the
    high-water mark late, so a busy process's ru_maxrss can read up to ~64 pages per thread
    below its current RSS: a peak under the present would be a metric that lies (issue 56)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return max(int(peak if sys.platform == "darwin" else peak * 1024), psutil.Process().memory_info().rss)


def cpu_seconds(process: psutil.Process) -> float:
    """User + system CPU seconds of `process` so far (a round's `cpu_s` is a difference of two)."""
    cpu = process.cpu_times()
    return cpu.user + cpu.system


class CostMeter:
    """Each `round()` returns the cost since the previous one (the first: since the start)."""

    def __init__(self, transports: Iterable[Any], *, shared_process: bool = False) -> None:
        self.transports = list(transports)
        self.shared = shared_process
        self.process = psutil.Process()
        self.last = self._totals()

    def _totals(self) -> dict[str, float]:
        return {"cpu_s": cpu_seconds(self.process),
                "bytes_up": sum(t.counters.total("out", "wire") for t in self.transports),
                "bytes_down": sum(t.counters.total("in", "wire") for t in self.transports)}

    def round(self) -> dict[str, Any]:
        """Every figure a float: msgpack writes any float in 9 bytes, so what a round costs does
        not change the size of the message that reports it (ints take 1 to 9 bytes by value,
        and a device's bytes on the wire then depended on its own CPU time and traffic)."""
        now = self._totals()
        cost = {k: round(now[k] - self.last[k], 3) if k == "cpu_s" else float(int(now[k] - self.last[k])) for k in now}
        self.last = now
        cost["rss_peak_mb"] = round(peak_rss_bytes() / 2**20, 1)
        if self.shared:
            cost["shared_process"] = True
        return cost


def device_costs(devices: DevicesDone, infos: Mapping[str, DoneInfo]) -> DevicesDone:
    """What an edge's `done` info says of its devices' costs, from their `done` infos (those that
    reported one): `cost`, by device; the devices with private reports (runtime/mods/private.py,
    private_info) only summed, as `private_cost` (`devices`: how many), never one by one."""
    costs = {d: i.cost for d, i in sorted(infos.items()) if i.cost}
    private = [c for d, c in costs.items() if infos[d].private_reports]
    return dataclasses.replace(devices, cost={d: dict(c) for d, c in costs.items() if not infos[d].private_reports},
                               private_cost=summed_cost(private) if private else {})


def summed_cost(costs: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """Several devices' costs of one phase as one: every figure summed (the peak memory's
    maximum), with `devices`, how many."""
    out: dict[str, Any] = {"devices": 0}
    for cost in costs:
        out["devices"] += 1
        for key, value in cost.items():
            if key == "shared_process":
                out[key] = bool(value)
            elif key == "rss_peak_mb":
                out[key] = max(float(out.get(key, 0)), float(value))
            elif isinstance(value, (int, float)):
                out[key] = round(out.get(key, 0) + value, 3)
    return out


def readable(cost: Mapping[str, Any]) -> dict[str, Any]:
    """A reported cost with its byte counts as ints again (they travel as floats), for the
    cloud's metrics and summary."""
    return {k: int(v) if k.startswith("bytes_") and isinstance(v, (int, float)) else v for k, v in cost.items()}


def summed(rounds: Iterable[Mapping[str, Mapping[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Per device over a run: CPU seconds and bytes summed, the peak memory's maximum."""
    out: dict[str, dict[str, Any]] = {}
    for per_device in rounds:
        for dev, cost in per_device.items():
            row = out.setdefault(dev, {"cpu_s": 0.0, "bytes_up": 0, "bytes_down": 0, "rss_peak_mb": 0.0, "rounds": 0})
            row["cpu_s"] = round(row["cpu_s"] + float(cost.get("cpu_s", 0)), 3)
            row["bytes_up"] += int(cost.get("bytes_up", 0))
            row["bytes_down"] += int(cost.get("bytes_down", 0))
            row["rss_peak_mb"] = max(row["rss_peak_mb"], float(cost.get("rss_peak_mb", 0)))
            row["rounds"] += 1
            if cost.get("shared_process"):
                row["shared_process"] = True
    return out


def phase_costs(reports: Iterable[Any]) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]]]:
    """From a phase's edge reports: (each device's cost, each edge's own), by node. An edge's
    devices with private reports are in its own, summed, as `private_devices` (device_costs)."""
    devices: dict[str, dict[str, Any]] = {}
    edges: dict[str, dict[str, Any]] = {}
    for edge, info in dones(reports).items():
        of = info.devices or DevicesDone()
        devices.update({d: readable(c) for d, c in of.cost.items()})
        if info.cost:
            edges[edge] = readable(info.cost)
        if of.private_cost:
            edges.setdefault(edge, {})["private_devices"] = readable(of.private_cost)
    return devices, edges


def add_costs(into: dict[str, dict[str, Any]], more: Mapping[str, Mapping[str, Any]]) -> None:
    """A round's phases add up: CPU seconds and bytes summed, the peak memory's maximum (and
    the devices an edge's `private_devices` sums over)."""
    for node, cost in more.items():
        _add(into.setdefault(node, {}), cost)


def _add(row: dict[str, Any], cost: Mapping[str, Any]) -> None:
    for key, value in cost.items():
        if isinstance(value, Mapping):
            _add(row.setdefault(key, {}), value)
        elif key in ("rss_peak_mb", "devices"):
            row[key] = max(row.get(key, 0), value)
        elif key == "shared_process":
            row[key] = bool(value)
        else:
            row[key] = round(row.get(key, 0) + value, 3) if isinstance(value, float) else row.get(key, 0) + value
