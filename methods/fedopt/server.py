"""Server optimisers on weight maps (numpy, float64 state), METHODS.md "FedOpt".

The pseudo-gradient of a round is D = merge(w_i) - w, the merged devices' models minus the
model they trained from. For each trainable parameter:

- FedAvgM: v <- b1 v + D;  w <- w + lr v
- FedAdam: m <- b1 m + (1 - b1) D;  v <- b2 v + (1 - b2) D^2;  w <- w + lr m / (sqrt(v) + tau)
- FedYogi: as FedAdam with v <- v - (1 - b2) D^2 sign(v - D^2)

m starts at 0 and v at tau^2 (Reddi et al. Algorithm 2: v_{-1} >= tau^2; no bias correction).
Buffers that are not trained (BatchNorm's running statistics and counters) take the merged
value, as in FedAvg.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

SERVER_OPTIMISERS = ("avgm", "adam", "yogi")


class ServerOptimiser:
    """`step(current, merged)` -> the new weight map; `m` and `v` are its state (by name)."""

    def __init__(self, kind: str, *, lr: float, beta1: float, beta2: float, tau: float,
                 params: tuple[str, ...]) -> None:
        if kind not in SERVER_OPTIMISERS:
            raise ValueError(f"server optimiser must be one of {SERVER_OPTIMISERS}, got {kind!r}")
        self.kind, self.lr, self.beta1, self.beta2, self.tau = kind, lr, beta1, beta2, tau
        self.params = params
        self.m: dict[str, np.ndarray] = {}
        self.v: dict[str, np.ndarray] = {}

    def step(self, current: Mapping[str, np.ndarray], merged: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        out = {k: np.array(v) for k, v in merged.items()}  # buffers: the merged value
        for name in self.params:
            w = np.asarray(current[name], dtype=np.float64)
            d = np.asarray(merged[name], dtype=np.float64) - w
            out[name] = (w + self._update(name, d)).astype(np.asarray(current[name]).dtype)
        return out

    def _update(self, name: str, d: np.ndarray) -> np.ndarray:
        b1, b2 = self.beta1, self.beta2
        if self.kind == "avgm":
            v = self.v[name] = b1 * self.v.get(name, np.zeros_like(d)) + d
            return self.lr * v
        m = self.m[name] = b1 * self.m.get(name, np.zeros_like(d)) + (1 - b1) * d
        v = self.v.get(name, np.full_like(d, self.tau ** 2))
        d2 = d * d
        v = b2 * v + (1 - b2) * d2 if self.kind == "adam" else v - (1 - b2) * d2 * np.sign(v - d2)
        self.v[name] = v
        return self.lr * m / (np.sqrt(v) + self.tau)
