"""Private reports (`--private-reports`, runs with DP): a device's `done` info as it leaves holds
only what is not a function of its images without noise (docs/privacy.md)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from splitedge.methods.contract import RoundPlan
from splitedge.runtime.mods import Mod

PRIVATE_INFO = ("phase", "withheld", "dp_releases", "refused", "neighbours_heard", "neighbours_missed")
"""What a device's `done` info carries with private reports, and nothing else. Held-out scores
(`accuracy`, `effective_rank`, `eval_samples`, `global_accuracy`: FedProto, CFLHKD, a calibrated
head's evaluation), samples, losses and samples sent are left out; `withheld` is computed from a
DP release's noisy counts under DP (methods/privacy/floor.py)."""
PRIVATE_COST = ("bytes_up", "bytes_down", "shared_process")
"""Of its cost only the bytes on its connection (sizes of messages the broker carries anyway),
not its CPU seconds or peak memory, which grow with its data."""


def private_info(info: Mapping[str, Any]) -> dict[str, Any]:
    """`info` as a device with private reports sends it: the keys of PRIVATE_INFO, its cost's of
    PRIVATE_COST, and `private_reports` so that its edge forwards its cost only summed with its
    other such devices' (runtime/cost.py device_costs)."""
    out = {k: info[k] for k in PRIVATE_INFO if k in info}
    if isinstance(info.get("cost"), Mapping):
        out["cost"] = {k: info["cost"][k] for k in PRIVATE_COST if k in info["cost"]}
    out["private_reports"] = True
    return out


class PrivateReports(Mod):
    """Last in a device's chain: it filters every entry the mods before it added."""

    def done(self, plan: RoundPlan, info: dict[str, Any], children: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
        return private_info(info)
