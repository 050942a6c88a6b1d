"""The arena cap is applied by mallopt in-process and leaves an explicit MALLOC_ARENA_MAX alone.

Observed, not just called: a fresh interpreter keeps THREADS threads alive at once, each having
malloc'd a few blocks, and counts the arenas glibc reports in malloc_info's XML (one
`<heap nr=` per arena, the main one included). Without a cap every such thread gets its own
arena (glibc allows 8 per core); after cap_arenas() there are at most DEFAULT_ARENAS.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from splitedge.malloc import DEFAULT_ARENAS

THREADS = 8

# argv[1]: "cap" calls cap_arenas() before the threads start. Prints "<returned> <arenas>".
PROBE = f"""
import ctypes, sys, threading

libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.open_memstream.restype = ctypes.c_void_p
libc.open_memstream.argtypes = [ctypes.POINTER(ctypes.c_char_p), ctypes.POINTER(ctypes.c_size_t)]
libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
libc.fclose.argtypes = [ctypes.c_void_p]

returned = None
if sys.argv[1] == "cap":
    from splitedge.malloc import cap_arenas
    returned = cap_arenas()

allocated, release = threading.Barrier({THREADS} + 1), threading.Event()

def work():
    blocks = [libc.malloc(4096) for _ in range(64)]  # small: from the thread's arena, not mmap
    allocated.wait()
    release.wait()  # alive until counted: an exited thread's arena is handed to the next one
    for b in blocks:
        libc.free(b)

threads = [threading.Thread(target=work) for _ in range({THREADS})]
for t in threads:
    t.start()
allocated.wait(timeout=30)
buf, size = ctypes.c_char_p(), ctypes.c_size_t()
stream = libc.open_memstream(ctypes.byref(buf), ctypes.byref(size))
assert stream and libc.malloc_info(0, stream) == 0
libc.fclose(stream)
xml = ctypes.string_at(buf, size.value).decode()
release.set()
for t in threads:
    t.join()
print(returned, xml.count("<heap nr="))
"""

glibc_only = pytest.mark.skipif(not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc",
                                reason="malloc arenas, mallopt and malloc_info are glibc's")


def probe(mode: str, **env: str) -> tuple[str, int]:
    """(what cap_arenas returned, arenas with THREADS threads alive) in a fresh interpreter."""
    base = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}
    out = subprocess.run([sys.executable, "-c", PROBE, mode], env={**base, **env}, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    returned, arenas = out.stdout.split()
    return returned, int(arenas)


@glibc_only
def test_cap_arenas_limits_the_arenas_that_threads_get() -> None:
    returned, arenas = probe("nocap")
    # One per thread plus the main one, up to glibc's 8 per core: at least THREADS on any box.
    assert returned == "None" and arenas >= THREADS > DEFAULT_ARENAS
    assert probe("cap") == ("True", DEFAULT_ARENAS)


@glibc_only
def test_an_explicit_malloc_arena_max_wins_over_the_cap() -> None:
    assert probe("cap", MALLOC_ARENA_MAX="4") == ("False", 4)  # not capped down to DEFAULT_ARENAS
