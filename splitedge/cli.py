"""The `splitedge` command. Subcommands import their role lazily, so `splitedge device --help`
(and the device itself with the onnx backend) work in the thin install without torch.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import logging
import signal
import sys
import threading
from typing import Any, Sequence

from splitedge.install import installed, missing_command

# subcommand -> (module with add_arguments/run, one-line help)
COMMANDS = {
    "sim": ("splitedge.sim.cli", "run cloud, edges and devices through one broker (embedded by default)"),
    "device": ("splitedge.device.cli", "run a device agent"),
    "edge": ("splitedge.edge.cli", "run an edge aggregator"),
    "cloud": ("splitedge.cloud.cli", "run the cloud coordinator"),
    "broker": ("splitedge.broker_cli", "run the embedded MQTT broker (amqtt)"),
    "export": ("splitedge.export_cli", "export W_c and the global model to ONNX (fp32/fp16/int8) with parity"),
    "bench": ("splitedge.bench.cli", "run a bench suite (bandwidth, ram, throughput, accuracy) into JSON, markdown, plots"),
    "data": ("splitedge.data_cli", "cut a data set into per-device shards and check them"),
    "peers": ("splitedge.peers_cli", "plan a run with no cloud: peer graph, its broker ACL, the devices' commands"),
    "provision": ("splitedge.provision.cli", "write a bundle per node (config, login, keys, data, systemd unit) and a "
                  "broker config that serves every run of them"),
    "keys": ("splitedge.keys_cli", "make the Ed25519 keys that sign each node's messages (--sign-key/--verify-keys)"),
    "watch": ("splitedge.watch_cli", "show a run live from its broker, read-only: nodes, rounds, accuracy, costs, exits"),
}


HEAVY = ("torch", "torchvision", "amqtt", "sklearn", "matplotlib", "safetensors", "onnx", "cryptography",
         "prometheus_client")
"""Optional dependencies of the [all] extra: a missing one is an install step, not a bug."""
EXTRA_OF = {"cryptography": "sign", "prometheus_client": "metrics"}
"""Optional dependencies that also have a small extra of their own (a thin device installs that)."""


class Parser(argparse.ArgumentParser):
    """A command-line mistake is one line that says what to fix (argparse would print the whole
    usage first), and exit status 2; no abbreviated flags are taken (`--round` is not `--rounds`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **{"allow_abbrev": False, **kwargs})

    commands: dict[str, argparse.ArgumentParser] = {}

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def parse_args(self, args: Any = None, namespace: Any = None) -> argparse.Namespace:  # type: ignore[override]
        """As argparse's, but an unknown flag is named with its subcommand's help and the
        nearest flag it has (argparse blamed the top-level parser, whose help lists none)."""
        ns, extras = self.parse_known_args(args, namespace)
        if extras:
            command = getattr(ns, "command", None)
            sub = self.commands.get(command or "", self)
            flags = [o for a in sub._actions for o in a.option_strings]  # noqa: SLF001 - argparse has no public list
            near = [m for x in extras if x.startswith("--")
                    for m in difflib.get_close_matches(x.split("=")[0], flags, 1, cutoff=0.8)]
            hint = f"; did you mean {', '.join(near)}?" if near else ""
            sub.error(f"unrecognized arguments: {' '.join(extras)}{hint}")
        return ns


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Each default shown once: not when the help already says it, nor when there is none."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or any(action.default is v for v in (None, argparse.SUPPRESS, False)):
            return text
        return super()._get_help_string(action)


def build_parser(only: str | None = None, argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The full parser, or with ``only`` the options of that one subcommand (the others are
    listed but their modules are not imported: a thin device process stays small). A role's
    flags take their defaults from its SPLITEDGE_* variables and ``--config`` file when
    ``argv`` is given (splitedge/cli_defaults.py)."""
    from splitedge import __version__
    from splitedge.cli_defaults import ROLES, apply
    from splitedge.protocol.codec import PROTOCOL_VERSION

    parser = Parser(prog="splitedge", description="Edge-device split learning over MQTT.")
    parser.add_argument("-v", "--verbose", action="count", default=0,
                        help="-v: info logs, -vv: debug logs and full tracebacks")
    version = f"splitedge {__version__}, wire protocol {PROTOCOL_VERSION} (PROTOCOL.md)"
    parser.add_argument("--version", action="version", version=version)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    parser.commands = sub.choices
    for name, (module, help_) in COMMANDS.items():
        p = sub.add_parser(name, help=help_, description=help_, formatter_class=HelpFormatter)
        p.add_argument("--version", action="version", version=version)
        if name == only or only is None and installed(module):  # the thin install lacks some (install.py)
            importlib.import_module(module).add_arguments(p)
            if name in ROLES:
                p.add_argument("--config", metavar="TOML", help="settings from this file's [common] and "
                               f"[{name}] sections (env SPLITEDGE_CONFIG); every flag also from SPLITEDGE_<FLAG>, "
                               "e.g. SPLITEDGE_BROKER; a flag given here wins, then the variable, then the file")
                if argv is not None and name == only:
                    apply(p, name, argv, every_role=role_variables)
        p.set_defaults(module=module)
    return parser


def role_variables() -> set[str]:
    """The SPLITEDGE_* variable of every flag of cloud, edge and device (their parsers import no torch)."""
    from splitedge.cli_defaults import ROLES, env_name, settable

    return {env_name(a) for role in ROLES if installed(COMMANDS[role][0])  # the thin install has the device's
            for a in settable(build_parser(role).commands[role]).values()}


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
    command = _chosen_command(argv)
    missing = command and missing_command(command, COMMANDS[command][0])
    if missing:  # a role the thin install does not hold
        print(missing, file=sys.stderr)
        return 2
    _method_plugin(argv)
    try:
        parser = build_parser(command, argv)
    except ValueError as exc:  # a bad --config file or SPLITEDGE_* variable: before any work
        print(f"splitedge {command}: error: {exc}", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    configure_logging(args.verbose)
    try:
        from splitedge.runtime.plugin_args import use_plugins

        use_plugins(getattr(args, "plugin", None) or [])  # from a --config file or SPLITEDGE_PLUGIN too
        if getattr(args, "metric", None):
            from splitedge.methods.metrics.extra import use_metric

            for path in args.metric:
                use_metric(path)
    except ValueError as exc:
        print(f"splitedge {command}: error: {exc}", file=sys.stderr)
        return 2
    previous = _terminate_like_interrupt()
    try:
        return int(importlib.import_module(args.module).run(args) or 0)
    except KeyboardInterrupt:
        print(f"splitedge {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # one line that says what to fix; the traceback only with -vv
        if args.verbose >= 2:
            raise
        code, text = explain(exc, args.command)
        print(text, file=sys.stderr)
        return code
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _method_plugin(argv: Sequence[str]) -> None:
    """A method plug-in named by import path (`--method` or `--plugin package.module:Class`),
    registered before the parser is built so its settings get their flags in `--help`; one
    that does not load is left to the flag's own check, which says why."""
    from splitedge.protocol.plugins import is_import_path

    for i, arg in enumerate(argv):
        for flag in ("--method", "--plugin"):
            value = argv[i + 1] if arg == flag and i + 1 < len(argv) else arg.partition("=")[2] \
                if arg.startswith(flag + "=") else None
            if is_import_path(value):
                from splitedge.methods.registry import use_method

                try:
                    use_method(value)
                except ValueError:
                    pass


def _terminate_like_interrupt() -> Any:
    """SIGTERM (`kill`, `timeout`, a container stop) unwinds like Ctrl-C, so the brokers, worker
    processes and files a command started are stopped and closed instead of left behind (the
    default SIGTERM ends Python without running any cleanup). Returns the previous handler, or
    None off the main thread, where handlers cannot be set."""
    if threading.current_thread() is not threading.main_thread():
        return None
    return signal.signal(signal.SIGTERM, signal.default_int_handler)


def explain(exc: BaseException, command: str) -> tuple[int, str]:
    """(exit code, one line) for an exception that ends a command: 2 for what the user can fix
    (a setting, a path, a missing extra), 1 for a run that failed."""
    top = (getattr(exc, "name", None) or "").split(".")[0]  # amqtt.broker missing: amqtt is
    if isinstance(exc, ModuleNotFoundError) and top in HEAVY:
        hint = "; a device without torch runs with --backend onnx" if top == "torch" and command == "device" else \
            " (for --metrics-port)" if top == "prometheus_client" else ""
        return 2, f"splitedge {command} needs {top}: pip install 'splitedge[{EXTRA_OF.get(top, 'all')}]'{hint}"
    if isinstance(exc, (ValueError, FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError)):
        return 2, f"splitedge {command}: error: {exc}"
    if isinstance(exc, (ConnectionError, TimeoutError, OSError)):
        return 1, f"splitedge {command}: {exc}"
    return 1, f"splitedge {command}: failed: {type(exc).__name__}: {exc} (run with -vv for the traceback)"


def configure_logging(verbose: int) -> None:
    """Warnings (or more with -v) as log lines on stderr; the roles' status lines (logger
    "splitedge.status": started, joined, round k/N, stopped) always, once, on stdout, each
    with its time of day."""
    level = (logging.WARNING, logging.INFO, logging.DEBUG)[min(verbose, 2)]
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    status = logging.getLogger("splitedge.status")
    status.setLevel(logging.INFO)
    status.propagate = False  # once, on stdout, whatever -v says (with -v they were printed twice)
    if not any(isinstance(h, _StdoutHandler) for h in status.handlers):
        handler = _StdoutHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", datefmt="%H:%M:%S"))
        status.addHandler(handler)


class _StdoutHandler(logging.StreamHandler):
    """Writes to whatever sys.stdout is at the time (a test may swap it between commands)."""

    def __init__(self) -> None:
        super().__init__(sys.stdout)

    @property  # type: ignore[override]
    def stream(self) -> object:
        return sys.stdout

    @stream.setter
    def stream(self, value: object) -> None:
        pass
