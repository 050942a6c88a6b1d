"""FedAvg baseline: full SplitModel trained on devices, sample-weighted averages edge then cloud."""
