"""The FedProto local loss: CE + lambda * ||f(x) - proto_y||^2 (METHODS.md, lambda = 1).

f(x) is the pooled W_e output, pool(W_e(W_c(x))). On the "cnn" split W_g is avgpool + flatten
+ fc, so f is exactly the penultimate representation FedProto regularises; on "resnet18" it is
the pooled layer3 output (W_g keeps layer4). Choosing the W_e space for every model keeps the
prototypes in the space the `moments` kind calls "we" and beside H-SFP's edge->cloud moments.

Distance: ||f_i - proto_{y_i}||^2 averaged over the batch; a sample whose class has no global
prototype yet contributes 0 (the official code substitutes the sample's own feature, same
effect). `reduction` decides the scale over the feature dimension D:
  "mse"   (default) divides by D, as the official code's nn.MSELoss does;
  "sq_l2" the literal METHODS.md norm, summed over D (= "mse" with lambda * D).
Why "mse" by default: with lambda = 1 the summed norm (64x stronger on the cnn) pulls each
device's features onto prototypes averaged over devices whose models still disagree, and
personalised accuracy on digits falls from ~0.6 after round 1 to ~0.2 for several rounds;
the official scaling trains as published (~0.95 by round 2).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from splitedge.models import SplitModel, pool


def representation(model: SplitModel, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(f(x) = pooled W_e output [B, D], logits [B, C]) in one forward pass."""
    h = model.we(model.wc(x))
    return pool(h), model.wg(h)


REDUCTIONS = ("mse", "sq_l2")


def proto_distance(features: torch.Tensor, labels: torch.Tensor, protos: torch.Tensor,
                   has_proto: torch.Tensor, reduction: str = "mse") -> torch.Tensor:
    """Batch mean of ||f_i - proto_{y_i}||^2 (divided by D for "mse"), 0 for classes without a prototype."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    mask = has_proto[labels].to(features.dtype)
    sq = ((features - protos[labels]) ** 2).sum(dim=1)
    if reduction == "mse":
        sq = sq / features.shape[1]
    return (sq * mask).mean()


def fedproto_loss(logits: torch.Tensor, features: torch.Tensor, labels: torch.Tensor, protos: torch.Tensor,
                  has_proto: torch.Tensor, lam: float = 1.0, reduction: str = "mse") -> torch.Tensor:
    """CE(logits, y) + lam * proto_distance; protos [C, D] (rows of absent classes are ignored)."""
    return F.cross_entropy(logits, labels) + lam * proto_distance(features, labels, protos, has_proto, reduction)
