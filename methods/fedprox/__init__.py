"""FedProx (Li et al., MLSys 2020): FedAvg whose devices add (mu/2)||w - w_global||^2 to their loss."""

BUILDS_ON: tuple[str, ...] = ("fedavg",)
"""The method packages this one imports from, only their SHARED modules (tests/app/test_layering.py)."""
SHARED: tuple[str, ...] = ()
"""No other method imports from this one."""
