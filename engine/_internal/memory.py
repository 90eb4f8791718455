"""The process's allocator, tuned once for a model's working set.

A graft allocates its state afresh: per layer a paged pool and the cache's keys and values, a few
MiB each, hundreds of MiB in all at 4K tokens. glibc hands out blocks of that size from ``mmap``
until its threshold adapts, and gives freed memory at the top of its heap back to the kernel past
a trim threshold of a few MiB; either way the next graft touches new pages, and on a virtual
machine each 4 KiB page fault costs microseconds (a 4K-token float32 restore spent more time
faulting its pages in than copying them). Loading a model therefore raises both thresholds: blocks
up to ``MMAP_THRESHOLD`` come from the heap and freed memory stays there for the next request, as
a serving engine's preallocated pool would (llama.cpp and vLLM allocate their KV memory once).
Peak memory is unchanged; the process keeps what it once used.

Only glibc has ``mallopt``; elsewhere this does nothing.
"""

from __future__ import annotations

import ctypes
import threading

#: glibc's ``mallopt`` parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
#: Blocks up to this size come from the heap (glibc's largest allowed threshold on 64-bit).
MMAP_THRESHOLD = 32 << 20
#: Free memory at the heap's top kept, not returned to the kernel.
TRIM_THRESHOLD = 1 << 30

_LOCK = threading.Lock()
_done = False


def retain_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds (once per process); whether they were set."""
    global _done
    with _LOCK:
        if _done:
            return True
        # The process's own symbols: libc is among them wherever glibc is, with no library search.
        mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
        if mallopt is None:
            return False
        # mallopt returns 1 on success; a refused value leaves glibc's default in place.
        _done = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) & bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
        return _done
