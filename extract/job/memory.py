"""glibc's allocator on CPU jobs: keep freed memory instead of returning it to the kernel.

torch allocates each large activation with a fresh ``mmap`` and returns it at once; on a CPU job the
page faults of faulting them in again every batch cost about a third of the CPU time
(benchmarks/RESULTS.md, "Hook overhead"). Raising glibc's mmap and trim thresholds keeps those blocks
in the heap for reuse. A user who set any ``MALLOC_*`` variable has chosen for themselves.

The threshold alone stops at 32 MiB (glibc refuses a larger ``M_MMAP_THRESHOLD``), and a batch's
activations are larger: 8192 tokens x 4096 x 4 bytes is 128 MiB. So mmap is turned off for allocations
(``M_MMAP_MAX`` 0) and every thread shares the main arena (``M_ARENA_MAX`` 1): a thread's own arena
is at most 64 MiB, and glibc serves anything larger from a fresh mmap whatever ``M_MMAP_MAX`` says;
the forward runs on a thread of its own. Measured on the job around a free forward (float16, width
4096): 1.16 million page faults per GB stored -> 0.56 million, system time 6.5 -> 1.3 CPU-s/GB
(benchmarks/RESULTS.md, "The writer against zarr alone"). Where the heap cannot grow (brk fails),
glibc still falls back to mmap.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform

# mallopt(3) parameters and the values measured in benchmarks/RESULTS.md
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -2, -3, -4, -8
KEEP_FREED = {
    M_MMAP_THRESHOLD: 32 * 2**20,  # glibc's largest; with M_MMAP_MAX 0 it only steers the dynamic threshold
    M_MMAP_MAX: 0,  # no allocation gets a mapping of its own: a batch's 128 MiB blocks come from the heap too
    M_ARENA_MAX: 1,  # one arena: a thread's arena serves nothing over 64 MiB but from a fresh mmap
    M_TRIM_THRESHOLD: 2**31 - 1,  # the largest an int holds: the heap's top is never trimmed in practice
    M_TOP_PAD: 256 * 2**20,  # grow the heap in 256 MiB steps
}


def keep_freed_memory(environ: os._Environ[str] | dict[str, str] = os.environ) -> bool:
    """Apply ``KEEP_FREED`` to this process (and the DataLoader workers it forks); ``False`` where it
    does not apply: not glibc, or the user set ``MALLOC_*`` variables."""
    if any(name.startswith("MALLOC_") for name in environ) or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    return all(libc.mallopt(param, value) == 1 for param, value in KEEP_FREED.items())
