"""Blobs on an S3-compatible object store (``kvgraft serve --blob-store s3://BUCKET/PREFIX``).

Keys mirror the local layout under the prefix: ``PREFIX/blobs/sha256/<hex>`` holds a blob,
``PREFIX/blobs/quarantine/<hex>.<UTC timestamp>`` a damaged one moved aside. The promises are
``blobs.BlobStore``'s; how this store keeps them:

- **Nothing visible until verified.** An upload is hashed as it arrives. One that fits in a part
  (``part_size``, 16 MiB) is held in memory and sent in one PutObject only once its digest
  matches; a larger one goes up as a multipart upload to the final key, which S3 shows only when
  CompleteMultipartUpload succeeds: that call is made only once the whole upload has hashed to
  its name, and every other end (a wrong digest, a limit, a client gone, an error) aborts the
  upload. ``prepare`` aborts multipart uploads a crash left behind once they are a day old (not
  sooner: another server process may still be writing them).
- **Server-side checksums.** Each PutObject and UploadPart carries the body's sha256 as
  ``x-amz-checksum-sha256`` (``S3Settings.server_checksum``), so the store refuses bytes damaged
  on the way; the registry's own check of the whole digest does not depend on it.
- **Bounded.** Connect and read timeouts, retries with backoff (botocore's standard mode) up
  to ``max_attempts`` per request, a connection pool of ``max_connections``; memory per upload
  is one part, per download one ``READ_CHUNK``; a blob has at most 10,000 parts. All uploads in
  flight together hold at most ``memory_budget`` bytes of buffers (``MemoryBudget``): each
  reserves its buffer (its declared size, at most one part) before reading a byte, waits up to
  ``memory_wait`` seconds for room, and is otherwise answered ``503 uploads-busy`` with
  ``Retry-After``, so uploads that stall cannot pin memory without bound.
- **Failures are the operator's, and said so.** An unreachable store, a timeout, a 5xx or a
  refused credential is ``StorageUnavailableError`` (503), a full store or quota
  ``InsufficientStorageError`` (507); neither names the endpoint or a key (the log has them).
- **Quarantine without clobbering.** A damaged object is copied to its quarantine key and
  deleted only if it still has the ETag of the copy that was checked (``CopySourceIfMatch``,
  ``If-Match``), so a check never removes bytes an upload just repaired.

boto3 is imported only here, when the store is opened (the ``s3`` extra).
"""

from __future__ import annotations

import base64
import datetime as dt
import functools
import hashlib
import logging
import threading
from collections.abc import AsyncIterable, AsyncIterator, Callable
from typing import Any, TypeVar

import anyio
import anyio.to_thread

from ..blobconfig import S3Location, S3Settings
from ..errors import (
    BlobNotFoundError,
    ConfigError,
    InsufficientStorageError,
    RegistryError,
    StorageUnavailableError,
    UploadsBusyError,
)
from .store import (
    _DIGEST,
    QUARANTINE_DIR,
    READ_CHUNK,
    BlobReader,
    BlobStore,
    check_upload_digest,
    consume_batch,
    log_quarantined,
    parse_digest_ref,
    quarantine_names_for,
    upload_batches,
)

logger = logging.getLogger("kvgraft.registry")

T = TypeVar("T")

#: Multipart uploads older than this are a crash's leftovers: no upload takes a day.
STALE_UPLOAD_SECONDS = 24 * 3600
#: Error codes meaning the store (or the bucket's quota) is full: MinIO's, Ceph's, and the generic ones.
_FULL_CODES = frozenset({"XMinioStorageFull", "QuotaExceeded", "InsufficientStorage", "StorageFull", "XAmzQuotaExceeded"})
#: Error codes meaning the registry's credentials or the bucket's policy refuse it.
_REFUSED_CODES = frozenset({
    "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken", "AllAccessDisabled",
    "AccountProblem", "InvalidSecurity", "TokenRefreshRequired", "403", "401",
})
#: Error codes of a key or bucket that is not there.
_MISSING_CODES = frozenset({"NoSuchKey", "NotFound", "404"})
_NO_BUCKET_CODES = frozenset({"NoSuchBucket"})
#: The store does not take a header the registry sends (x-amz-checksum-sha256, If-Match).
_UNSUPPORTED_CODES = frozenset({"NotImplemented", "InvalidArgument", "InvalidRequest"})

_UNAVAILABLE_HINT = "retry later; the registry's operator must check its S3 blob store (reachable, answering, credentials valid)"
_FULL_HINT = "retry later; the registry's operator must free space or raise the quota of its S3 blob store (nothing of this request was kept)"
_CHECKSUM_HINT = "if the store does not support x-amz-checksum-sha256, start the registry with --no-s3-server-checksum"


def _status(e: Exception) -> tuple[str, int]:
    """A botocore ClientError's error code and HTTP status."""
    response: dict[str, Any] = getattr(e, "response", None) or {}
    return str(response.get("Error", {}).get("Code", "")), int(response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)


def s3_error(e: Exception, what: str) -> RegistryError:
    """The 503 or 507 error an S3 failure stands for (``what``: what failed, "the blob could not be stored").

    The message names the store's error code (or the kind of transport failure) but not the
    endpoint, the bucket or the key: the server log has those (the exception is chained).
    """
    from botocore.exceptions import ClientError

    if isinstance(e, ClientError):
        code, status = _status(e)
        if status == 507 or code in _FULL_CODES:
            return InsufficientStorageError(f"{what}: the registry's S3 blob store is full ({code or status})", hint=_FULL_HINT)
        if code in _REFUSED_CODES or status in (401, 403):
            return StorageUnavailableError(
                f"{what}: the registry's S3 blob store refused its credentials ({code or status})",
                hint="retry later; the registry's operator must check its S3 credentials and the bucket's policy",
            )
        if code in _NO_BUCKET_CODES:
            return StorageUnavailableError(f"{what}: the registry's S3 bucket does not exist", hint=_UNAVAILABLE_HINT)
        if code == "BadDigest" or code in _UNSUPPORTED_CODES:
            return StorageUnavailableError(
                f"{what}: the registry's S3 blob store refused the request ({code})",
                hint=f"retry; the registry's operator: {_CHECKSUM_HINT}",
            )
        return StorageUnavailableError(f"{what}: the registry's S3 blob store answered {status} {code}".rstrip(), hint=_UNAVAILABLE_HINT)
    return StorageUnavailableError(f"{what}: the registry's S3 blob store did not answer ({type(e).__name__})", hint=_UNAVAILABLE_HINT)


def _is_missing(e: Exception) -> bool:
    code, status = _status(e)
    return code in _MISSING_CODES or (status == 404 and code not in _NO_BUCKET_CODES)


def _precondition_failed(e: Exception) -> bool:
    code, status = _status(e)
    return status == 412 or code == "PreconditionFailed"


def _b64_sha256(data: bytes) -> str:
    return base64.b64encode(hashlib.sha256(data).digest()).decode("ascii")


#: How often an upload waiting for room in the memory budget looks again.
_BUDGET_POLL_SECONDS = 0.05
#: The Retry-After of an upload refused for want of room (seconds).
_BUDGET_RETRY_AFTER = 5


class MemoryBudget:
    """The bytes of upload buffers one store holds at once, across all its uploads in flight.

    ``reserve(n, wait=...)`` takes ``n`` bytes, waiting up to ``wait`` seconds for others to
    ``release`` theirs, else raises ``UploadsBusyError`` (503, Retry-After). An upload reserves
    all it may hold before it reads a byte, and holds it to its end: so no upload ever waits
    while holding part of the budget, and waiting uploads cannot starve each other into a
    deadlock. A reservation larger than the whole budget is cut to the budget.
    """

    def __init__(self, total: int) -> None:
        self.total = total
        self._used = 0
        # Reservations are made on the event loop; the lock keeps the count right if one is not.
        self._lock = threading.Lock()

    @property
    def used(self) -> int:
        """Bytes reserved now."""
        return self._used

    def _try(self, n: int) -> bool:
        with self._lock:
            if self._used + n > self.total:
                return False
            self._used += n
            return True

    async def reserve(self, n: int, *, wait: float) -> int:
        """Reserve ``n`` bytes (at most the whole budget); return what was reserved, for ``release``."""
        n = min(n, self.total)
        deadline = anyio.current_time() + wait
        while not self._try(n):
            if anyio.current_time() >= deadline:
                raise UploadsBusyError(
                    f"the registry's uploads in flight hold its whole upload memory budget ({self.total} bytes); "
                    "this upload was not read",
                    retry_after=_BUDGET_RETRY_AFTER,
                    extra={"limit": self.total},
                )
            await anyio.sleep(_BUDGET_POLL_SECONDS)
        return n

    def release(self, n: int) -> None:
        """Give back ``n`` bytes that ``reserve`` returned."""
        with self._lock:
            self._used -= n


class _ObjectReader:
    """An object's body, as a ``BlobReader``: its identity is the ETag of the copy being read."""

    def __init__(self, body: Any, etag: str, what: str) -> None:
        self._body = body
        self.ident: object = etag
        self._what = what

    def read(self, n: int) -> bytes:
        from botocore.exceptions import BotoCoreError

        try:
            return bytes(self._body.read(n))
        except (BotoCoreError, OSError) as e:
            # A connection cut or timed out mid-body: not retried (the bytes so far are sent).
            raise s3_error(e, self._what) from e

    def close(self) -> None:
        self._body.close()


class S3BlobStore(BlobStore):
    """Blobs under ``s3://BUCKET/PREFIX/blobs/`` (the module docstring says how it keeps ``BlobStore``'s promises)."""

    def __init__(self, location: S3Location, settings: S3Settings) -> None:
        try:
            import boto3
            from botocore.config import Config
        except ImportError as e:
            raise ConfigError(
                f"the blob store {location.url} needs boto3, which is not installed",
                hint="pip install 'kvgraft[s3]'",
            ) from e

        self.location = location
        self.settings = settings
        self.name = location.url
        self._bucket = location.bucket
        self._base = f"{location.prefix}blobs/"
        secret = None
        if settings.secret_access_key_file is not None:
            try:
                with settings.secret_access_key_file.open(encoding="utf-8") as f:
                    secret = f.readline(1024).strip()
            except (OSError, UnicodeDecodeError) as e:
                raise ConfigError(
                    f"cannot read the S3 secret access key file {settings.secret_access_key_file}: {e}",
                    hint="pass --s3-secret-access-key-file FILE holding the secret key on its first line",
                ) from e
            if not secret:
                raise ConfigError(
                    f"the S3 secret access key file {settings.secret_access_key_file} is empty",
                    hint="write the secret key on its first line",
                )
        session = boto3.session.Session(
            aws_access_key_id=settings.access_key_id, aws_secret_access_key=secret, region_name=settings.region
        )
        self._client: Any = session.client(
            "s3",
            # None: boto3 reads AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL, else AWS's own endpoint.
            endpoint_url=settings.endpoint_url,
            config=Config(
                connect_timeout=settings.timeout,
                read_timeout=settings.timeout,
                retries={"max_attempts": settings.max_attempts, "mode": "standard"},
                max_pool_connections=settings.max_connections,
                # Checksums only where the registry asks for them (its sha256, below): botocore's
                # default CRC32 on every request is refused by many S3-compatible stores.
                request_checksum_calculation="when_required",
                response_checksum_validation="when_required",
                # Path-style (http://host/bucket/key) works with every S3-compatible store and with
                # AWS; virtual-host style needs DNS for each bucket name.
                s3={"addressing_style": "path"},
            ),
        )
        # Serialises quarantines within this process (the If-Match conditions cover the others).
        self._quarantine_lock = threading.Lock()
        self.memory = MemoryBudget(settings.memory_budget)

    def close(self) -> None:
        self._client.close()

    def _key(self, hex_digest: str) -> str:
        # Callers pass parse_digest_ref's output; re-check so that no other string becomes a key.
        parse_digest_ref("sha256:" + hex_digest)
        return f"{self._base}sha256/{hex_digest}"

    def _call(self, what: str, fn: Callable[..., T], **kwargs: Any) -> T:
        """``fn(Bucket=..., **kwargs)``, every failure the 503/507 it stands for (``what``: what
        failed), except a missing key or a failed precondition: that ``ClientError`` is the caller's."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return fn(Bucket=self._bucket, **kwargs)
        except ClientError as e:
            if _is_missing(e) or _precondition_failed(e):
                raise
            raise s3_error(e, what) from e
        except BotoCoreError as e:
            raise s3_error(e, what) from e

    def _copy(self, Bucket: str, source: str, target: str, condition: dict[str, str]) -> None:
        from boto3.s3.transfer import TransferConfig

        # The managed copy: one CopyObject, or UploadPartCopy parts past 1 GiB (S3 copies at most
        # 5 GiB at once); either way only if the object is still the copy that was checked.
        self._client.copy(
            {"Bucket": Bucket, "Key": source}, Bucket, target, ExtraArgs=condition,
            Config=TransferConfig(multipart_threshold=1 << 30, multipart_chunksize=1 << 30, use_threads=False),
        )

    # --- start -------------------------------------------------------------------------------

    def prepare(self) -> None:
        """Check that the bucket answers to these credentials; abort multipart uploads a day old."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            self._client.head_bucket(Bucket=self._bucket)
        except (ClientError, BotoCoreError) as e:
            code, status = _status(e)
            if status == 404 or code in _NO_BUCKET_CODES:
                reason, hint = "the bucket does not exist", "create the bucket first, or pass the right one in --blob-store"
            elif status in (401, 403) or code in _REFUSED_CODES:
                reason, hint = (
                    f"the store refused the credentials ({code or status})",
                    "pass --s3-access-key-id and --s3-secret-access-key-file, or set AWS_ACCESS_KEY_ID and "
                    "AWS_SECRET_ACCESS_KEY, for a key that may read and write the bucket",
                )
            elif isinstance(e, ClientError):
                reason, hint = f"the store answered {status} {code}".rstrip(), "check --s3-endpoint-url and the store's log"
            else:
                reason, hint = f"the store did not answer ({e})", "check --s3-endpoint-url (or AWS_ENDPOINT_URL_S3) and that the store runs"
            raise ConfigError(f"the blob store {self.name} cannot be used: {reason}", hint=hint) from e
        cutoff = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=STALE_UPLOAD_SECONDS)
        stale = 0
        try:
            pages = self._client.get_paginator("list_multipart_uploads").paginate(Bucket=self._bucket, Prefix=f"{self._base}sha256/")
            for page in pages:
                for upload in page.get("Uploads", []):
                    if upload["Initiated"] < cutoff:
                        self._client.abort_multipart_upload(Bucket=self._bucket, Key=upload["Key"], UploadId=upload["UploadId"])
                        stale += 1
        except (ClientError, BotoCoreError) as e:
            # Leftovers are invisible and cost only space: a store that cannot list or abort them
            # (or a key not allowed to) still serves; a lifecycle rule can clear them instead.
            logger.warning("unfinished multipart uploads in %s were not cleared: %s", self.name, e)
        if stale:
            logger.info("aborted %d unfinished multipart upload(s) older than a day in %s", stale, self.name)

    # --- metadata ----------------------------------------------------------------------------

    def size(self, hex_digest: str) -> int | None:
        from botocore.exceptions import ClientError

        try:
            head = self._call("the blob could not be looked up", self._client.head_object, Key=self._key(hex_digest))
        except ClientError as e:
            if _is_missing(e):
                return None
            raise s3_error(e, "the blob could not be looked up") from e
        return int(head["ContentLength"])

    def _names(self, under: str, what: str, *, max_keys: int | None = None) -> list[str]:
        """The key names under ``<base><under>``, without that prefix, sorted (S3 lists in key order)."""
        from botocore.exceptions import BotoCoreError, ClientError

        prefix = f"{self._base}{under}"
        names: list[str] = []
        paginate: dict[str, Any] = {"Prefix": prefix}
        if max_keys is not None:
            paginate["PaginationConfig"] = {"MaxItems": max_keys}
        try:
            for page in self._client.get_paginator("list_objects_v2").paginate(Bucket=self._bucket, **paginate):
                names.extend(obj["Key"][len(prefix):] for obj in page.get("Contents", []))
        except (ClientError, BotoCoreError) as e:
            raise s3_error(e, what) from e
        return sorted(names)

    def quarantined(self, hex_digest: str) -> list[str]:
        parse_digest_ref("sha256:" + hex_digest)
        # A blob is quarantined a handful of times at most; 1000 names are plenty to say it was.
        names = self._names(f"{QUARANTINE_DIR}/{hex_digest}.", "the blob could not be looked up", max_keys=1000)
        return [f"{hex_digest}.{n}" for n in names]

    def quarantine_names(self) -> list[str]:
        return self._names(f"{QUARANTINE_DIR}/", "the quarantine could not be listed")

    def digests(self) -> tuple[list[str], list[str]]:
        names = self._names("sha256/", "the blobs could not be listed")
        good = [n for n in names if _DIGEST.fullmatch("sha256:" + n)]
        return good, [n for n in names if not _DIGEST.fullmatch("sha256:" + n)]

    # --- reading -----------------------------------------------------------------------------

    def _get(self, hex_digest: str, **kwargs: Any) -> tuple[Any, str] | None:
        from botocore.exceptions import ClientError

        what = "the blob could not be read"
        try:
            got = self._call(what, self._client.get_object, Key=self._key(hex_digest), **kwargs)
        except ClientError as e:
            if _is_missing(e):
                return None
            raise s3_error(e, what) from e
        return got["Body"], str(got.get("ETag", ""))

    def open(self, hex_digest: str) -> BlobReader | None:
        got = self._get(hex_digest)
        return None if got is None else _ObjectReader(got[0], got[1], "the blob could not be read")

    async def read(self, hex_digest: str, start: int, end: int) -> AsyncIterator[bytes]:
        if end <= start:
            return
        got = await anyio.to_thread.run_sync(functools.partial(self._get, hex_digest, Range=f"bytes={start}-{end - 1}"))
        if got is None:
            raise BlobNotFoundError(f"no blob sha256:{hex_digest} is stored here")
        reader = _ObjectReader(got[0], got[1], "the blob could not be read")
        try:
            left = end - start
            while left > 0:
                chunk = await anyio.to_thread.run_sync(reader.read, min(READ_CHUNK, left))
                if not chunk:
                    logger.error("blob sha256:%s ended %d bytes early", hex_digest, left)
                    return
                left -= len(chunk)
                yield chunk
        finally:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(reader.close)

    # --- quarantine --------------------------------------------------------------------------

    def quarantine(self, hex_digest: str, ident: object | None, reason: str) -> str | None:
        from botocore.exceptions import ClientError

        final = self._key(hex_digest)
        what = "the damaged blob could not be moved aside"
        condition = {"CopySourceIfMatch": ident} if isinstance(ident, str) and ident else {}
        with self._quarantine_lock:
            taken = set(self.quarantined(hex_digest))
            name = next(n for n in quarantine_names_for(hex_digest) if n not in taken)
            target = f"{self._base}{QUARANTINE_DIR}/{name}"
            try:
                self._call(what, self._copy, source=final, target=target, condition=condition)
            except ClientError as e:
                if _is_missing(e) or _precondition_failed(e):
                    # Gone, or replaced meanwhile by an upload that verified its bytes: those are fine.
                    return None
                raise s3_error(e, what) from e
            try:
                self._call(what, self._client.delete_object, Key=final, **({"IfMatch": ident} if condition else {}))
            except ClientError as e:
                if not (_is_missing(e) or _precondition_failed(e)):
                    raise s3_error(e, what) from e
                # Repaired between the copy and the delete: keep the good bytes, drop the copy.
                self._call(what, self._client.delete_object, Key=target)
                return None
        relative = f"{QUARANTINE_DIR}/{name}"
        log_quarantined(hex_digest, reason, relative)
        return relative

    # --- uploads -----------------------------------------------------------------------------

    def _checksum(self, data: bytes) -> dict[str, str]:
        return {"ChecksumSHA256": _b64_sha256(data)} if self.settings.server_checksum else {}

    def _put(self, key: str, data: bytes) -> None:
        self._call("the blob could not be stored", self._client.put_object, Key=key, Body=data,
                   ContentLength=len(data), ContentType="application/octet-stream", **self._checksum(data))

    def _create_upload(self, key: str) -> str:
        extra = {"ChecksumAlgorithm": "SHA256"} if self.settings.server_checksum else {}
        created = self._call("the blob could not be stored", self._client.create_multipart_upload, Key=key,
                             ContentType="application/octet-stream", **extra)
        return str(created["UploadId"])

    def _upload_part(self, key: str, upload_id: str, number: int, data: bytes) -> dict[str, Any]:
        checksum = self._checksum(data)
        done = self._call("the blob could not be stored", self._client.upload_part, Key=key, UploadId=upload_id,
                          PartNumber=number, Body=data, ContentLength=len(data), **checksum)
        return {"ETag": done["ETag"], "PartNumber": number, **checksum}

    def _complete(self, key: str, upload_id: str, parts: list[dict[str, Any]]) -> None:
        self._call("the blob could not be stored", self._client.complete_multipart_upload, Key=key,
                   UploadId=upload_id, MultipartUpload={"Parts": parts})

    def _abort(self, key: str, upload_id: str) -> None:
        from botocore.exceptions import ClientError

        # The upload's own failure is what the client must hear, not this one's.
        try:
            self._call("the unfinished upload could not be aborted", self._client.abort_multipart_upload,
                       Key=key, UploadId=upload_id)
        except (RegistryError, ClientError) as e:
            # Never visible (not completed); prepare() aborts it at a later start once a day old.
            logger.warning("multipart upload %s of %s could not be aborted: %s", upload_id, key, e)

    async def receive(
        self, hex_digest: str, chunks: AsyncIterable[bytes], *, max_bytes: int, declared_size: int | None = None
    ) -> bool:
        part_size = self.settings.part_size
        # The buffer this upload may hold (one part, or less when it says it is smaller), reserved
        # before a byte is read: a stalled upload holds no more than it reserved, and all of them
        # together no more than the budget. A body longer than it declared is cut by the HTTP server.
        want = part_size if declared_size is None else max(1, min(declared_size, part_size))
        held = await self.memory.reserve(want, wait=self.settings.memory_wait)
        try:
            return await self._receive(hex_digest, chunks, max_bytes=max_bytes)
        finally:
            self.memory.release(held)

    async def _receive(self, hex_digest: str, chunks: AsyncIterable[bytes], *, max_bytes: int) -> bool:
        final = self._key(hex_digest)
        part_size = self.settings.part_size
        # S3 takes at most 10,000 parts: past that the blob cannot be stored here, whatever the setting.
        limit = min(max_bytes, self.settings.largest_blob)
        h = hashlib.sha256()
        size = 0
        # The bytes of the part being gathered: memory stays one part and one request chunk.
        pending = bytearray()
        upload_id: str | None = None
        parts: list[dict[str, Any]] = []
        completed = False
        try:
            async for batch in upload_batches(chunks, limit):
                size += await anyio.to_thread.run_sync(consume_batch, h, None, batch)
                for chunk in batch:
                    pending += chunk
                while len(pending) >= part_size:
                    # A full part goes up now, invisible until the upload is completed.
                    if upload_id is None:
                        upload_id = await anyio.to_thread.run_sync(self._create_upload, final)
                    body = bytes(memoryview(pending)[:part_size])
                    del pending[:part_size]
                    parts.append(await anyio.to_thread.run_sync(self._upload_part, final, upload_id, len(parts) + 1, body))
            check_upload_digest(hex_digest, h, size)
            stored = await anyio.to_thread.run_sync(functools.partial(self.check, hex_digest))
            if stored.ok:
                return False
            last = bytes(pending)
            if upload_id is None:
                # The whole blob fits in one part: one PutObject makes it visible, verified.
                await anyio.to_thread.run_sync(self._put, final, last)
            else:
                if last:
                    parts.append(await anyio.to_thread.run_sync(self._upload_part, final, upload_id, len(parts) + 1, last))
                # The commit point: S3 shows the object only now, and the digest has matched.
                await anyio.to_thread.run_sync(self._complete, final, upload_id, parts)
                completed = True
            what = "repaired" if stored.quarantined_to is not None else "stored"
            logger.info("%s blob sha256:%s (%d bytes, %d part(s)) in %s", what, hex_digest, size, max(len(parts), 1), self.name)
            return True
        finally:
            if upload_id is not None and not completed:
                # A wrong digest, a limit, a client gone, an error, an intact copy already there:
                # the parts go; shielded so cancellation cannot skip it.
                with anyio.CancelScope(shield=True):
                    await anyio.to_thread.run_sync(self._abort, final, upload_id)
