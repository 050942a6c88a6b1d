"""FedProto baseline: local models regularised towards global per-class prototypes; only prototypes travel."""
