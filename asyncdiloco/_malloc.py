"""glibc allocator settings for processes that move large payloads (the CLI's server and
worker processes; the library never changes them on its own): ``M_MMAP_MAX = 0`` and a
high ``M_TRIM_THRESHOLD`` keep large blocks on the heap for reuse (a fresh mmap per 4 MiB
chunk faults every page in again; the cost is RSS that stays at its peak), and
``M_ARENA_MAX = 1`` keeps gRPC's threads from piling payload-sized blocks up in many
arenas (docs/performance.md "Server costs and memory"). The same as
``MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=... MALLOC_ARENA_MAX=1`` set before the
process starts.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8
_TRIM_THRESHOLD_BYTES = 1 << 30  # keep up to 1 GiB of freed heap for reuse


def keep_large_blocks() -> bool:
    """Apply the settings above; True when they took effect (glibc only, else a no-op)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and others have no mallopt
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = all(
        mallopt(option, value) == 1
        for option, value in ((_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, _TRIM_THRESHOLD_BYTES), (_M_ARENA_MAX, 1))
    )
    log.debug(
        "glibc mallopt (no mmap for large blocks, trim threshold %d bytes, one arena): %s", _TRIM_THRESHOLD_BYTES, ok
    )
    return ok
