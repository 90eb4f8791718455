"""In-memory caches of immutable things the read path serves: what the fast reads stand on.

Blobs and log entries never change once stored (a blob is named by its digest; an entry's index
and envelope are fixed once durable), so what was read once can answer again without a thread
hop or a database query. Each cache is bounded by entry count and by the bytes it holds, evicts
the least recently used entry first, and is safe to use from the event loop and worker threads
alike (one short lock per call, no I/O under it).

- ``BoundedLru``: the cache itself.
- ``EnvelopeCache``: entries' envelope bytes and digests by index and by digest (``GET
  /v1/entries/{ref}/envelope``, and its ``If-None-Match`` 304, answered without the database).

The blob store keeps its own ``BoundedLru`` of verified blob sizes (blobs.py).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")

#: Envelope bytes the cache may hold in all (the largest envelope is --max-envelope-bytes).
ENVELOPE_CACHE_BYTES = 32 << 20
#: Envelopes the cache may hold.
ENVELOPE_CACHE_ENTRIES = 65536


class BoundedLru(Generic[K, V]):
    """A least-recently-used map of at most ``max_entries`` entries and ``max_weight`` in weight.

    Each ``put`` names its entry's weight (its bytes, or 1); an entry heavier than ``max_weight``
    is not kept. ``max_entries`` 0 makes a cache that keeps nothing.
    """

    def __init__(self, max_entries: int, max_weight: int) -> None:
        self.max_entries = max_entries
        self.max_weight = max_weight
        self._items: OrderedDict[K, tuple[V, int]] = OrderedDict()
        self._weight = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._items)

    def get(self, key: K) -> V | None:
        """The value under ``key`` (now the most recently used), or None."""
        with self._lock:
            found = self._items.get(key)
            if found is None:
                return None
            self._items.move_to_end(key)
            return found[0]

    def put(self, key: K, value: V, weight: int = 1) -> None:
        """Keep ``value`` under ``key``, evicting the least recently used entries past the bounds."""
        if self.max_entries <= 0 or weight > self.max_weight:
            return
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self._weight -= old[1]
            self._items[key] = (value, weight)
            self._weight += weight
            while len(self._items) > self.max_entries or self._weight > self.max_weight:
                _, (_, w) = self._items.popitem(last=False)
                self._weight -= w

    def pop(self, key: K) -> None:
        """Forget ``key`` (nothing when it is not held)."""
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self._weight -= old[1]


@dataclass(frozen=True)
class CachedEnvelope:
    """One entry's envelope: its digest (``sha256:<hex>``, the ETag) and its exact bytes."""

    digest: str
    data: bytes


class EnvelopeCache:
    """Envelopes by the name ``GET /v1/entries/{ref}/envelope`` was given (a decimal index, or the
    envelope digest) and by their digest. Filled only from what the database returned for a
    logged entry: the log is append-only, so what an index named once it names for good."""

    def __init__(self, max_entries: int = ENVELOPE_CACHE_ENTRIES, max_bytes: int = ENVELOPE_CACHE_BYTES) -> None:
        self._by_ref: BoundedLru[str, CachedEnvelope] = BoundedLru(max_entries, max_bytes)

    def get(self, ref: str) -> CachedEnvelope | None:
        """The envelope ``ref`` names (``"12"`` or ``"sha256:..."``), when cached."""
        return self._by_ref.get(ref)

    def put(self, ref: str, digest: str, data: bytes) -> CachedEnvelope:
        """Remember the envelope ``ref`` named, under ``ref`` and under its digest."""
        cached = CachedEnvelope(digest, data)
        # Weighed once per name: the two keys share the bytes, but the bound stays simple and safe.
        self._by_ref.put(ref, cached, len(data))
        if ref != digest:
            self._by_ref.put(digest, cached, len(data))
        return cached
