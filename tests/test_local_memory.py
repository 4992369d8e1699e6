"""The pool keeps freed memory for the next batch (glibc), instead of faulting it in again."""

from __future__ import annotations

import ctypes.util
import platform
import subprocess
import sys

import pytest

# Touch 24 MiB from malloc, free it, and print how much of it the process still holds.
PROBE = """
import ctypes, sys
from local_models.memory import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory() and keep_freed_memory()  # once per process, then a no-op
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096
size = 24 << 20
p = libc.malloc(size)
ctypes.memset(p, 1, size)
held = rss()
libc.free(p)
print(held - rss())
"""


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc"
                    or ctypes.util.find_library("c") is None, reason="glibc only")
@pytest.mark.parametrize("mode", ["default", "keep"])
def test_freed_blocks_stay_in_the_process_once_kept(mode: str) -> None:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True)
    returned = int(out.stdout)
    if mode == "default":
        assert returned >= 20 << 20  # glibc hands a fresh 24 MiB block straight back to the kernel
    else:
        assert returned < 1 << 20  # kept for the next batch
