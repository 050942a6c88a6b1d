"""`splitedge broker`: an in-process MQTT broker (amqtt) for trials without Mosquitto."""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--port", type=int, default=1883, help="TCP port to listen on")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on; 0.0.0.0 opens it to the network (anonymous clients)")


def check_port_free(host: str, port: int) -> None:
    """A port already taken (often by a Mosquitto) is a one-line error, before amqtt starts."""
    import socket

    if not 0 < port < 65536:
        raise ValueError(f"--port must be 1..65535, got {port}")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            raise ValueError(f"cannot listen on {host}:{port} ({exc.strerror}); another broker may be running "
                             f"there: use it, or pick another --port") from None


def run(args: argparse.Namespace) -> int:
    import logging

    from splitedge.protocol.broker import serve_forever

    check_port_free(args.host, args.port)
    status = logging.getLogger("splitedge.status")
    serve_forever(args.port, args.host, on_ready=lambda url: status.info(
        "splitedge broker: listening on %s (anonymous clients; Ctrl-C stops it)", url))
    return 0
