"""Mosquitto started from the files `splitedge data split --acl` writes, the way deploy/README.md
says: on its own (`mosquitto -c shards/broker.conf`) or dropped into the include_dir of a main
config that has a listener of its own. Free ports only, never 1883. Shared by
tests/broker/test_broker_config_dropin.py and tests/protocol/test_identity_binding.py."""

from __future__ import annotations

import os
import pwd
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from splitedge.cli import main
from splitedge.protocol.broker import free_port, wait_port
from splitedge.protocol.children import spawn_tied

BROKER_USER = "mosquitto"  # Mosquitto's own user once started as root (Debian, Raspberry Pi OS)
LISTEN = re.compile(r"Opening ipv[46] listen socket on port (\d+)")


def as_root() -> bool:
    return hasattr(os, "geteuid") and os.geteuid() == 0


def broker_user_exists() -> bool:
    try:
        pwd.getpwnam(BROKER_USER)
        return True
    except KeyError:
        return False


@dataclass
class Shards:
    folder: Path
    run: str
    port: int  # the listener broker.conf opens

    def password(self, login: str) -> str:
        return (self.folder / "logins" / f"{login}.password").read_text().strip()

    def url(self, login: str, *, with_password: bool = True) -> str:
        secret = f":{self.password(login)}" if with_password else ""
        return f"mqtt://{login}{secret}@127.0.0.1:{self.port}"

    def chown_line(self) -> list[str]:
        """The ownership command broker.conf's comment gives, without `sudo` (we are root)."""
        for line in (self.folder / "broker.conf").read_text().splitlines():
            if line.startswith("#") and " chown " in line:
                return line.lstrip("# ").removeprefix("sudo ").split()
        raise AssertionError("broker.conf gives no chown line for the password file")

    def make_readable(self) -> None:
        """What broker.conf says to do before starting the broker: a root-started Mosquitto reads
        the password file as its own user. Not root: the broker stays our user, nothing to do."""
        if as_root() and broker_user_exists():
            subprocess.run(self.chown_line(), check=True)


@contextmanager
def generated_shards(run: str, *extra: str) -> Iterator[Shards]:
    """`data split --acl RUN` into a folder the broker's user can enter (as a deployer's would be)."""
    home = Path(tempfile.mkdtemp(prefix="splitedge-dropin-"))
    home.chmod(0o755)
    port = free_port()
    try:
        assert main(["data", "split", "--dataset", "digits", "--devices", "2", "--max-train", "100",
                     "--out", str(home / "shards"), "--acl", run, "--broker", f"mqtt://127.0.0.1:{port}",
                     "--listener", f"127.0.0.1:{port}", *extra]) == 0
        yield Shards(home / "shards", run, port)
    finally:
        shutil.rmtree(home, ignore_errors=True)


class Broker:
    """A mosquitto process on `config`, its log in a file; ports it opened read from its log."""

    def __init__(self, config: Path, wait_for: int) -> None:
        self.config, self.wait_for = config, wait_for
        self.log = config.with_suffix(".log")
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 10.0) -> "Broker":
        with open(self.log, "ab") as log:
            self.proc = spawn_tied(["mosquitto", "-c", str(self.config)], stdout=log, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mosquitto -c {self.config} exited {self.proc.returncode}: {self.log_text()}")
            if wait_port("127.0.0.1", self.wait_for, 0.2):
                time.sleep(0.3)  # every listener is open before the one we waited for answers; be sure
                return self
        raise RuntimeError(f"mosquitto -c {self.config} did not listen on {self.wait_for}: {self.log_text()}")

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def ports(self) -> set[int]:
        return {int(p) for p in LISTEN.findall(self.log_text())}

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)

    def __enter__(self) -> "Broker":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def standalone(shards: Shards) -> Broker:
    """deploy/README.md: `mosquitto -c shards/broker.conf`."""
    return Broker(shards.folder / "broker.conf", shards.port)


def included(shards: Shards, admin_port: int) -> Broker:
    """deploy/README.md: broker.conf copied into the include_dir of a main config that keeps a
    listener of its own on 127.0.0.1 (for administration)."""
    conf_d = shards.folder.parent / "conf.d"
    conf_d.mkdir(exist_ok=True)
    shutil.copy(shards.folder / "broker.conf", conf_d / "splitedge.conf")
    main_conf = shards.folder.parent / "mosquitto.conf"
    main_conf.write_text(f"listener {admin_port} 127.0.0.1\ninclude_dir {conf_d}\n")
    return Broker(main_conf, shards.port)
