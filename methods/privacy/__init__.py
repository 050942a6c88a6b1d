"""Privacy for the edge's merge: secure aggregation (SecAgg / SecAgg+) with numpy and `cryptography` only."""
