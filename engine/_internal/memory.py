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

The bytes of kv files are read into private anonymous memory (``kvfile.read_hashed``), outside
that allocator. ``ReadBuffers`` keeps those mappings for the next read once nothing views them:
a 47 MB file read into new memory took 27 ms, into memory already mapped 4.4 ms (sha256 of the
same bytes 28 ms; 2-core AVX-512 EPYC VM), so a repeated graft paid more for its pages than for
its hash.
"""

from __future__ import annotations

import collections
import ctypes
import mmap
import threading
import weakref
from dataclasses import dataclass

import numpy as np

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


#: Free read buffers kept for later reads, at most this many bytes in all (``ReadBuffers.keep``).
KEEP_READ_BYTES = 1 << 30
#: A buffer is allocated rounded up to a multiple of this, or of an eighth of its size's power
#: of two where that is larger, so that files of nearly the same size share buffers.
_GRANULE = 1 << 20


@dataclass(frozen=True)
class ReadBuffer:
    """``view``: exactly the bytes asked for, writable, its first byte at the mapping's start.
    ``fresh``: the mapping (``view``'s memory) when its pages are new and may be populated
    (``madvise``) before they are written; None when they were mapped in by an earlier read, or
    for an empty buffer."""

    view: memoryview
    fresh: mmap.mmap | None


class ReadBuffers:
    """Private anonymous mappings that files are read into, reused once nothing views them.

    ``take`` hands out a mapping as a ``memoryview`` of an exporter (a numpy array over the
    mapping) that everything made from the view keeps alive: slices of it, tensors
    ``torch.frombuffer`` made of those. When the exporter dies, meaning no view and no tensor of
    the buffer is left, the mapping goes back on the free list; so a buffer is never handed out
    while anything can still read or write it. The free list keeps the most recently freed
    mappings up to ``keep`` bytes and unmaps the others when ``take`` next runs. A reused
    mapping still holds the bytes of its last read past ``view``'s end: only ``view`` is handed
    out, and the reader overwrites all of it.

    Thread-safe: a buffer comes back on whichever thread drops its last view, by one
    ``deque.append`` (atomic, no lock, so a garbage collection inside ``take`` cannot deadlock).
    """

    def __init__(self, keep: int = KEEP_READ_BYTES) -> None:
        self.keep = keep
        self._free: collections.deque[mmap.mmap] = collections.deque()
        self._lock = threading.Lock()

    def take(self, size: int) -> ReadBuffer:
        """A writable buffer of ``size`` bytes (contents unspecified)."""
        if size <= 0:
            return ReadBuffer(memoryview(bytearray()), None)
        with self._lock:
            free = self._drained()
            fits = [m for m in free if size <= len(m) <= _allocation(size)]
            memory = min(fits, key=len) if fits else None
            kept, total = [], 0
            # Newest first: those freed last are the likeliest to be asked for again.
            for m in reversed(free):
                if m is not memory and total + len(m) <= self.keep:
                    kept.append(m)
                    total += len(m)
            self._free.extendleft(kept)  # oldest first again; the dropped ones are unmapped as they die
        fresh = memory is None
        if memory is None:
            # Private, since mmap's default is shared memory, whose pages cost more to fault in;
            # not huge pages (MADV_HUGEPAGE): they read 94 MB in 18-28 ms but stalled 400+ ms
            # whenever the kernel had to compact memory first (after a recompute had churned it).
            flags = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
            memory = mmap.mmap(-1, _allocation(size), flags=flags) if flags else mmap.mmap(-1, _allocation(size))
        exporter = np.frombuffer(memory, dtype=np.uint8)
        finalizer = weakref.finalize(exporter, self._free.append, memory)
        finalizer.atexit = False
        return ReadBuffer(exporter.data[:size], memory if fresh else None)  # a view of the exporter, keeping it

    def free_bytes(self) -> int:
        """Bytes held on the free list now."""
        with self._lock:
            free = self._drained()
            self._free.extendleft(reversed(free))
        return sum(len(m) for m in free)

    def _drained(self) -> list[mmap.mmap]:
        """Everything on the free list, oldest first, taken off it (the lock is held)."""
        out = []
        while True:
            try:
                out.append(self._free.popleft())
            except IndexError:
                return out


def _allocation(size: int) -> int:
    """The bytes a buffer for ``size`` is allocated with (see ``_GRANULE``)."""
    step = max(_GRANULE, 1 << max(0, size.bit_length() - 4))
    return -(-size // step) * step


#: The process's read buffers (``kvfile.read_hashed``'s).
READ_BUFFERS = ReadBuffers()
