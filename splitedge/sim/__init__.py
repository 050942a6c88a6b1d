"""`splitedge sim`: a whole federation on one machine, through a real MQTT broker.

federation.py runs it (settings, brokers, the nodes, the summary); cli.py is the command;
worker.py a device worker process (`--workers N`); virtual.py the virtual devices' hosts;
resume.py carrying a killed sim on; keys.py the signing keys a signed sim derives;
broker_tree.py one Mosquitto per edge site bridged to a cloud one. Nothing outside this package
needs any of it: the roles run the same in a deployment.
"""

from splitedge.sim.federation import MAX_SIM_NODES, Federation, SimSettings, partition, private_run, run_sim, run_worker

__all__ = ["MAX_SIM_NODES", "Federation", "SimSettings", "partition", "private_run", "run_sim", "run_worker"]
