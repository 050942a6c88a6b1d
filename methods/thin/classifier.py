"""FedAvg's device step without torch: the whole split network in numpy, cross-entropy, SGD.

The network is built from the device's own install (W_c from methods/thin/wc_models.py, W_e and
W_g's trunk from methods/thin/graphs.py, a linear classifier on top), with the torch split's
state names ("wc.*", "we.*", "wg.*"), so the global model a FedAvg cloud sends loads as it is
after it was checked against this network. One step is torch's (tests/thin/test_thin_classifier.py):
BatchNorm in training mode, mean cross-entropy, SGD with momentum and weight decay in float32.
Issue 54 asks whether FedAvg of the whole network on a thin device, with compressed updates, is
the thin-device method within 3 points of FedAvg; this is its first half.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from splitedge.methods.checks import weight_specs
from splitedge.methods.thin.graphs import calib_net
from splitedge.methods.thin.layers import F32, Linear, Sequential
from splitedge.methods.thin.optim import NumpySGD
from splitedge.methods.thin.trainer import epoch_order, load_batch
from splitedge.methods.thin.wc_models import thin_wc


def thin_network(model: str, channels: int, image_size: int, classes: int) -> Sequential:
    """W_c, W_e and W_g of `model` in numpy layers, named as the torch split (ValueError for a
    model whose W_c the thin trainer cannot train)."""
    wc = thin_wc(model, channels)
    (_, we), (_, trunk) = calib_net(model, channels, image_size, classes).children
    probe = np.zeros((1, int(channels), int(image_size), int(image_size)), F32)
    dim = int(np.prod(trunk.forward(we.forward(wc.forward(probe, False), False), False).shape[1:]))
    trunk.children.append(("fc", Linear(dim, int(classes))))
    return Sequential([("wc", wc), ("we", we), ("wg", trunk)])


def cross_entropy(logits: np.ndarray, labels: np.ndarray) -> tuple[float, np.ndarray]:
    """Mean softmax cross-entropy of float32 logits [B, K] and its gradient (F.cross_entropy)."""
    z = logits.astype(np.float64)
    z -= z.max(axis=1, keepdims=True)
    p = np.exp(z)
    p /= p.sum(axis=1, keepdims=True)
    rows = np.arange(len(labels))
    loss = float(-np.log(np.maximum(p[rows, labels], 1e-300)).mean())
    p[rows, labels] -= 1.0
    return loss, (p / len(labels)).astype(F32)


class ClassifierTrainer:
    """The whole network of a split model, trained with cross-entropy in numpy."""

    numpy_state = True  # methods/snapshot.py keeps it (a parked or restarted device) as arrays

    def __init__(self, model: str, channels: int, image_size: int, classes: int) -> None:
        self.net = thin_network(model, channels, image_size, classes)
        self.specs = weight_specs(self.net.state())

    def load(self, weights: Mapping[str, np.ndarray]) -> None:
        self.net.load(dict(weights))

    def weights(self) -> dict[str, np.ndarray]:
        return self.net.state()

    def optimizer(self, lr: float, momentum: float, weight_decay: float) -> NumpySGD:
        return NumpySGD(self.net.parameters(), lr, momentum=momentum, weight_decay=weight_decay)

    def step(self, x: np.ndarray, y: np.ndarray, opt: NumpySGD) -> float:
        """One SGD step on normalised images `x` and labels `y`; the batch's mean loss."""
        loss, grad = cross_entropy(self.net.forward(np.ascontiguousarray(x, dtype=F32), True), y)
        opt.zero_grad()
        self.net.backward(grad)
        opt.step()
        return loss

    def train_epoch(self, images: Any, labels: np.ndarray, mean: Any, std: Any, batch: int, opt: NumpySGD,
                    rng: np.random.Generator) -> float:
        """One shuffled epoch (a last batch of one image is dropped, as torch's devices do);
        the mean of the batches' losses."""
        losses = [self.step(load_batch(images, idx, mean, std), np.asarray(labels)[idx].astype(np.int64), opt)
                  for idx in epoch_order(len(labels), batch, rng)]
        self.net.forget()
        return float(np.mean(losses)) if losses else 0.0

    def stage_outputs(self, x: np.ndarray) -> dict[str, np.ndarray]:
        """W_c's and W_e's outputs and the classifier's input, in eval mode."""
        (_, wc), (_, we), (_, wg) = self.net.children
        h = wc.forward(np.ascontiguousarray(x, dtype=F32), False)
        e = we.forward(h, False)
        f = e
        for _, layer in wg.children[:-1]:
            f = layer.forward(f, False)
        return {"wc": h, "we": e, "classifier": f.reshape(len(f), -1)}

    def state_dict(self) -> dict[str, Any]:
        return {"net": self.net.state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.net.load(dict(state["net"]))
