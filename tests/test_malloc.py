"""The arena cap is applied by mallopt in-process and leaves an explicit MALLOC_ARENA_MAX alone."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from splitedge.malloc import cap_arenas

CHECK = ("import sys; from splitedge.malloc import cap_arenas; sys.exit(0 if cap_arenas() else 3)")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt is Linux-only")
def test_cap_applies_without_the_environment_variable_and_defers_to_it() -> None:
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}
    assert subprocess.run([sys.executable, "-c", CHECK], env=env).returncode == 0
    assert subprocess.run([sys.executable, "-c", CHECK], env={**env, "MALLOC_ARENA_MAX": "4"}).returncode == 3


def test_cap_never_raises() -> None:
    assert cap_arenas() in (True, False)
