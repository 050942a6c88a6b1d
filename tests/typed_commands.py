"""Run `splitedge` commands as a user types them (from a doc, or as `splitedge data split` prints
them): each role in a process of its own from a scratch folder, its output in a log file, every
process gone when the test ends. Shared by tests/app/test_doc_commands.py and
tests/sim/test_split_federation.py."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from splitedge.protocol.children import spawn_tied


def argv_of(line: str, folder: Path) -> list[str]:
    """The words of `line` with $PWD as `folder`; `splitedge` is this interpreter's."""
    words = [os.path.expandvars(w.replace("$PWD", str(folder))) for w in shlex.split(line)]
    return [sys.executable, "-m", "splitedge", *words[1:]] if words[0] == "splitedge" else words


def node_name(line: str) -> str:
    """cloud, or the --id of an edge or device command."""
    words = shlex.split(line)
    return words[words.index("--id") + 1] if "--id" in words else words[1]


def environment() -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}


class Processes:
    """Commands started in `folder`; `wait()` for them all, `close()` kills what is left."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        (folder / "logs").mkdir(exist_ok=True)
        self.procs: dict[str, subprocess.Popen] = {}

    def run(self, line: str, timeout: float = 180.0) -> subprocess.CompletedProcess:
        done = subprocess.run(argv_of(line, self.folder), cwd=self.folder, capture_output=True, text=True,
                              timeout=timeout, env=environment())
        assert done.returncode == 0, f"`{line}` exited {done.returncode}: {done.stderr[-2000:]}"
        return done

    def start(self, line: str) -> subprocess.Popen:
        name = node_name(line)
        with open(self.folder / "logs" / f"{name}.log", "ab") as log:
            self.procs[name] = spawn_tied(argv_of(line, self.folder), cwd=self.folder, stdout=log,
                                          stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=environment())
        return self.procs[name]

    def log(self, name: str) -> str:
        path = self.folder / "logs" / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def logs(self) -> str:
        return "\n".join(f"--- {n}\n{self.log(n)[-3000:]}" for n in self.procs)

    def wait(self, timeout: float, names: list[str] | None = None) -> dict[str, int]:
        """Every process's exit status (or those of `names`); AssertionError with the logs when
        one is still running after `timeout` s."""
        deadline = time.monotonic() + timeout
        for name in names or list(self.procs):
            try:
                self.procs[name].wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise AssertionError(f"{name} still runs after {timeout:.0f} s:\n{self.logs()}") from None
        return {n: self.procs[n].returncode for n in names or self.procs}

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)

    def __enter__(self) -> Processes:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def scratch() -> Path:
    """A folder the broker's own user can enter (a root-started Mosquitto reads the password file
    as `mosquitto`), as a deployer's would be; pytest's tmp_path is 0700."""
    folder = Path(tempfile.mkdtemp(prefix="splitedge-typed-"))
    folder.chmod(0o755)
    return folder


def remove(folder: Path) -> None:
    shutil.rmtree(folder, ignore_errors=True)
