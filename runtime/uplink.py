"""What a device's round may send up: a byte budget its owner sets (`--max-up-bytes`).

Every message a device sends during a round (to its edge or its peers: statistics, models,
SplitFed's activations, secure-sum exchanges) is charged before it leaves; one that would take
the round past the budget is not sent, and the round fails in one logged line naming the
message, the bytes and the flag, so the edge counts it (`done {failed, reason: "uplink"}`) and
nothing beyond the budget ever reached the broker. `done`, `hello` and `status` are the
runtime's own words and always go. The charge is the payload's size as the codec will write it,
within a few bytes a message (arrays by their bytes, names and scalars by their msgpack size).
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from splitedge.runtime.guard import OverBudget

FLAG = "--max-up-bytes"
FREE_KINDS = frozenset({"done", "hello", "status"})
"""The runtime's own words: a failed round must still say so."""


def payload_bytes(value: Any) -> int:
    """About what msgpack writes for `value`: arrays by their bytes plus a small header."""
    if isinstance(value, np.ndarray):
        return int(value.nbytes) + 16 + 9 * value.ndim
    if isinstance(value, (bytes, bytearray, memoryview)):
        return len(value) + 5
    if isinstance(value, str):
        return len(value.encode()) + 5
    if isinstance(value, Mapping):
        return 5 + sum(payload_bytes(k) + payload_bytes(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return 5 + sum(payload_bytes(v) for v in value)
    return 9  # a number, a bool, nil


@dataclass
class UplinkBudget:
    """`max_bytes` a round may send up (None: no budget); `charge` each message before it leaves."""

    max_bytes: int | None = None
    who: str = "device"
    spent: int = 0
    what: str = "round"
    by_kind: Counter[str] = field(default_factory=Counter)
    """This round's charges by kind: what the owner reads after each round (`summary`)."""

    @classmethod
    def from_args(cls, args: argparse.Namespace, who: str) -> "UplinkBudget":
        value = getattr(args, "max_up_bytes", None)
        if value is not None and value <= 0:
            raise ValueError(f"{FLAG} must be > 0 (bytes a round may send up), got {value}")
        return cls(max_bytes=value, who=who)

    def start(self, what: str) -> None:
        self.spent, self.what = 0, what
        self.by_kind.clear()

    def charge(self, kind: str, body: Mapping[str, Any]) -> None:
        """Count a message of the round; OverBudget "uplink" (nothing sent) when it would pass the budget."""
        if kind in FREE_KINDS:
            return
        size = payload_bytes(body)
        if self.max_bytes is not None and self.spent + size > self.max_bytes:
            raise OverBudget(f"{self.what}: a {kind} message of {size:,} bytes would take what {self.who} sends up "
                             f"to {self.spent + size:,} bytes, over its budget of {self.max_bytes:,}; it was not sent "
                             f"(raise the budget with {FLAG})", "uplink")
        self.spent += size
        self.by_kind[kind] += size

    def summary(self) -> str:
        """What this round sent up, by kind ("nothing" when it sent only its `done`)."""
        if not self.by_kind:
            return "sent up nothing but its done"
        return f"sent up {self.spent:,} bytes (" + ", ".join(f"{k} {n:,}" for k, n in self.by_kind.most_common()) + ")"

    def describe(self) -> str:
        return "no uplink budget" if self.max_bytes is None else f"uplink budget {self.max_bytes:,} bytes a round"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(FLAG, type=int, default=None, metavar="BYTES",
                   help="what one round may send up (statistics, models, activations, secure-sum exchanges); a "
                        "round that would send more fails in one line before the message leaves (default: no budget)")
