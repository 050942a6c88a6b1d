"""FedMAR and DecMAR (METHODS.md): masked image modelling with an alignment term, federated
through edges and the cloud, or peer to peer on a random graph of devices."""

BUILDS_ON: tuple[str, ...] = ("fedavg", "ssl")
"""The method packages this one imports from, only their SHARED modules (tests/app/test_layering.py)."""
SHARED: tuple[str, ...] = ()
"""No other method imports from this one."""
