"""The sequencer: verified publishes queued, then appended to the log in batches (group commit).

What Trillian's sequencer and Tessera do. Everything about a publish that does not depend on the
log's order is checked before it is queued, concurrently, without the database lock
(``Publisher.prepare_publish``). One thread, owned by the app's lifespan, then takes the queued
publishes in arrival order and hands them to ``Publisher.sequence_batch`` in batches: one
database transaction, one Merkle update, one signed checkpoint and one ``signed-head.json``
fsync per batch. Each publish's ``Future`` is resolved (its entry, inclusion proof and the
batch's checkpoint, or its own error) only once its batch is durable.

A batch starts with the oldest queued publish and takes every further one that arrives within
``batch_wait_ms`` of it, up to ``batch_max_entries`` publishes or ``MAX_BATCH_BYTES`` of
envelopes (a batch always takes its first publish, however large). It waits only while
publishes are on their way (inside ``arriving``: the app counts each from its request's start
to its ``submit``): with none on its way the batch is closed at once, so a lone publisher waits
for nothing, and a batch grows by what is being verified while the previous one commits. With
``batch_wait_ms`` 0 a batch is what queued up while the previous one was committing.

The queue holds at most ``max_publish_queue`` publishes and ``max_publish_queue_bytes`` of
envelopes (a publish larger than that still enters an empty queue); ``submit`` past
either (or once ``stop`` began) raises ``PublishQueueFullError`` (503 with Retry-After) and
queues nothing. ``stop`` refuses new publishes, lets the thread finish every queued one, and
joins it.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from ..errors import PublishQueueFullError, RegistryError

logger = logging.getLogger("kvgraft.registry")

#: Envelope bytes one batch holds at most (beyond its first publish): one transaction's size.
MAX_BATCH_BYTES = 64 * 1024 * 1024
#: Retry-After of a 503 for a full queue: a batch takes milliseconds, a full queue a second or so.
RETRY_AFTER_SECONDS = 1


class Sized(Protocol):
    """What the sequencer needs to know of a queued publish: its envelope's size in bytes."""

    @property
    def size(self) -> int: ...


Item = TypeVar("Item", bound=Sized)
Result = TypeVar("Result")


@dataclass
class _Queued(Generic[Item, Result]):
    item: Item
    future: Future[Result]


class Sequencer(Generic[Item, Result]):
    """A bounded queue of publishes and the one thread that sequences them in batches.

    ``sequence`` is called with each batch, in arrival order, from the sequencer's thread only;
    it returns one outcome per item, in order: the result, or the ``RegistryError`` that item
    fails with. An exception it raises fails every item of the batch (logged with its traceback).
    """

    def __init__(
        self,
        sequence: Callable[[Sequence[Item]], Sequence[Result | RegistryError]],
        *,
        batch_max_entries: int,
        batch_wait_ms: float,
        max_queue: int,
        max_queue_bytes: int,
    ) -> None:
        self._sequence = sequence
        self._batch_max = batch_max_entries
        self._wait = batch_wait_ms / 1000.0
        self._max_queue = max_queue
        self._max_queue_bytes = max_queue_bytes
        self._queue: collections.deque[_Queued[Item, Result]] = collections.deque()
        self._queued_bytes = 0
        self._cond = threading.Condition()
        self._stopping = False
        # Publishes between their request's start and their submit (see ``arriving``).
        self._arriving = 0
        self._thread = threading.Thread(target=self._run, name="kvgraft-sequencer", daemon=True)
        #: Batches sequenced since start, and publishes in them (figures for logs and tests).
        self.batches = 0
        self.sequenced = 0

    @property
    def queued(self) -> int:
        """Publishes waiting for a batch now."""
        with self._cond:
            return len(self._queue)

    def start(self) -> None:
        """Start the thread."""
        self._thread.start()

    def submit(self, item: Item) -> Future[Result]:
        """Queue ``item``; its future resolves once its batch is durable (or it failed).

        ``PublishQueueFullError`` when the queue is at its bound, by count or by bytes, or the
        sequencer is stopping: nothing was queued.
        """
        future: Future[Result] = Future()
        with self._cond:
            if self._stopping:
                raise PublishQueueFullError(
                    "the registry is shutting down and takes no more publishes",
                    retry_after=RETRY_AFTER_SECONDS,
                    hint="post the envelope again once the registry is back (publishing is idempotent)",
                )
            if len(self._queue) >= self._max_queue or (self._queue and self._queued_bytes + item.size > self._max_queue_bytes):
                raise PublishQueueFullError(
                    f"{len(self._queue)} publishes ({self._queued_bytes} bytes of envelopes) are already waiting to be "
                    f"logged; this registry queues at most {self._max_queue} ({self._max_queue_bytes} bytes)",
                    retry_after=RETRY_AFTER_SECONDS,
                    extra={"limit": self._max_queue},
                )
            self._queue.append(_Queued(item, future))
            self._queued_bytes += item.size
            self._cond.notify()
        return future

    @contextlib.contextmanager
    def arriving(self) -> Iterator[None]:
        """Around a publish on its way to ``submit`` (its body read, its signatures verified):
        an open batch waits for it, up to ``batch_wait_ms``. Never blocks."""
        with self._cond:
            self._arriving += 1
        try:
            yield
        finally:
            with self._cond:
                self._arriving -= 1
                self._cond.notify()

    def stop(self) -> None:
        """Refuse new publishes, sequence every queued one, and join the thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join()

    # --- the thread --------------------------------------------------------------------------

    def _next_batch(self) -> list[_Queued[Item, Result]] | None:
        """The next batch (waiting for its first publish, then up to the wait for more); None once stopped and empty."""
        with self._cond:
            while not self._queue:
                if self._stopping:
                    return None
                self._cond.wait()
            batch = [self._queue.popleft()]
            size = batch[0].item.size
            deadline = time.monotonic() + self._wait
            while len(batch) < self._batch_max:
                if not self._queue:
                    left = deadline - time.monotonic()
                    if left <= 0 or self._stopping or not self._arriving:
                        break
                    self._cond.wait(left)
                    continue
                if size + self._queue[0].item.size > MAX_BATCH_BYTES:
                    break
                queued = self._queue.popleft()
                size += queued.item.size
                batch.append(queued)
            self._queued_bytes -= size
            return batch

    def _run(self) -> None:
        while (batch := self._next_batch()) is not None:
            # A publish whose client went away before its batch began is dropped: nobody was told it is logged.
            live = [q for q in batch if q.future.set_running_or_notify_cancel()]
            if not live:
                continue
            try:
                outcomes = list(self._sequence([q.item for q in live]))
                if len(outcomes) != len(live):
                    raise RegistryError(f"the sequencer got {len(outcomes)} outcomes for a batch of {len(live)}")
            except Exception as e:  # a bug: every publish of the batch fails, the thread goes on
                logger.exception("sequencing a batch of %d publishes failed", len(live))
                outcomes = [_failure(e) for _ in live]
            self.batches += 1
            self.sequenced += len(live)
            for queued, outcome in zip(live, outcomes, strict=True):
                if isinstance(outcome, BaseException):
                    queued.future.set_exception(outcome)
                else:
                    queued.future.set_result(outcome)


def _failure(cause: Exception) -> RegistryError:
    """A fresh 500 for one publish of a batch that failed unexpectedly (one instance per thread that raises it)."""
    error = RegistryError(
        "the registry failed while logging this publish's batch",
        hint="post the envelope again: publishing is idempotent, so you get its entry if it was logged; if it persists, "
        "report it to the registry's operator (the server log has the details)",
    )
    error.__cause__ = cause
    return error

