"""Federated self-supervised learning (METHODS.md "SSD"): SimSiam, align-uniform and SSD on the
FedAvg pattern. Devices train an encoder and projector on two augmented views of their
unlabelled images; edges and the cloud average them; the cloud reports what the representation
is worth (linear probe, kNN, alignment, uniformity, effective rank, spectrum)."""

BUILDS_ON: tuple[str, ...] = ("fedavg",)
"""The method packages this one imports from, only their SHARED modules (tests/app/test_layering.py)."""
SHARED: tuple[str, ...] = ("cloud", "config", "model")
"""Its modules other methods may import: MAR builds on its cloud, config and model."""
