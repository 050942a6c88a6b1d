"""FedMAR and DecMAR (METHODS.md): masked image modelling with an alignment term, federated
through edges and the cloud, or peer to peer on a random graph of devices."""
