"""The content-addressed blob store: ``blobs/sha256/<hex>``, written only whole and verified.

An upload streams into a temp file under ``blobs/tmp`` while it is hashed; only when the
digest matches is the file fsynced and renamed into place, so a blob path always holds exactly
the bytes of its name, and a refused or broken upload leaves nothing behind. Reads stream in
fixed-size chunks: memory stays flat in the blob's size.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import shutil
import tempfile
from collections.abc import AsyncIterable, AsyncIterator
from pathlib import Path
from typing import BinaryIO

import anyio
import anyio.to_thread

from .errors import BadDigestError, BlobDigestMismatchError, PayloadTooLargeError

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


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class BlobStore:
    """Blobs under ``root/sha256/<hex>``, uploads in progress under ``root/tmp``."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._dir = root / "sha256"
        self._tmp = root / "tmp"

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

    async def receive(self, hex_digest: str, chunks: AsyncIterable[bytes], *, max_bytes: int) -> bool:
        """Store the bytes of ``chunks`` as blob ``hex_digest``; return True when it is new.

        Raises ``BlobDigestMismatchError`` when the bytes hash to another digest and
        ``PayloadTooLargeError`` past ``max_bytes``; in every failure (a client that hangs up
        included) the temp file is removed and nothing is stored. When the blob already
        exists the bytes are still checked, but not written.
        """
        final = self.path(hex_digest)
        existed = await anyio.to_thread.run_sync(final.is_file)
        h = hashlib.sha256()
        tmp: Path | None = None
        f: BinaryIO | None = None
        try:
            if not existed:
                fd, name = await anyio.to_thread.run_sync(lambda: tempfile.mkstemp(dir=self._tmp, prefix=hex_digest[:16] + "."))
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
                await anyio.to_thread.run_sync(self._commit, f, tmp, final)
                f = None
                tmp = None
                logger.info("stored blob sha256:%s (%d bytes)", hex_digest, size)
            return not existed
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
        os.replace(tmp, final)
        _fsync_dir(self._dir)

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
