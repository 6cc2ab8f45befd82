"""glibc allocator settings for processes that move large payloads (the CLI's server
and worker processes; the library never changes them on its own).

Why: glibc serves every allocation above its mmap threshold (128 KiB, adaptive up to
32 MiB) with a fresh ``mmap`` and returns it on free, so each 4 MiB chunk message gRPC
and Python allocate faults every page in again, and a copy into fresh pages is several
times slower than a copy into reused ones. ``M_MMAP_MAX = 0`` keeps large blocks on the
heap and a high ``M_TRIM_THRESHOLD`` keeps freed memory for reuse. The cost: freed
memory is not returned to the OS, so RSS stays at its peak (the server's peak is bounded
by its receive budget anyway).

``M_ARENA_MAX = 1``: by default each thread that allocates gets its own arena (up to
8 per core), and memory freed in one arena is not reused by threads of another, so the
payload-sized blocks that gRPC's threads allocate pile up in many arenas; with one arena
the server's peak RSS under many concurrent pushes and pulls stays near θ + momentum +
receive budget + pull snapshots (``python -m asyncdiloco.bench.perf.bench_server``
measures it; docs/performance.md has the figures). The GIL serialises most allocations
anyway. Equivalent to the environment ``MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=...
MALLOC_ARENA_MAX=1`` (which must be set before the process starts).
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
