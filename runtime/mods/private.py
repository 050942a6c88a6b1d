"""Private reports (`--private-reports`, runs with DP): a device's `done` info as it leaves holds
only what is not a function of its images without noise (docs/privacy.md)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from splitedge.methods.contract import RoundPlan
from splitedge.protocol.done import DoneInfo
from splitedge.runtime.mods import EVERY_FIELD, Mod

PRIVATE_INFO = ("withheld", "dp_releases", "refused", "failed", "reason", "left")
"""What a device's `done` info carries with private reports, besides its part's `clear_info`
entries and its cost's PRIVATE_COST. Held-out scores (`scores`, and a method's `accuracy`,
`effective_rank`, `eval_samples`, `global_accuracy`: FedProto, CFLHKD), samples, losses and
samples sent are left out; `withheld` is computed from a DP release's noisy counts under DP
(methods/privacy/floor.py)."""
PRIVATE_COST = ("bytes_up", "bytes_down", "shared_process")
"""Of its cost only the bytes on its connection (sizes of messages the broker carries anyway),
not its CPU seconds or peak memory, which grow with its data."""


def private_info(info: DoneInfo, clear: tuple[str, ...] = ()) -> DoneInfo:
    """`info` as a device with private reports sends it: the fields of PRIVATE_INFO, its part's
    `clear` entries, its cost's PRIVATE_COST, and `private_reports` so that its edge forwards its
    cost only summed with its other such devices' (runtime/cost.py device_costs)."""
    kept: dict[str, Any] = {k: getattr(info, k) for k in PRIVATE_INFO}
    return DoneInfo(**kept, method={k: v for k, v in info.method.items() if k in clear},
                    cost={k: v for k, v in info.cost.items() if k in PRIVATE_COST}, private_reports=True)


class PrivateReports(Mod):
    """Last in a device's chain: it filters every entry the mods before it added."""

    writes = EVERY_FIELD

    def __init__(self, device: Any) -> None:
        self.device = device

    def done(self, plan: RoundPlan, info: DoneInfo, children: Mapping[str, DoneInfo]) -> DoneInfo:
        return private_info(info, self.device.part.clear_info)
