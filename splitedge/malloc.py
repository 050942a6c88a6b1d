"""Cap glibc's malloc arenas in a running process, as MALLOC_ARENA_MAX would at start.

glibc gives every thread that allocates concurrently its own arena (up to 8 per core), and
memory freed in one arena is not reused by another. A sim with hundreds of device threads or a
torch process with worker threads then holds far more than it uses: the 200-device CIFAR sim
peaked at 18.4 GB RSS with the default and 9.0 GB with two arenas. `mallopt` has to run before
the threads start, so `splitedge` calls it first thing; an explicit MALLOC_ARENA_MAX wins.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os

M_ARENA_MAX = -8  # glibc malloc.h
DEFAULT_ARENAS = 2


def cap_arenas(arenas: int = DEFAULT_ARENAS) -> bool:
    """mallopt(M_ARENA_MAX, arenas) unless the environment already chose; False where not glibc."""
    if "MALLOC_ARENA_MAX" in os.environ:
        return False
    try:
        return bool(_libc().mallopt(M_ARENA_MAX, int(arenas)))
    except (OSError, AttributeError):  # musl, macOS, Windows: no glibc arenas to cap
        return False


def trim() -> bool:
    """malloc_trim(0): hand memory freed in every arena back to the system (glibc only). A
    virtual device calls it after parking its part, or the freed model lingers in RSS."""
    try:
        return bool(_libc().malloc_trim(0))
    except (OSError, AttributeError):
        return False


@functools.lru_cache(maxsize=1)
def _libc() -> ctypes.CDLL:
    """The C library, looked up once (find_library runs ldconfig; trim is called every round)."""
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
