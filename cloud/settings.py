"""What a cloud is started with (its CLI's flags, or a sim's settings)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from splitedge.methods.compute import CPU, Compute
from splitedge.methods.config import RunConfig
from splitedge.runtime.presence import REJOIN_GRACE_S
from splitedge.runtime.sampling import Sampling


@dataclass
class CloudSettings:
    method: str
    rounds: int
    config: RunConfig
    deadline_s: float = 300.0
    min_edges: int = 1
    min_devices: int = 0
    join_timeout_s: float = 60.0
    rejoin_timeout_s: float = 120.0  # before a round, wait this long for edges that went offline
    rejoin_grace_s: float = REJOIN_GRACE_S  # ... when some are online: this long for the others
    out_dir: Path | None = None
    seed: int = 0
    sampling: Sampling = field(default_factory=Sampling)  # which online devices train each round
    until_plateau: bool = False  # stop before `rounds` once the accuracy has plateaued (methods/metrics/plateau.py)
    dataset: str = ""  # the data set's name, written into the checkpoint so export finds its test images
    compute: Compute = CPU  # the torch device its part trains and evaluates on (--device, methods/compute.py)
    on_round: Callable[[dict[str, Any]], None] | None = field(default=None, repr=False)
