"""Keep the forward passes' freed memory in the process instead of handing it back each batch.

torch's CPU tensors come from malloc. glibc returns freed blocks at the top of
a heap to the kernel once they pass its trim threshold (and serves the larger
ones from fresh ``mmap`` regions), so each batch's activations fault their
pages in again, zeroed by the kernel: about 1 ms of system CPU per text in a
gateway serving MiniLM on two cores (a tenth of the forward), where a batch
on memory the process kept spends almost none. Fixing both thresholds (which
also stops glibc moving them) keeps that memory for the next batch; the
process holds its peak working set, which a model server holds anyway.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# Blocks up to this size come from the heap (32 MiB: glibc's own ceiling for its dynamic threshold).
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 1 << 30  # free memory kept at a heap's top before any goes back to the kernel

_done = False


def keep_freed_memory() -> bool:
    """Set glibc's thresholds once per process; False where the C library is not glibc."""
    global _done
    if _done:
        return True
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and others: no mallopt
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    if not ok:
        log.info("malloc kept its own thresholds (mallopt refused them)")
    _done = ok
    return ok
