"""FedProx (Li et al., MLSys 2020): FedAvg whose devices add (mu/2)||w - w_global||^2 to their loss."""
