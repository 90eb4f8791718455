"""The content-addressed blob store: ``blobs/sha256/<hex>``, written only whole and verified.

An upload streams into a temp file under ``blobs/tmp`` while it is hashed; only when the
digest matches is the file fsynced and renamed into place, so a blob path always holds exactly
the bytes of its name, and a refused or broken upload leaves nothing behind. Reads stream in
fixed-size chunks: memory stays flat in the blob's size.

Disks rot, and operators slip: a stored file can stop hashing to its name. Whoever notices
(a full GET hashing what it streams, the check of a small blob before it is served, the
background scrub, ``kvgraft fsck``) moves it to ``blobs/quarantine/<hex>.<UTC timestamp>``
(renamed and fsynced), so it is never served again; the blob then answers 404
``blob-quarantined`` until an upload of the right bytes puts it back. An upload of a digest
already stored re-checks the stored file, so a re-upload always repairs.
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
from collections.abc import AsyncIterable, AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import anyio
import anyio.to_thread

from kvgraft.schemas import fsync_path

from .errors import (
    BadDigestError,
    BlobDigestMismatchError,
    BlobNotFoundError,
    BlobQuarantinedError,
    PayloadTooLargeError,
)

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
#: Where damaged blobs go, under the store's root.
QUARANTINE_DIR = "quarantine"

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


@dataclass
class ScrubResult:
    """What one pass over every stored blob found."""

    checked: int = 0
    bytes: int = 0
    damaged: list[BlobCheck] = field(default_factory=list)
    #: Files under ``sha256/`` whose name is not a digest (never served; left in place).
    strays: list[str] = field(default_factory=list)
    stopped: bool = False


class BlobStore:
    """Blobs under ``root/sha256/<hex>``, uploads in progress under ``root/tmp``, damaged blobs
    under ``root/quarantine/<hex>.<timestamp>``."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._dir = root / "sha256"
        self._tmp = root / "tmp"
        self._quarantine = root / QUARANTINE_DIR
        # Serialises renames onto and away from a blob path within this process, so that a
        # check cannot quarantine a good file that an upload just put in place of a bad one.
        self._rename_lock = threading.Lock()

    def prepare(self) -> None:
        """Create the directories; remove uploads a crash left in ``tmp``."""
        self._dir.mkdir(parents=True, exist_ok=True)
        if self._tmp.exists():
            stale = list(self._tmp.iterdir())
            if stale:
                logger.info("removing %d unfinished upload(s) from %s", len(stale), self._tmp)
            shutil.rmtree(self._tmp)
        self._tmp.mkdir()

    def path(self, hex_digest: str) -> Path:
        """Where the blob ``hex_digest`` lives (whether or not it exists)."""
        # Callers pass parse_digest_ref's output; re-check so that no other string becomes a path.
        parse_digest_ref("sha256:" + hex_digest)
        return self._dir / hex_digest

    def size(self, hex_digest: str) -> int | None:
        """The blob's size in bytes, or None when it is not stored."""
        try:
            return self.path(hex_digest).stat().st_size
        except FileNotFoundError:
            return None

    def exists(self, hex_digest: str) -> bool:
        """Whether the blob is stored."""
        return self.path(hex_digest).is_file()

    def missing(self, hex_digests: list[str]) -> list[str]:
        """Those of ``hex_digests`` that are not stored, in order, without repeats."""
        return [h for h in dict.fromkeys(hex_digests) if not self.exists(h)]

    def quarantined(self, hex_digest: str) -> list[str]:
        """The quarantine file names of blob ``hex_digest`` (oldest first), empty when none."""
        parse_digest_ref("sha256:" + hex_digest)
        try:
            names = os.listdir(self._quarantine)
        except FileNotFoundError:
            return []
        return sorted(n for n in names if n.startswith(hex_digest + "."))

    def require(self, hex_digest: str) -> int:
        """The stored blob's size; ``BlobQuarantinedError`` when it was moved aside as damaged and
        not uploaded again, ``BlobNotFoundError`` when it was never stored."""
        size = self.size(hex_digest)
        if size is not None:
            return size
        if self.quarantined(hex_digest):
            raise BlobQuarantinedError(
                f"blob sha256:{hex_digest} was quarantined: its stored bytes no longer hashed to its digest"
            )
        raise BlobNotFoundError(f"no blob sha256:{hex_digest} is stored here")

    def check(self, hex_digest: str, *, quarantine: bool = True, stop: threading.Event | None = None) -> BlobCheck:
        """Re-hash the stored blob; when its bytes do not hash to its name, move it to quarantine
        (unless ``quarantine`` is False). A missing file is reported with ``actual`` None; so is
        a check cut short by ``stop``. Blocking: run it in a worker thread."""
        path = self.path(hex_digest)
        try:
            f = path.open("rb")
        except FileNotFoundError:
            return BlobCheck(hex_digest, 0, None)
        with f:
            st = os.fstat(f.fileno())
            h = hashlib.sha256()
            size = 0
            while chunk := f.read(CHECK_CHUNK):
                if stop is not None and stop.is_set():
                    return BlobCheck(hex_digest, size, None)
                h.update(chunk)
                size += len(chunk)
        actual = h.hexdigest()
        if actual == hex_digest or not quarantine:
            return BlobCheck(hex_digest, size, actual)
        moved = self.quarantine(hex_digest, (st.st_dev, st.st_ino), f"its {size} bytes hash to sha256:{actual}")
        return BlobCheck(hex_digest, size, actual, moved)

    def quarantine(self, hex_digest: str, ident: tuple[int, int] | None, reason: str) -> str | None:
        """Move blob ``hex_digest`` to ``quarantine/<hex>.<UTC timestamp>`` (fsynced); return that path
        relative to the store's root, or None when the path no longer holds the file that was
        checked (``ident``: its device and inode; None: whatever is there)."""
        path = self.path(hex_digest)
        with self._rename_lock:
            try:
                st = path.stat()
            except FileNotFoundError:
                return None
            if ident is not None and (st.st_dev, st.st_ino) != ident:
                # An upload replaced it meanwhile with verified bytes: those are fine.
                return None
            self._quarantine.mkdir(exist_ok=True)
            stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%S%fZ")
            target = self._quarantine / f"{hex_digest}.{stamp}"
            n = 1
            while target.exists():
                target = self._quarantine / f"{hex_digest}.{stamp}-{n}"
                n += 1
            os.rename(path, target)
            fsync_path(self._quarantine)
            fsync_path(self._dir)
        relative = f"{QUARANTINE_DIR}/{target.name}"
        logger.error(
            "blob sha256:%s is damaged (%s): moved to blobs/%s; it is no longer served", hex_digest, reason, relative
        )
        return relative

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
            raise BlobQuarantinedError(
                f"blob sha256:{hex_digest} was quarantined: its stored bytes no longer hashed to its digest"
            )

    def digests(self) -> tuple[list[str], list[str]]:
        """The stored blobs' hex digests, sorted, and the names under ``sha256/`` that are not digests."""
        try:
            names = sorted(os.listdir(self._dir))
        except FileNotFoundError:
            return [], []
        good = [n for n in names if _DIGEST.fullmatch("sha256:" + n)]
        return good, [n for n in names if not _DIGEST.fullmatch("sha256:" + n)]

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

    async def receive(self, hex_digest: str, chunks: AsyncIterable[bytes], *, max_bytes: int) -> bool:
        """Store the bytes of ``chunks`` as blob ``hex_digest``; return True when it is new.

        Raises ``BlobDigestMismatchError`` when the bytes hash to another digest and
        ``PayloadTooLargeError`` past ``max_bytes``; in every failure (a client that hangs up
        included) the temp file is removed and nothing is stored. When the blob already
        exists, the stored file is re-hashed once the upload has verified: intact, the upload
        is dropped (False); damaged, it is quarantined and the upload takes its place (True).
        So a re-upload of the right bytes always repairs, and the re-check costs one read of
        what the client has just sent in full: no client can make it read more than it sends.
        """
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
                        size += await anyio.to_thread.run_sync(_consume, h, f, batch)

            try:
                async with anyio.create_task_group() as tg, send:
                    tg.start_soon(store)
                    async for batch in _batched(chunks, max_bytes):
                        await send.send(batch)
            except BaseExceptionGroup as group:
                # The task group wraps what went wrong (a limit, a client gone, a disk error):
                # the caller gets that exception itself, as before the pipeline.
                raise _first_error(group) from None
            got = h.hexdigest()
            if got != hex_digest:
                raise BlobDigestMismatchError(
                    f"the uploaded {size} bytes have digest sha256:{got}, not sha256:{hex_digest}",
                    extra={"expected": "sha256:" + hex_digest, "actual": "sha256:" + got, "size": size},
                )
            if f is not None and tmp is not None:
                stored = await anyio.to_thread.run_sync(functools.partial(self.check, hex_digest))
                if stored.ok:
                    return False
                await anyio.to_thread.run_sync(self._commit, f, tmp, final)
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
        """Stream bytes ``[start, end)`` of the blob in chunks of at most ``READ_CHUNK``."""
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

    async def read_checked(self, hex_digest: str, size: int) -> AsyncIterator[bytes]:
        """Stream the whole blob (``size`` bytes, as stat'ed), hashing it as it goes.

        The last chunk is held back until the digest has been checked: when the bytes do not
        hash to the blob's name (or the file is shorter or longer than ``size``), the blob is
        quarantined and ``BlobQuarantinedError`` raised instead, which aborts the response. A
        client never receives a complete body with the blob's ETag that is not the blob.
        """
        f = await anyio.to_thread.run_sync(self.path(hex_digest).open, "rb")
        try:
            st = await anyio.to_thread.run_sync(os.fstat, f.fileno())
            h = hashlib.sha256()
            left = size
            held: bytes | None = None
            while left > 0:
                chunk = await anyio.to_thread.run_sync(_read_hashed, f, min(READ_CHUNK, left), h)
                if not chunk:
                    break
                left -= len(chunk)
                if held is not None:
                    yield held
                held = chunk
            extra = await anyio.to_thread.run_sync(f.read, 1) if left == 0 else b""
            if left or extra or h.hexdigest() != hex_digest:
                if left:
                    reason = f"are {left} bytes short"
                elif extra:
                    reason = "are longer than its size"
                else:
                    reason = f"hash to sha256:{h.hexdigest()}"
                with anyio.CancelScope(shield=True):
                    await anyio.to_thread.run_sync(
                        self.quarantine, hex_digest, (st.st_dev, st.st_ino), f"its stored bytes {reason}"
                    )
                raise BlobQuarantinedError(
                    f"blob sha256:{hex_digest} was quarantined while being served: its stored bytes {reason}"
                )
            if held is not None:
                yield held
        finally:
            f.close()


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
            except OSError as e:
                # A disk error must not end the scrub for good; the next pass retries.
                logger.error("blob scrub failed: %s", e)
            else:
                self.passes += 1
                self.last = result
                logger.info(
                    "blob scrub: %d blob(s), %d bytes checked in %.1f s; %d damaged and quarantined",
                    result.checked, result.bytes, time.monotonic() - started, len(result.damaged),
                )
            self._stop.wait(self.interval)


def _read_hashed(f: BinaryIO, n: int, h: hashlib._Hash) -> bytes:
    """Read up to ``n`` bytes and add them to ``h`` (one thread hop for both)."""
    chunk = f.read(n)
    h.update(chunk)
    return chunk


def _first_error(group: BaseExceptionGroup) -> BaseException:
    """The error a task group stopped for: the first one that is not the cancellation it caused."""
    leaves: list[BaseException] = []

    def walk(g: BaseExceptionGroup) -> None:
        for e in g.exceptions:
            if isinstance(e, BaseExceptionGroup):
                walk(e)
            else:
                leaves.append(e)

    walk(group)
    cancelled = anyio.get_cancelled_exc_class()
    return next((e for e in leaves if not isinstance(e, cancelled)), leaves[0])


async def _batched(chunks: AsyncIterable[bytes], max_bytes: int) -> AsyncIterator[list[bytes]]:
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


def _consume(h: hashlib._Hash, f: BinaryIO | None, chunks: list[bytes]) -> int:
    """Hash ``chunks`` and write them to ``f`` (when the blob is new); the bytes consumed."""
    for chunk in chunks:
        h.update(chunk)
    if f is not None:
        f.writelines(chunks)
    return sum(len(c) for c in chunks)


def _unlink_quietly(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
