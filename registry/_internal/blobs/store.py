"""The content-addressed blob store: ``blobs/sha256/<hex>``, written only whole and verified.

``BlobStore`` is the one interface the service, the app, the scrubber and ``kvgraft fsck`` use;
``blobfactory.open_blob_store`` picks the implementation the settings name. Two exist: ``LocalBlobStore``,
the data directory's ``blobs/`` (the default, below), and ``s3blobs.S3BlobStore``, an
S3-compatible object store under ``s3://BUCKET/PREFIX/blobs/``. Both keep the same promises:

- a blob is visible under its name only once the uploaded bytes have hashed to it (a refused,
  oversized or interrupted upload leaves nothing under the final name);
- reads stream in fixed-size chunks (memory flat in the blob's size), ranges included;
- a stored blob that stops hashing to its name (disks rot, operators slip) is moved to
  ``blobs/quarantine/<hex>.<UTC timestamp>`` by whoever notices (a full GET hashing what it
  streams, the check of a small blob before it is served, the background scrub, ``kvgraft
  fsck``), so it is never served again; it then answers 404 ``blob-quarantined`` until an upload
  of the right bytes puts it back. An upload of a digest already stored re-checks the stored
  copy, so a re-upload always repairs.

The checks themselves (``check``, ``verify``, ``scrub``, ``read_checked``) are written once, here,
over two primitives each store provides: open a blob for reading (with an identity of the copy
that was read: device and inode, or the object's ETag) and quarantine a blob if it is still that copy.

``LocalBlobStore``: an upload streams into a temp file under ``blobs/tmp`` while it is hashed;
only when the digest matches is the file fsynced and renamed into place, so a blob path always
holds exactly the bytes of its name.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import functools
import hashlib
import logging
import os
import re
import shutil
import tempfile
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import BinaryIO, Protocol

import anyio
import anyio.to_thread

from kvgraft.schemas import fsync_path

from ..errors import (
    BadDigestError,
    BlobDigestMismatchError,
    BlobNotFoundError,
    BlobQuarantinedError,
    PayloadTooLargeError,
    RegistryError,
)
from ..readcache import BoundedLru

logger = logging.getLogger("kvgraft.registry")

#: Bytes gathered from the request before each write: large enough to amortise a thread hop,
#: small enough to keep memory flat.
WRITE_CHUNK = 1 << 20
#: Bytes read per response chunk: each chunk costs a thread hop and an ASGI send, so larger
#: chunks move more bytes per hop (256 KiB gave about 0.35x nginx's download rate on 100 MB
#: blobs, 4 MiB about 0.6x; bench/registry_throughput.py); memory stays flat, 4 MiB per download.
READ_CHUNK = 4 << 20
#: Batches of WRITE_CHUNK an upload may hold waiting to be hashed and written.
PIPELINE = 4
#: Bytes hashed per step when checking a stored blob (fsck, the scrub, a re-upload): a stop
#: request is seen within one step.
CHECK_CHUNK = 4 << 20
#: Seconds after which an upload in ``tmp`` is a crash's leftover when server processes share the
#: directory (a shared database): no upload takes a day.
SHARED_STALE_UPLOAD_SECONDS = 24 * 3600
#: Where damaged blobs go, under the store's root.
QUARANTINE_DIR = "quarantine"
#: Blobs up to this size are served whole from one read (hashed, then sent in one piece): the
#: same memory as one streamed chunk, without the stream's per-chunk thread hops and held-back chunk.
WHOLE_READ_BYTES = READ_CHUNK
#: Blobs up to this size, already verified once, are read on the event loop itself when the store
#: is a local directory no other process writes: a page-cached 64 KiB read and its hash take tens
#: of microseconds, less than the thread hop they would otherwise wait for (bench/registry_reads.py).
INLINE_READ_BYTES = 64 << 10
#: Verified blob sizes a store remembers (an int and a 64-character key each: a few MiB in all).
VERIFIED_CACHE_ENTRIES = 65536

_DIGEST = re.compile(r"sha256:([0-9a-f]{64})", re.ASCII)


def parse_digest_ref(value: str, *, what: str = "digest") -> str:
    """The bare hex of a ``sha256:<64 lowercase hex>`` reference; ``BadDigestError`` otherwise.

    Anything else (another algorithm, uppercase, a wrong length, '/' or '..') is refused before
    it can come near a path.
    """
    m = _DIGEST.fullmatch(value)
    if m is None:
        shown = value if len(value) <= 80 else value[:77] + "..."
        raise BadDigestError(f"{what} {shown!r} is not sha256: followed by 64 lowercase hex digits")
    return m.group(1)


@dataclass(frozen=True)
class BlobCheck:
    """The outcome of re-hashing one stored blob.

    ``actual`` is the sha256 hex of the bytes read (None when the file vanished or the check was
    stopped); ``quarantined_to`` the quarantine path (relative to the store's root) when the blob
    was found damaged and moved aside.
    """

    hex_digest: str
    size: int
    actual: str | None
    quarantined_to: str | None = None

    @property
    def ok(self) -> bool:
        """Whether the bytes hash to the blob's name."""
        return self.actual == self.hex_digest


@dataclass(frozen=True)
class WholeBlob:
    """A stored blob read whole (``BlobStore.load_whole``): its size as stat'ed, the bytes read
    (one past the size, if the file had grown), their sha256 hex and the copy's identity."""

    size: int
    data: bytes
    actual: str
    ident: object


@dataclass
class ScrubResult:
    """What one pass over every stored blob found."""

    checked: int = 0
    bytes: int = 0
    damaged: list[BlobCheck] = field(default_factory=list)
    #: Files under ``sha256/`` whose name is not a digest (never served; left in place).
    strays: list[str] = field(default_factory=list)
    stopped: bool = False


class BlobReader(Protocol):
    """One stored copy of a blob, open for reading (blocking calls: run them in a worker thread)."""

    #: What identifies this copy (device and inode, an object's ETag): ``BlobStore.quarantine`` moves
    #: the blob aside only if its name still holds this copy, never one an upload put there since.
    ident: object

    def read(self, n: int) -> bytes:
        """Up to ``n`` bytes; empty at the end."""
        ...

    def close(self) -> None:
        """Release the file or connection."""
        ...


class BlobStore(ABC):
    """Content-addressed blobs, written only whole and verified (the module docstring has the promises).

    Blob names are bare sha256 hex digests, as ``parse_digest_ref`` returns them. Methods are
    blocking unless ``async``: the app runs them in worker threads. A store is a context manager:
    ``close`` releases its connections (the local store holds none).
    """

    #: How the store is named in logs and messages ("DATA/blobs", "s3://bucket/prefix").
    name: str
    #: Sizes of blobs this process has verified (hashed to their names) and not quarantined since,
    #: by hex digest; None when other processes may quarantine or replace blobs behind this one's
    #: back (a shared directory, an object store), so that nothing is answered from memory.
    _verified: BoundedLru[str, int] | None = None
    #: Largest verified blob read on the event loop rather than in a worker thread (0: none).
    inline_read_bytes: int = 0

    def __enter__(self) -> BlobStore:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    @abstractmethod
    def close(self) -> None:
        """Release what the store holds open (connections); the store is not used afterwards."""

    @abstractmethod
    def prepare(self) -> None:
        """Make the store ready at server start (directories, the bucket's reachability); clear
        uploads a crash left behind that no running server can still be writing."""

    @abstractmethod
    def size(self, hex_digest: str) -> int | None:
        """The blob's size in bytes, or None when it is not stored."""

    def exists(self, hex_digest: str) -> bool:
        """Whether the blob is stored."""
        return self.size(hex_digest) is not None

    def missing(self, hex_digests: list[str]) -> list[str]:
        """Those of ``hex_digests`` that are not stored, in order, without repeats."""
        return [h for h in dict.fromkeys(hex_digests) if not self.exists(h)]

    @abstractmethod
    def quarantined(self, hex_digest: str) -> list[str]:
        """The quarantine names (``<hex>.<timestamp>``) of blob ``hex_digest``, oldest first; empty when none."""

    @abstractmethod
    def quarantine_names(self) -> list[str]:
        """Every name in the quarantine, sorted (``kvgraft fsck`` reports those it found there)."""

    @abstractmethod
    def digests(self) -> tuple[list[str], list[str]]:
        """The stored blobs' hex digests, sorted, and the names under ``sha256/`` that are not digests."""

    @abstractmethod
    def open(self, hex_digest: str) -> BlobReader | None:
        """The stored blob, open for reading from its start; None when it is not stored."""

    @abstractmethod
    def quarantine(self, hex_digest: str, ident: object | None, reason: str) -> str | None:
        """Move blob ``hex_digest`` to ``quarantine/<hex>.<UTC timestamp>``; return that name relative
        to the store's root, or None when the blob no longer holds the copy that was checked
        (``ident``, a ``BlobReader.ident``; None: whatever is there)."""

    @abstractmethod
    async def receive(
        self, hex_digest: str, chunks: AsyncIterable[bytes], *, max_bytes: int, declared_size: int | None = None
    ) -> bool:
        """Store the bytes of ``chunks`` as blob ``hex_digest``; return True when it is new (or repaired).

        ``declared_size`` is the request's Content-Length, when it has one (a store that buffers
        uses it to reserve memory; the HTTP server holds the body to it).

        Raises ``BlobDigestMismatchError`` when the bytes hash to another digest and
        ``PayloadTooLargeError`` past ``max_bytes``; in every failure (a client that hangs up
        included) nothing becomes visible under the blob's name and nothing is left behind. When
        the blob already exists, the stored copy is re-hashed once the upload has verified:
        intact, the upload is dropped (False); damaged, it is quarantined and the upload takes its
        place (True). So a re-upload of the right bytes always repairs, and the re-check costs
        one read of what the client has just sent in full: no client can make it read more than it sends.
        """

    @abstractmethod
    def read(self, hex_digest: str, start: int, end: int) -> AsyncIterator[bytes]:
        """Stream bytes ``[start, end)`` of the blob in chunks of at most ``READ_CHUNK``."""

    # --- written once, over the primitives above ---------------------------------------------

    def require(self, hex_digest: str) -> int:
        """The stored blob's size; ``BlobQuarantinedError`` when it was moved aside as damaged and
        not uploaded again, ``BlobNotFoundError`` when it was never stored."""
        size = self.size(hex_digest)
        if size is not None:
            return size
        if self.quarantined(hex_digest):
            raise quarantined_error(hex_digest)
        raise BlobNotFoundError(f"no blob sha256:{hex_digest} is stored here")

    def verified_size(self, hex_digest: str) -> int | None:
        """The size of blob ``hex_digest`` when this process has verified it and not quarantined it
        since (blobs never change under their name); None when unknown. No I/O: safe on the event loop.

        What it answers (HEAD, a 304) sends no bytes; every byte sent is re-hashed or streamed
        hashed as before, so a blob that rotted since it was verified is still never served."""
        return None if self._verified is None else self._verified.get(hex_digest)

    def _remember(self, hex_digest: str, size: int) -> None:
        """Blob ``hex_digest`` (``size`` bytes) just hashed to its name."""
        if self._verified is not None:
            self._verified.put(hex_digest, size)

    def _forget(self, hex_digest: str) -> None:
        """Blob ``hex_digest`` is being moved aside: nothing may be answered for it from memory."""
        if self._verified is not None:
            self._verified.pop(hex_digest)

    def load_whole(self, hex_digest: str, limit: int) -> WholeBlob | int:
        """The stored blob read whole and hashed, when it is at most ``limit`` bytes (else only its
        size, an int); ``BlobQuarantinedError`` / ``BlobNotFoundError`` as ``require``. Blocking, unless the
        caller knows the blob is small and local (``fetch_whole``). It checks nothing itself:
        ``fetch_whole`` compares the digest and quarantines."""
        size = self.require(hex_digest)
        if size > limit:
            return size
        reader = self.open(hex_digest)
        if reader is None:
            # Gone since it was stat'ed (quarantined by a check meanwhile): say which.
            self.require(hex_digest)
            raise BlobNotFoundError(f"no blob sha256:{hex_digest} is stored here")
        try:
            # One byte past the size shows a file grown since the stat (tampered with on disk).
            parts: list[bytes] = []
            left = size + 1
            while left > 0 and (chunk := reader.read(left)):
                parts.append(chunk)
                left -= len(chunk)
        finally:
            reader.close()
        data = b"".join(parts)
        return WholeBlob(size, data, hashlib.sha256(data).hexdigest(), reader.ident)

    async def fetch_whole(self, hex_digest: str, limit: int) -> tuple[int, bytes | None]:
        """The blob's size and, when it is at most ``limit`` bytes, its bytes, checked against its name.

        One read serves and verifies: when the bytes do not hash to the blob's name (or are not
        its size), the blob is quarantined and ``BlobQuarantinedError`` raised; nothing of it is
        returned. A blob verified before and at most ``inline_read_bytes`` is read on the event
        loop (no thread hop); any other in one worker thread."""
        known = self.verified_size(hex_digest)
        if known is not None and known <= min(limit, self.inline_read_bytes):
            whole = self.load_whole(hex_digest, limit)
        else:
            whole = await anyio.to_thread.run_sync(self.load_whole, hex_digest, limit)
        if isinstance(whole, int):
            return whole, None
        reason = rot_reason(hex_digest, whole.size, len(whole.data), whole.actual)
        if reason is not None:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(self.quarantine, hex_digest, whole.ident, f"its stored bytes {reason}")
            raise quarantined_error(hex_digest)
        self._remember(hex_digest, whole.size)
        return whole.size, whole.data

    def check(self, hex_digest: str, *, quarantine: bool = True, stop: threading.Event | None = None) -> BlobCheck:
        """Re-hash the stored blob; when its bytes do not hash to its name, move it to quarantine
        (unless ``quarantine`` is False). A missing blob is reported with ``actual`` None; so is
        a check cut short by ``stop``. Blocking: run it in a worker thread."""
        reader = self.open(hex_digest)
        if reader is None:
            return BlobCheck(hex_digest, 0, None)
        try:
            h = hashlib.sha256()
            size = 0
            while chunk := reader.read(CHECK_CHUNK):
                if stop is not None and stop.is_set():
                    return BlobCheck(hex_digest, size, None)
                h.update(chunk)
                size += len(chunk)
        finally:
            reader.close()
        actual = h.hexdigest()
        if actual == hex_digest:
            self._remember(hex_digest, size)
        if actual == hex_digest or not quarantine:
            return BlobCheck(hex_digest, size, actual)
        moved = self.quarantine(hex_digest, reader.ident, f"its {size} bytes hash to sha256:{actual}")
        return BlobCheck(hex_digest, size, actual, moved)

    def verify(self, hex_digest: str) -> None:
        """Re-hash the stored blob before it is served: ``BlobQuarantinedError`` (and the blob
        moved aside) when it is damaged, ``BlobNotFoundError`` when it is gone. Blocking."""
        result = self.check(hex_digest)
        if result.actual is None:
            # Gone since it was stat'ed: quarantined by another check (say so), or, if it is
            # back, put there by an upload that verified its bytes.
            self.require(hex_digest)
            return
        if not result.ok:
            raise quarantined_error(hex_digest)

    def scrub(
        self, *, quarantine: bool = True, stop: threading.Event | None = None, pause: Callable[[], None] | None = None
    ) -> ScrubResult:
        """Check every stored blob (see ``check``); ``pause`` runs between blobs. Blocking."""
        result = ScrubResult()
        hexes, result.strays = self.digests()
        for hex_digest in hexes:
            if stop is not None and stop.is_set():
                result.stopped = True
                break
            checked = self.check(hex_digest, quarantine=quarantine, stop=stop)
            if checked.actual is None:
                result.stopped = stop is not None and stop.is_set()
                continue
            result.checked += 1
            result.bytes += checked.size
            if not checked.ok:
                result.damaged.append(checked)
            if pause is not None:
                pause()
        return result

    async def read_checked(self, hex_digest: str, size: int) -> AsyncIterator[bytes]:
        """Stream the whole blob (``size`` bytes, as stat'ed), hashing it as it goes.

        The last chunk is held back until the digest has been checked: when the bytes do not
        hash to the blob's name (or the blob is shorter or longer than ``size``), the blob is
        quarantined and ``BlobQuarantinedError`` raised instead, which aborts the response. A
        client never receives a complete body with the blob's ETag that is not the blob.
        """
        reader = await anyio.to_thread.run_sync(self.open, hex_digest)
        if reader is None:
            # Gone since it was stat'ed (quarantined by a check meanwhile): say which.
            await anyio.to_thread.run_sync(self.require, hex_digest)
            raise BlobNotFoundError(f"no blob sha256:{hex_digest} is stored here")
        try:
            h = hashlib.sha256()
            left = size
            held: bytes | None = None
            while left > 0:
                chunk = await anyio.to_thread.run_sync(_read_hashed, reader, min(READ_CHUNK, left), h)
                if not chunk:
                    break
                left -= len(chunk)
                if held is not None:
                    yield held
                held = chunk
            extra = await anyio.to_thread.run_sync(reader.read, 1) if left == 0 else b""
            reason = rot_reason(hex_digest, size, size - left + len(extra), h.hexdigest())
            if reason is not None:
                with anyio.CancelScope(shield=True):
                    await anyio.to_thread.run_sync(self.quarantine, hex_digest, reader.ident, f"its stored bytes {reason}")
                raise BlobQuarantinedError(
                    f"blob sha256:{hex_digest} was quarantined while being served: its stored bytes {reason}"
                )
            self._remember(hex_digest, size)
            if held is not None:
                yield held
        finally:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(reader.close)


class _FileReader:
    """A stored file, as a ``BlobReader``: its identity is its device and inode."""

    def __init__(self, f: BinaryIO) -> None:
        self._f = f
        st = os.fstat(f.fileno())
        self.ident: object = (st.st_dev, st.st_ino)

    def read(self, n: int) -> bytes:
        return self._f.read(n)

    def close(self) -> None:
        self._f.close()


class LocalBlobStore(BlobStore):
    """Blobs under ``root/sha256/<hex>``, uploads in progress under ``root/tmp``, damaged blobs
    under ``root/quarantine/<hex>.<timestamp>`` (the data directory's ``blobs/``, the default)."""

    def __init__(self, root: Path, *, shared: bool = False) -> None:
        self.root = root
        self.name = str(root)
        #: Other server processes may use the directory at the same time (a shared database).
        self._shared = shared
        if not shared:
            # Alone on the directory, this process sees every quarantine and every upload: what
            # it verified stays true until it moves the blob aside itself (quarantine forgets it).
            self._verified = BoundedLru(VERIFIED_CACHE_ENTRIES, VERIFIED_CACHE_ENTRIES)
            self.inline_read_bytes = INLINE_READ_BYTES
        self._dir = root / "sha256"
        self._tmp = root / "tmp"
        self._quarantine = root / QUARANTINE_DIR
        # Serialises renames onto and away from a blob path within this process, so that a
        # check cannot quarantine a good file that an upload just put in place of a bad one.
        self._rename_lock = threading.Lock()

    def close(self) -> None:
        """Nothing to release: files are opened and closed per use."""

    def prepare(self) -> None:
        """Create the directories; remove uploads a crash left in ``tmp``.

        Call it only holding the data directory (the database lock): a second process must not
        delete the running server's uploads in progress."""
        self._dir.mkdir(parents=True, exist_ok=True)
        if self._shared:
            self._tmp.mkdir(exist_ok=True)
            self._remove_stale_uploads()
            return
        if self._tmp.exists():
            stale = list(self._tmp.iterdir())
            if stale:
                logger.info("removing %d unfinished upload(s) from %s", len(stale), self._tmp)
            shutil.rmtree(self._tmp)
        self._tmp.mkdir()

    def _remove_stale_uploads(self) -> None:
        """Remove only the uploads in ``tmp`` untouched for ``SHARED_STALE_UPLOAD_SECONDS``: the
        other processes sharing the directory may be writing the younger ones."""
        cutoff = time.time() - SHARED_STALE_UPLOAD_SECONDS
        stale = 0
        for leftover in self._tmp.iterdir():
            with contextlib.suppress(FileNotFoundError):
                if leftover.stat().st_mtime < cutoff:
                    leftover.unlink()
                    stale += 1
        if stale:
            logger.info("removed %d unfinished upload(s) older than a day from %s", stale, self._tmp)

    def path(self, hex_digest: str) -> Path:
        """Where the blob ``hex_digest`` lives (whether or not it exists)."""
        # Callers pass parse_digest_ref's output; re-check so that no other string becomes a path.
        parse_digest_ref("sha256:" + hex_digest)
        return self._dir / hex_digest

    def size(self, hex_digest: str) -> int | None:
        try:
            return self.path(hex_digest).stat().st_size
        except FileNotFoundError:
            return None

    def exists(self, hex_digest: str) -> bool:
        return self.path(hex_digest).is_file()

    def quarantined(self, hex_digest: str) -> list[str]:
        parse_digest_ref("sha256:" + hex_digest)
        return [n for n in self.quarantine_names() if n.startswith(hex_digest + ".")]

    def quarantine_names(self) -> list[str]:
        try:
            return sorted(os.listdir(self._quarantine))
        except FileNotFoundError:
            return []

    def digests(self) -> tuple[list[str], list[str]]:
        try:
            names = sorted(os.listdir(self._dir))
        except FileNotFoundError:
            return [], []
        good = [n for n in names if _DIGEST.fullmatch("sha256:" + n)]
        return good, [n for n in names if not _DIGEST.fullmatch("sha256:" + n)]

    def open(self, hex_digest: str) -> BlobReader | None:
        try:
            f = self.path(hex_digest).open("rb")
        except FileNotFoundError:
            return None
        return _FileReader(f)

    def quarantine(self, hex_digest: str, ident: object | None, reason: str) -> str | None:
        path = self.path(hex_digest)
        with self._rename_lock:
            try:
                st = path.stat()
            except FileNotFoundError:
                return None
            if ident is not None and (st.st_dev, st.st_ino) != ident:
                # An upload replaced it meanwhile with verified bytes: those are fine.
                return None
            self._forget(hex_digest)
            self._quarantine.mkdir(exist_ok=True)
            names = set(self.quarantine_names())
            target = self._quarantine / next(n for n in quarantine_names_for(hex_digest) if n not in names)
            os.rename(path, target)
            fsync_path(self._quarantine)
            fsync_path(self._dir)
        relative = f"{QUARANTINE_DIR}/{target.name}"
        log_quarantined(hex_digest, reason, relative)
        return relative

    async def receive(
        self, hex_digest: str, chunks: AsyncIterable[bytes], *, max_bytes: int, declared_size: int | None = None
    ) -> bool:
        del declared_size  # streamed to a file: nothing is buffered past one chunk
        final = self.path(hex_digest)
        h = hashlib.sha256()
        tmp: Path | None = None
        f: BinaryIO | None = None
        try:
            fd, name = await anyio.to_thread.run_sync(
                lambda: tempfile.mkstemp(dir=self._tmp, prefix=hex_digest[:16] + ".")
            )
            tmp = Path(name)
            f = os.fdopen(fd, "wb")
            # Receiving and storing overlap: batches of the request's chunks go through a bounded
            # queue to a task that hashes and writes them in a worker thread, while this task
            # keeps reading the socket. Done one after the other, the server read nothing while a
            # batch was stored (py-spy: both threads idle about half the time,
            # bench/registry_throughput.py). At most PIPELINE batches wait: memory stays flat.
            send, batches = anyio.create_memory_object_stream[list[bytes]](max_buffer_size=PIPELINE)
            size = 0

            async def store() -> None:
                nonlocal size
                async with batches:
                    async for batch in batches:
                        size += await anyio.to_thread.run_sync(consume_batch, h, f, batch)

            try:
                async with anyio.create_task_group() as tg, send:
                    tg.start_soon(store)
                    async for batch in upload_batches(chunks, max_bytes):
                        await send.send(batch)
            except BaseExceptionGroup as group:
                # The task group wraps what went wrong (a limit, a client gone, a disk error):
                # the caller gets that exception itself, as before the pipeline.
                raise _first_error(group) from None
            check_upload_digest(hex_digest, h, size)
            if f is not None and tmp is not None:
                stored = await anyio.to_thread.run_sync(functools.partial(self.check, hex_digest))
                if stored.ok:
                    return False
                await anyio.to_thread.run_sync(self._commit, f, tmp, final)
                self._remember(hex_digest, size)
                f = None
                tmp = None
                what = "repaired" if stored.quarantined_to is not None else "stored"
                logger.info("%s blob sha256:%s (%d bytes)", what, hex_digest, size)
            return True
        finally:
            # Whatever went wrong (a bad digest, a limit, a client that hung up, cancellation),
            # the partial upload goes; shielded so cancellation cannot skip it.
            with anyio.CancelScope(shield=True):
                if f is not None:
                    f.close()
                if tmp is not None:
                    await anyio.to_thread.run_sync(_unlink_quietly, tmp)

    def _commit(self, f: BinaryIO, tmp: Path, final: Path) -> None:
        try:
            f.flush()
            os.fsync(f.fileno())
        finally:
            f.close()
        os.chmod(tmp, 0o644)
        # A concurrent upload of the same digest may have renamed first: its bytes are the
        # same (both were verified), so replacing is harmless.
        with self._rename_lock:
            os.replace(tmp, final)
            fsync_path(self._dir)

    async def read(self, hex_digest: str, start: int, end: int) -> AsyncIterator[bytes]:
        async with await anyio.open_file(self.path(hex_digest), "rb") as f:
            await f.seek(start)
            left = end - start
            while left > 0:
                chunk = await f.read(min(READ_CHUNK, left))
                if not chunk:
                    # Blobs never shrink; a short read means the file was tampered with on disk.
                    logger.error("blob sha256:%s ended %d bytes early", hex_digest, left)
                    return
                left -= len(chunk)
                yield chunk


def quarantine_names_for(hex_digest: str) -> Iterator[str]:
    """Names to quarantine blob ``hex_digest`` under, first choice first: ``<hex>.<UTC timestamp>``,
    then with ``-1``, ``-2``, ... for a blob quarantined twice in the same microsecond."""
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%S%fZ")
    yield f"{hex_digest}.{stamp}"
    n = 1
    while True:
        yield f"{hex_digest}.{stamp}-{n}"
        n += 1


def log_quarantined(hex_digest: str, reason: str, relative: str) -> None:
    """The one log line of a blob moved aside (``relative``: its quarantine name under ``blobs/``)."""
    logger.error(
        "blob sha256:%s is damaged (%s): moved to blobs/%s; it is no longer served", hex_digest, reason, relative
    )


def quarantined_error(hex_digest: str) -> BlobQuarantinedError:
    """The 404 of a blob moved aside as damaged (the reason is in the server's log, not the answer)."""
    return BlobQuarantinedError(
        f"blob sha256:{hex_digest} was quarantined: its stored bytes no longer hashed to its digest"
    )


def rot_reason(hex_digest: str, size: int, got: int, actual: str) -> str | None:
    """Why ``got`` bytes read from blob ``hex_digest`` (stat'ed at ``size``), hashing to ``actual``,
    are not the blob ("are 3 bytes short", "hash to sha256:..."), to follow "its stored bytes";
    None when they are."""
    if got < size:
        return f"are {size - got} bytes short"
    if got > size:
        return "are longer than its size"
    if actual != hex_digest:
        return f"hash to sha256:{actual}"
    return None


def check_upload_digest(hex_digest: str, h: hashlib._Hash, size: int) -> None:
    """``BlobDigestMismatchError`` unless the ``size`` uploaded bytes hashed into ``h`` are blob ``hex_digest``."""
    got = h.hexdigest()
    if got != hex_digest:
        raise BlobDigestMismatchError(
            f"the uploaded {size} bytes have digest sha256:{got}, not sha256:{hex_digest}",
            extra={"expected": "sha256:" + hex_digest, "actual": "sha256:" + got, "size": size},
        )


class BlobScrubber:
    """A background thread that checks every stored blob every ``interval`` seconds.

    Low priority: the thread lowers its own CPU priority (Linux: per thread) and sleeps
    ``pause_seconds`` between blobs; it never touches the database. ``stop`` ends it within one
    ``CHECK_CHUNK`` of hashing.
    """

    def __init__(self, store: BlobStore, interval: float, *, pause_seconds: float = 0.01) -> None:
        self.store = store
        self.interval = interval
        self.pause_seconds = pause_seconds
        self.passes = 0
        self.last: ScrubResult | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvgraft-blob-scrub", daemon=True)

    def start(self) -> None:
        """Start the thread; the first pass begins at once."""
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Ask the thread to stop and wait for it (blocking)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _pause(self) -> None:
        self._stop.wait(self.pause_seconds)

    def _run(self) -> None:
        # Linux applies setpriority to the one thread named by its native id.
        with contextlib.suppress(OSError, AttributeError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                result = self.store.scrub(stop=self._stop, pause=self._pause)
            except (OSError, RegistryError) as e:
                # A disk error, or an object store that does not answer, must not end the scrub
                # for good; the next pass retries.
                logger.error("blob scrub failed: %s", e)
            else:
                self.passes += 1
                self.last = result
                logger.info(
                    "blob scrub: %d blob(s), %d bytes checked in %.1f s; %d damaged and quarantined",
                    result.checked, result.bytes, time.monotonic() - started, len(result.damaged),
                )
            self._stop.wait(self.interval)


def _read_hashed(f: BlobReader, n: int, h: hashlib._Hash) -> bytes:
    """Read up to ``n`` bytes and add them to ``h`` (one thread hop for both)."""
    chunk = f.read(n)
    h.update(chunk)
    return chunk


def _first_error(group: BaseExceptionGroup) -> BaseException:
    """The error a task group stopped for: the first one that is not a consequence of it (the
    cancellation it caused, or a send into the stream the failed task closed)."""
    leaves: list[BaseException] = []

    def walk(g: BaseExceptionGroup) -> None:
        for e in g.exceptions:
            if isinstance(e, BaseExceptionGroup):
                walk(e)
            else:
                leaves.append(e)

    walk(group)
    consequences = (anyio.get_cancelled_exc_class(), anyio.BrokenResourceError)
    return next((e for e in leaves if not isinstance(e, consequences)), leaves[0])


async def upload_batches(chunks: AsyncIterable[bytes], max_bytes: int) -> AsyncIterator[list[bytes]]:
    """The request's chunks in lists of about WRITE_CHUNK bytes, gathered by reference (no copy
    into a growing buffer); ``PayloadTooLargeError`` as soon as more than ``max_bytes`` arrived."""
    size = 0
    pending: list[bytes] = []
    pending_size = 0
    async for chunk in chunks:
        size += len(chunk)
        if size > max_bytes:
            raise PayloadTooLargeError(f"the blob is larger than this registry's limit of {max_bytes} bytes", extra={"limit": max_bytes})
        pending.append(chunk)
        pending_size += len(chunk)
        if pending_size >= WRITE_CHUNK:
            yield pending
            pending, pending_size = [], 0
    if pending:
        yield pending


def consume_batch(h: hashlib._Hash, f: BinaryIO | None, chunks: list[bytes]) -> int:
    """Hash ``chunks`` and write them to ``f`` (when the blob is new); the bytes consumed."""
    for chunk in chunks:
        h.update(chunk)
    if f is not None:
        f.writelines(chunks)
    return sum(len(c) for c in chunks)


def _unlink_quietly(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
