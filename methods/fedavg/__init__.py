"""FedAvg baseline: full SplitModel trained on devices, sample-weighted averages edge then cloud."""

BUILDS_ON: tuple[str, ...] = ()
"""The method packages this one imports from, only their SHARED modules (tests/app/test_layering.py)."""
SHARED: tuple[str, ...] = ("method", "config", "device", "edge", "cloud")
"""Its modules other methods may import: FedProx, SCAFFOLD, FedOpt, the self-supervised methods, CFLHKD and MAR build on its parts."""
