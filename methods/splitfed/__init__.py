"""SplitFed (SFLv1) baseline: per-batch activations up, gradients down; W_c and W_e+W_g averaged every round."""

BUILDS_ON: tuple[str, ...] = ()
"""The method packages this one imports from, only their SHARED modules (tests/app/test_layering.py)."""
SHARED: tuple[str, ...] = ()
"""No other method imports from this one."""
