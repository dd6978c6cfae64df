"""glibc's allocator on CPU jobs: keep freed memory instead of returning it to the kernel.

torch allocates each large activation with a fresh ``mmap`` and returns it at once; on a CPU job the
page faults of faulting them in again every batch cost about a third of the CPU time
(benchmarks/RESULTS.md, "Hook overhead"). Raising glibc's mmap and trim thresholds keeps those blocks
in the heap for reuse. A user who set any ``MALLOC_*`` variable has chosen for themselves.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform

# mallopt(3) parameters and the values measured in benchmarks/RESULTS.md
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
KEEP_FREED = {
    M_MMAP_THRESHOLD: 32 * 2**20,  # blocks up to 32 MiB come from the heap, not a fresh mmap
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
