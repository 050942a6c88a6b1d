"""`splitedge broker`: an in-process MQTT broker (amqtt) for trials without Mosquitto."""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--port", type=int, default=1883)
    p.add_argument("--host", default="127.0.0.1")


def run(args: argparse.Namespace) -> int:
    from splitedge.protocol.broker import serve_forever

    serve_forever(args.port, args.host)
    return 0
