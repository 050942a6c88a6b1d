"""SGD with momentum and weight decay in numpy, step for step torch.optim.SGD (methods.torch_utils.PlainSGD)."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from splitedge.methods.thin.layers import Layer


class NumpySGD:
    """`grad + weight_decay * p`, into a momentum buffer (the first step's buffer is the gradient),
    then `p -= lr * buffer`, in float32 in place, as torch's single-tensor path does."""

    def __init__(self, params: Sequence[tuple[str, Layer, str]], lr: float, momentum: float = 0.0,
                 weight_decay: float = 0.0) -> None:
        self.params = list(params)
        self.lr, self.momentum, self.weight_decay = float(lr), float(momentum), float(weight_decay)
        self.buffers: dict[str, np.ndarray] = {}

    def zero_grad(self) -> None:
        for _, layer, key in self.params:
            layer.grads.pop(key, None)

    def step(self) -> None:
        lr, mom, wd = np.float32(self.lr), np.float32(self.momentum), np.float32(self.weight_decay)
        for name, layer, key in self.params:
            grad = layer.grads.get(key)
            if grad is None:
                continue
            p = layer.params[key]
            if wd:
                grad = grad + wd * p
            if mom:
                buf = self.buffers.get(name)
                buf = grad.astype(np.float32, copy=True) if buf is None else buf * mom + grad
                self.buffers[name] = buf
                grad = buf
            p -= lr * grad

    def state_dict(self) -> dict[str, Any]:
        """Settings and momentum buffers, kept when a device is parked or restarted."""
        return {"lr": self.lr, "momentum": self.momentum, "weight_decay": self.weight_decay,
                "buffers": {k: v.copy() for k, v in self.buffers.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        names = {name for name, _, _ in self.params}
        unknown = set(state["buffers"]) - names
        if unknown:
            raise ValueError(f"momentum buffers for parameters this optimiser does not hold: {sorted(unknown)[:5]}")
        self.lr, self.momentum, self.weight_decay = (float(state[k]) for k in ("lr", "momentum", "weight_decay"))
        self.buffers = {k: np.array(v, dtype=np.float32) for k, v in state["buffers"].items()}
