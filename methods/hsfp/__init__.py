"""H-SFP: hierarchical split learning with decoupled Gaussian prototypes (METHODS.md)."""
