"""SCAFFOLD (Karimireddy et al., ICML 2020, option II): FedAvg with server and device control
variates that correct each local step for the device's drift; the variates travel as weight maps."""
