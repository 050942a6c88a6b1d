"""Flower's server for `bench flower`: its FedAvg strategy over gRPC, on the plan's network.

Flower 1.42's `flwr.server.start_server` (deprecated since 1.13 in favour of the SuperLink, and
still shipped): one process holding the strategy, the client manager and the gRPC server, so its
CPU and RSS are the server's alone. FedAvg as Flower ships it (its in-place sample-weighted
average), initialised with the weights splitedge's FedAvg cloud starts from, every client in
every round, no federated evaluation: after each round the server evaluates the global model on
the test split with splitedge's evaluation, as splitedge's cloud does.

Per round it logs (common.RoundLog) the accuracy, the serialised parameters it sent each client
and each client sent back (`Parameters.tensors`, numpy .npy bytes), and every client
connection's TCP byte counters read from the kernel (TCP_INFO `bytes_acked` / `bytes_received`
of the server's sockets): what gRPC put on the stream, HTTP/2 and protobuf framing included.

    python -m splitedge.bench.flower_side.server --plan plan.json --port 9092 --rounds-file rounds.jsonl
"""

from __future__ import annotations

import argparse
import os
import socket
import stat
import struct
import time
from typing import Any, Sequence

from flwr.common import Parameters, ndarrays_to_parameters, parameters_to_ndarrays
from flwr.server import ServerConfig, start_server
from flwr.server.strategy import FedAvg

from splitedge.bench.flower_side.common import Plan, RoundLog, evaluate, load, new_model, state

TCP_INFO_BYTES = 120
"""Offset of `tcpi_bytes_acked` in struct tcp_info (Linux >= 4.2); `tcpi_bytes_received` follows."""


def connection_bytes(port: int) -> dict[str, dict[str, int]]:
    """Bytes sent (acknowledged by the peer) and received on each of this process's TCP
    connections accepted on `port`, by peer address."""
    out = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            if not stat.S_ISSOCK(os.fstat(int(name)).st_mode):
                continue
            sock = socket.socket(fileno=os.dup(int(name)))
        except OSError:
            continue
        try:
            if sock.type != socket.SOCK_STREAM or sock.getsockname()[1] != port:
                continue
            peer = sock.getpeername()  # OSError for the listening socket
            info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
            sent, received = struct.unpack_from("QQ", info, TCP_INFO_BYTES)
            out[f"{peer[0]}:{peer[1]}"] = {"sent": sent, "received": received}
        except OSError:
            continue
        finally:
            sock.close()
    return out


def size(parameters: Parameters) -> int:
    return sum(len(t) for t in parameters.tensors)


class MeteredFedAvg(FedAvg):
    """Flower's FedAvg, unchanged, with each round's times and bytes logged and the global model
    evaluated by splitedge's evaluation after each round."""

    def __init__(self, plan: Plan, port: int, log: RoundLog, **kwargs: Any) -> None:
        self.plan, self.port, self.log = plan, port, log
        self.model = new_model(plan)
        self.names = list(state(self.model))
        _, self.test = load(plan)  # the train split is left to the garbage collector
        self.started, self.down, self.up = 0.0, 0, []
        super().__init__(initial_parameters=ndarrays_to_parameters(list(state(self.model).values())),
                         fraction_fit=1.0, fraction_evaluate=0.0, min_fit_clients=plan.devices,
                         min_evaluate_clients=0, min_available_clients=plan.devices, **kwargs)

    def configure_fit(self, server_round: int, parameters: Parameters, client_manager: Any) -> Any:
        pairs = super().configure_fit(server_round, parameters, client_manager)  # waits for every client
        self.started, self.down = time.time(), size(parameters)
        return pairs

    def aggregate_fit(self, server_round: int, results: Any, failures: Any) -> Any:
        self.up = [size(res.parameters) for _, res in results]
        return super().aggregate_fit(server_round, results, failures)

    def evaluate(self, server_round: int, parameters: Parameters) -> tuple[float, dict[str, Any]] | None:
        if server_round == 0:  # Flower evaluates the initial model; splitedge's cloud does not
            return None
        from splitedge.models import load_numpy_state

        load_numpy_state(self.model, dict(zip(self.names, parameters_to_ndarrays(parameters))))
        metrics = evaluate(self.plan, self.model, self.test, server_round)
        self.log.write(server_round, self.started, **metrics, params_down_per_client=self.down,
                       params_up=self.up, sockets=connection_bytes(self.port))
        return 0.0, metrics


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--plan", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--rounds-file", required=True)
    a = p.parse_args(argv)
    import torch

    torch.set_num_threads(1)  # as `splitedge sim` (--threads 1)
    plan = Plan.read(a.plan)
    strategy = MeteredFedAvg(plan, a.port, RoundLog(a.rounds_file))
    start_server(server_address=f"127.0.0.1:{a.port}", config=ServerConfig(num_rounds=plan.rounds),
                 strategy=strategy)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
