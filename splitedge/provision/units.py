"""The systemd unit of a provisioned node: a template, `splitedge-<role>@.service`, whose instance
is the run id (`systemctl start splitedge-device@run-7`), started with the bundle's config.

The service settings are those of deploy/splitedge-<role>.service, the units a hand-made install
uses (tests/app/test_provision.py holds the two to the same directives); only how the node gets its
settings differs: `--config` and `--run %i` instead of an env file.
"""

from __future__ import annotations

from pathlib import PurePosixPath

CONFIG = "splitedge.toml"
"""The config file in every bundle."""
VENV = "/opt/splitedge/venv"
STATE = "/var/lib/splitedge"

HARDENING = ("NoNewPrivileges=yes", "ProtectSystem=strict", "ProtectHome=yes", "PrivateTmp=yes",
             "ProtectKernelTunables=yes", "ProtectKernelModules=yes", "ProtectControlGroups=yes",
             "RestrictAddressFamilies=AF_INET AF_INET6 AF_UNIX", "LockPersonality=yes")

ROLE = {
    "device": {
        "what": "device agent",
        "after": "network-online.target time-sync.target",
        "restart": ["Restart=always", "RestartPreventExitStatus=2", "RestartSec=10"],
        "environment": "PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1 MALLOC_ARENA_MAX=2",
        "limits": ["MemoryHigh=896M", "MemoryMax=1G", "Nice=5"],
        "stop": "20", "retry_for_ever": True,
    },
    "edge": {
        "what": "edge aggregator",
        "after": "network-online.target time-sync.target mosquitto.service",
        "restart": ["Restart=always", "RestartPreventExitStatus=2", "RestartSec=5"],
        "environment": "PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2",
        "limits": ["MemoryHigh=1280M", "MemoryMax=1536M"],
        "stop": "20", "retry_for_ever": True,
    },
    "cloud": {
        "what": "cloud coordinator",
        "after": "network-online.target mosquitto.service",
        "restart": ["Restart=no"],
        "environment": "PYTHONUNBUFFERED=1",
        "limits": ["MemoryMax=8G"],
        "stop": "60", "retry_for_ever": False,
    },
}


def unit_name(role: str) -> str:
    return f"splitedge-{role}@.service"


def exec_start(role: str, home: str, venv: str = VENV) -> str:
    """The node's command: its bundle's config and the run of the unit's instance. The edge keeps
    its state and the cloud its records in a folder per run, so runs never resume each other."""
    config = PurePosixPath(home) / CONFIG
    per_run = {"edge": f" --state-dir {STATE}/state/%i", "cloud": f" --out {STATE}/runs/%i"}.get(role, "")
    return f"{venv}/bin/splitedge -v {role} --config {config} --run %i{per_run}"


def unit_text(role: str, home: str, venv: str = VENV) -> str:
    """The unit file of a `role` node whose bundle is installed at `home` (its config, keys and data)."""
    r = ROLE[role]
    return "\n".join([
        f"# splitedge {r['what']}, one instance per run: systemctl enable --now splitedge-{role}@<run>",
        f"# Written by `splitedge provision`; its settings are {home}/{CONFIG} (deploy/README.md, \"Provisioning\").",
        "[Unit]",
        f"Description=splitedge {r['what']} (run %i)",
        f"After={r['after']}",
        "Wants=network-online.target",
        *(["StartLimitIntervalSec=0"] if r["retry_for_ever"] else []),
        "",
        "[Service]",
        "Type=simple",
        "User=splitedge",
        "Group=splitedge",
        f"Environment={r['environment']}",
        f"ExecStart={exec_start(role, home, venv)}",
        "# As deploy/splitedge-*.service: a settings mistake exits 2 and stays stopped; a finished run exits 0",
        "# (a device or edge then waits for the next run of its id).",
        *r["restart"],
        "KillSignal=SIGINT",
        "SuccessExitStatus=130",
        f"TimeoutStopSec={r['stop']}",
        f"WorkingDirectory={STATE}",
        "StateDirectory=splitedge",
        *r["limits"],
        *HARDENING,
        "",
        "[Install]",
        "WantedBy=multi-user.target",
    ]) + "\n"
