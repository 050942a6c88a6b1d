"""The `splitedge` command. Subcommands import their role lazily, so `splitedge device --help`
(and the device itself with the onnx backend) work in the thin install without torch.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from typing import Sequence

# subcommand -> (module with add_arguments/run, one-line help)
COMMANDS = {
    "sim": ("splitedge.sim_cli", "run cloud, edges and devices through one broker (embedded by default)"),
    "device": ("splitedge.device.cli", "run a device agent"),
    "edge": ("splitedge.edge.cli", "run an edge aggregator"),
    "cloud": ("splitedge.cloud.cli", "run the cloud coordinator"),
    "broker": ("splitedge.broker_cli", "run the embedded MQTT broker (amqtt)"),
    "export": ("splitedge.exporters.cli", "export W_c and the global model to ONNX (fp32/fp16/int8) with parity"),
    "bench": ("splitedge.bench.cli", "run a bench suite (bandwidth, ram, throughput, accuracy) into JSON, markdown, plots"),
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The full parser, or with ``only`` the options of that one subcommand (the others are
    listed but their modules are not imported: a thin device process stays small)."""
    parser = argparse.ArgumentParser(prog="splitedge", description="Edge-device split learning over MQTT.")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="-v info, -vv debug")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, help_) in COMMANDS.items():
        p = sub.add_parser(name, help=help_, description=help_)
        if only is None or name == only:
            importlib.import_module(module).add_arguments(p)
        p.set_defaults(module=module)
    return parser


def _chosen_command(argv: Sequence[str]) -> str | None:
    """The subcommand in argv when one is named (after the global -v flags), else None."""
    for arg in argv:
        if arg in COMMANDS:
            return arg
        if not (arg.startswith("-v") and set(arg[1:]) == {"v"}) and arg != "--verbose":
            return None
    return None


def main(argv: Sequence[str] | None = None) -> int:
    from splitedge.malloc import cap_arenas

    cap_arenas()  # before any role starts its threads (splitedge/malloc.py says why)
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(_chosen_command(argv)).parse_args(argv)
    level = (logging.WARNING, logging.INFO, logging.DEBUG)[min(args.verbose, 2)]
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return int(importlib.import_module(args.module).run(args) or 0)
    except ModuleNotFoundError as exc:
        if exc.name in ("torch", "torchvision", "amqtt", "sklearn", "matplotlib", "safetensors"):
            print(f"splitedge {args.command} needs {exc.name}: pip install 'splitedge[all]'", file=sys.stderr)
            return 2
        raise
    except ValueError as exc:  # a caller mistake (bad setting, bad data path): say it, no traceback
        print(f"splitedge {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
