"""H-SFP: hierarchical split learning with decoupled Gaussian prototypes (METHODS.md)."""

BUILDS_ON: tuple[str, ...] = ()
"""The method packages this one imports from, only their SHARED modules (tests/app/test_layering.py)."""
SHARED: tuple[str, ...] = ()
"""No other method imports from this one."""
