"""FedOpt (Reddi et al., ICLR 2021): FedAvg whose cloud steps a server optimiser (FedAvgM,
FedAdam, FedYogi) on the pseudo-gradient, the merged model minus the current one."""

BUILDS_ON: tuple[str, ...] = ("fedavg",)
"""The method packages this one imports from, only their SHARED modules (tests/app/test_layering.py)."""
SHARED: tuple[str, ...] = ()
"""No other method imports from this one."""
