"""The shared training loop: weighted loss terms, their logged means, early errors, and FedDecorr
doing what METHODS.md says (training with it raises the effective rank of the representation)."""

from __future__ import annotations

import pytest
import torch

from splitedge.methods.losslog import LossLog, merge_weighted, tier_losses
from splitedge.methods.metrics.representation import effective_rank
from splitedge.methods.training import (
    Batch, LossTerm, check_terms, cross_entropy_term, feddecorr_term, total_loss, train_epochs,
)
from parts import env, report


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def test_total_is_the_weighted_sum_and_parts_are_unweighted() -> None:
    out = {"a": torch.tensor(2.0), "b": torch.tensor(3.0)}
    terms = [LossTerm("a", lambda o, b: o["a"]), LossTerm("b", lambda o, b: o["b"], weight=0.5)]
    total, parts = total_loss(terms, out, Batch(torch.zeros(1)))
    assert float(total) == 3.5 and parts == {"a": 2.0, "b": 3.0}
    with pytest.raises(ValueError, match="no loss terms"):
        total_loss([], out, Batch(torch.zeros(1)))


def test_a_term_needing_an_output_the_forward_lacks_is_named() -> None:
    with pytest.raises(ValueError, match="'feddecorr' needs \\['features'\\]"):
        check_terms([cross_entropy_term(), feddecorr_term(0.1)], ["logits"], "cloud")


def test_loss_log_weights_by_samples_and_merges_across_tiers() -> None:
    log = LossLog()
    log.add({"ce": 1.0}, 10)
    log.add({"ce": 4.0}, 30)
    assert log.means() == {"ce": pytest.approx(3.25)}
    assert merge_weighted([({"ce": 1.0, "x": "no"}, 1), ({"ce": 3.0}, 3)]) == ({"ce": 2.5}, 4)
    # the cloud's per-tier view from two edges' done infos
    infos = [{"devices": {"loss": {"ce": 1.0}, "samples": 100}, "loss": {"supcon": 2.0}},
             {"devices": {"loss": {"ce": 2.0}, "samples": 300}, "loss": {"supcon": 4.0}}]
    reports = [report(f"e{i}", env("done", {"phase": "round", "info": info}, f"e{i}")) for i, info in enumerate(infos)]
    assert tier_losses(reports, {"ce": 0.5}) == {"device": {"ce": 1.75}, "edge": {"supcon": 3.0}, "cloud": {"ce": 0.5}}


def _train(beta: float, seed: int) -> float:
    """A small encoder + head with CE on four Gaussian classes; effective rank of its features."""
    gen = torch.Generator().manual_seed(seed)
    centers = torch.randn(4, 32, generator=gen) * 2
    y = torch.randint(0, 4, (512,), generator=gen)
    x = centers[y] + torch.randn(512, 32, generator=gen)
    torch.manual_seed(seed)
    enc = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16))
    head = torch.nn.Linear(16, 4)
    opt = torch.optim.SGD([*enc.parameters(), *head.parameters()], lr=0.1)

    def forward(b: Batch) -> dict:
        features = enc(b.x)
        return {"features": features, "logits": head(features)}

    def batches():
        order = torch.randperm(512, generator=gen)
        for i in range(0, 512, 64):
            yield Batch(x[order[i:i + 64]], y[order[i:i + 64]])

    terms = [cross_entropy_term(), *([feddecorr_term(beta)] if beta else [])]
    means = train_epochs(forward, terms, batches, opt, [enc, head], epochs=30)
    assert ("feddecorr" in means) == bool(beta) and means["total"] >= means["ce"]
    with torch.no_grad():
        return effective_rank(enc(x).numpy())


@pytest.mark.parametrize("seed", [0, 1])
def test_feddecorr_raises_the_effective_rank(seed: int) -> None:
    plain, decorrelated = _train(0.0, seed), _train(0.5, seed)
    assert decorrelated > 1.5 * plain, (plain, decorrelated)
