"""The one training loop every tier of every method uses, with composable loss terms.

A trainer is a `forward(batch) -> outputs` (a dict of named tensors: "logits", "features" (the
pooled representation a regulariser acts on), "z" (projections), ...) and a list of
`LossTerm`s that each read the outputs. The method declares its terms (`Method.objective`);
regularisers such as FedDecorr come from config (`Method.regularisers`) and apply to any method
whose forward provides "features". Each term's mean is logged by name, so a regulariser's
contribution shows in the metrics.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from splitedge.methods.budget import checkpoint
from splitedge.methods.losses import feddecorr_loss
from splitedge.methods.losslog import LossLog

Outputs = Mapping[str, torch.Tensor]


@dataclass
class Batch:
    """One minibatch: inputs, labels (None when unlabelled) and anything else a term needs."""

    x: torch.Tensor
    y: torch.Tensor | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.x)


@dataclass(frozen=True)
class LossTerm:
    """`weight * fn(outputs, batch)`, logged under `name`; `needs` lists the outputs it reads."""

    name: str
    fn: Callable[[Outputs, Batch], torch.Tensor]
    weight: float = 1.0
    needs: tuple[str, ...] = ()


def cross_entropy_term(name: str = "ce", weight: float = 1.0) -> LossTerm:
    return LossTerm(name, lambda out, b: F.cross_entropy(out["logits"], b.y), weight, ("logits",))


def feddecorr_term(beta: float) -> LossTerm:
    """FedDecorr (METHODS.md) on the pooled representation the tier trains."""
    return LossTerm("feddecorr", lambda out, b: feddecorr_loss(out["features"]), beta, ("features",))


def check_terms(terms: Sequence[LossTerm], provides: Iterable[str], where: str) -> None:
    """A term that needs an output the forward does not give is a method bug: say so early."""
    have = set(provides)
    for term in terms:
        missing = set(term.needs) - have
        if missing:
            raise ValueError(f"{where}: loss term {term.name!r} needs {sorted(missing)}, "
                             f"but the forward gives only {sorted(have)}")


def total_loss(terms: Sequence[LossTerm], out: Outputs, batch: Batch) -> tuple[torch.Tensor, dict[str, float]]:
    """Weighted sum of the terms and each term's (unweighted) value."""
    if not terms:
        raise ValueError("nothing to minimise: no loss terms")
    total, parts = None, {}
    for term in terms:
        value = term.fn(out, batch)
        parts[term.name] = float(value.detach())
        total = term.weight * value if total is None else total + term.weight * value
    return total, parts


def train_step(forward: Callable[[Batch], Outputs], terms: Sequence[LossTerm], batch: Batch, opt: Any,
               log: LossLog | None = None) -> dict[str, float]:
    """One optimiser step on `batch`; returns the term values (plus "total")."""
    out = forward(batch)
    loss, parts = total_loss(terms, out, batch)
    opt.zero_grad()
    loss.backward()
    opt.step()
    parts["total"] = float(loss.detach())
    if log is not None:
        log.add(parts, len(batch))
    return parts


def train_epochs(forward: Callable[[Batch], Outputs], terms: Sequence[LossTerm], make_batches: Callable[[], Iterable[Batch]],
                 opt: Any, modules: Sequence[nn.Module], *, epochs: int = 1) -> dict[str, float]:
    """`epochs` passes over `make_batches()` in train mode (eval mode after); returns the
    last epoch's mean of every term."""
    log = LossLog()
    for module in modules:
        module.train()
    try:
        for _ in range(epochs):
            log = LossLog()
            for batch in make_batches():
                checkpoint()  # the round's time budget and memory ceiling (runtime/guard.py)
                train_step(forward, terms, batch, opt, log)
    finally:
        for module in modules:
            module.eval()
    return log.means()
