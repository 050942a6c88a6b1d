"""CFLHKD (METHODS.md): clustered FL with clusters on edges and hierarchical distillation."""
