"""The processes `splitedge bench flower` starts besides `splitedge sim`: Flower's server and
clients (server.py, client.py: they import flwr, so they run in the Flower venv, never in the
test run) and the floor (floor.py: the same training in one process, no framework). All of them
read one plan file the bench writes and train with common.py, splitedge's own FedAvg steps."""
