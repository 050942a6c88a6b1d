"""Why FedDecorr lowers the effective rank of `fedcnn`: its penalty is lowest where ReLU units die.

FedDecorr z-scores each column of the penultimate features and penalises the squared
correlations between columns; a unit that never fires has a constant column, z-scored to 0, so
it correlates with nothing and costs nothing. On `fedcnn`, whose penultimate features are 256
ReLU units, that leaves an easy way down. This trains the network centrally with and without
the penalty (beta 0 and 0.1, seed 0, the same batches) and counts, on the test images, the
units that never fire and the effective rank of the features:

    python -m splitedge.bench.feddecorr_units --data ../shared/data/cifar10-jpeg.tar.gz

(bench/results/feddecorr-units/README.md holds its output.)
"""

from __future__ import annotations

import argparse

import numpy as np


def effective_rank(features: "object") -> float:
    """exp of the entropy of the centred features' normalised singular values."""
    import torch

    f = features - features.mean(0)
    s = torch.linalg.svdvals(f.double())
    p = s / s.sum()
    p = p[p > 0]
    return float(torch.exp(-(p * p.log()).sum()))


def main(argv: list[str] | None = None) -> None:
    import torch
    import torch.nn.functional as F

    from splitedge.methods.data.datasets import load_dataset
    from splitedge.methods.losses import feddecorr_loss
    from splitedge.models.registry import create_split

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", required=True, help="CIFAR-10 (../shared/data/cifar10-jpeg.tar.gz)")
    p.add_argument("--train", type=int, default=5000)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--betas", default="0,0.1")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    (x, y), (xt, yt), info = load_dataset("cifar10", a.data, max_train=a.train, max_test=1000, seed=0)

    def prep(images: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(np.ascontiguousarray(images.transpose(0, 3, 1, 2), dtype=np.float32) / 255.0)
        return (t - 0.5) / 0.25

    X, Y, XT = prep(x), torch.from_numpy(y).long(), prep(xt)
    print(f"fedcnn, {a.train} CIFAR-10 training images, {a.epochs} epochs, SGD lr 0.01 momentum 0.9, batch 32, "
          f"seed 0; the test split's first 1,000 images")
    for beta in (float(b) for b in a.betas.split(",")):
        torch.manual_seed(0)
        model = create_split("fedcnn", num_classes=10, in_channels=3, image_size=32)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        for _ in range(a.epochs):
            model.train()
            perm = torch.randperm(len(X))
            for i in range(0, len(X), 32):
                idx = perm[i:i + 32]
                feats, logits = model.features_and_logits(X[idx])
                loss = F.cross_entropy(logits, Y[idx])
                if beta:
                    loss = loss + beta * feddecorr_loss(feats)
                opt.zero_grad()
                loss.backward()
                opt.step()
        model.eval()
        with torch.no_grad():
            f, logits = model.features_and_logits(XT)
        acc = float((logits.argmax(1).numpy() == yt).mean())
        dead = int((f.max(0).values <= 0).sum())
        rare = int(((f > 0).float().mean(0) < 0.01).sum())
        print(f"beta {beta:g}: test accuracy {acc:.3f}, effective rank {effective_rank(f):.1f}, units that never fire "
              f"{dead} of {f.shape[1]}, units firing on under 1 % of images {rare}")


if __name__ == "__main__":
    main()
