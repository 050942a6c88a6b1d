"""Privacy of what devices send and edges merge: secure aggregation, differential privacy, minimum class counts."""
