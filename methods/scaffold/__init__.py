"""SCAFFOLD (Karimireddy et al., ICML 2020, option II): FedAvg with server and device control
variates that correct each local step for the device's drift; the variates travel as weight maps."""

BUILDS_ON: tuple[str, ...] = ("fedavg",)
"""The method packages this one imports from, only their SHARED modules (tests/app/test_layering.py)."""
SHARED: tuple[str, ...] = ()
"""No other method imports from this one."""
