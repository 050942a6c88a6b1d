"""FedOpt (Reddi et al., ICLR 2021): FedAvg whose cloud steps a server optimiser (FedAvgM,
FedAdam, FedYogi) on the pseudo-gradient, the merged model minus the current one."""
