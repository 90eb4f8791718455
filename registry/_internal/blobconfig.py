"""Where the registry keeps its blobs: the settings of the blob store, checked before anything starts.

The default is the data directory (``DATA/blobs``, ``blobs.LocalBlobStore``). ``kvgraft serve
--blob-store s3://BUCKET[/PREFIX]`` puts them on an S3-compatible object store instead
(``s3blobs.S3BlobStore``), under ``PREFIX/blobs/sha256/<hex>``; ``S3Settings`` says how to reach it.
This module imports nothing beyond the standard library, so ``RegistrySettings`` (and ``kvgraft
--help``) stay free of boto3, which is loaded only when an S3 store is opened.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

#: S3 refuses parts under 5 MiB (all but the last) and over 5 GiB.
MIN_S3_PART_SIZE = 5 * 1024 * 1024
MAX_S3_PART_SIZE = 5 * 1024 * 1024 * 1024
#: S3 allows at most this many parts per multipart upload: the largest blob is part_size times it.
MAX_S3_PARTS = 10_000
#: 16 MiB parts: a blob up to 156 GiB, and 16 MiB of memory per upload in flight.
DEFAULT_S3_PART_SIZE = 16 * 1024 * 1024
#: Seconds to connect, and to wait for each read of an answer, before the request is retried.
DEFAULT_S3_TIMEOUT = 30.0
#: Tries per request (the first and the retries, botocore's "standard" mode with backoff).
DEFAULT_S3_MAX_ATTEMPTS = 4
MAX_S3_MAX_ATTEMPTS = 20
#: Connections kept to the store: each upload, download and check in flight holds one.
DEFAULT_S3_MAX_CONNECTIONS = 64
#: Upload buffers held at once, across every upload in flight (16 full parts of the default size).
DEFAULT_S3_MEMORY_BUDGET = 256 * 1024 * 1024
#: Seconds an upload waits for room in that budget before it is answered 503 with Retry-After.
DEFAULT_S3_MEMORY_WAIT = 5.0

#: S3 bucket names (the rules of general purpose buckets): 3 to 63 lowercase letters, digits,
#: '.' and '-', starting and ending with a letter or digit.
_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]", re.ASCII)
#: A key prefix: '/'-separated names of printable ASCII without spaces, none of them '.' or '..'.
_PREFIX_PART = re.compile(r"[A-Za-z0-9!_.*'()+,;=@~-]+", re.ASCII)
_MAX_PREFIX = 512

_URL_HINT = "pass --blob-store s3://BUCKET or s3://BUCKET/PREFIX (a bucket name of lowercase letters, digits, '.' and '-')"


@dataclass(frozen=True)
class S3Location:
    """A bucket and a key prefix (empty, or ending in '/'): blobs live under ``<prefix>blobs/``."""

    bucket: str
    prefix: str

    @property
    def url(self) -> str:
        """The ``s3://`` URL it was given as (normalised)."""
        return f"s3://{self.bucket}/{self.prefix}".rstrip("/")


def parse_blob_store_url(url: str) -> S3Location:
    """The bucket and prefix of ``s3://BUCKET[/PREFIX]``; ``ValueError`` naming what is wrong otherwise."""
    shown = url if len(url) <= 100 else url[:97] + "..."
    scheme, sep, rest = url.partition("://")
    if not sep or scheme != "s3":
        raise ValueError(f"blob store {shown!r} is not an s3:// URL ({_URL_HINT})")
    bucket, _, prefix = rest.partition("/")
    if _BUCKET.fullmatch(bucket) is None or ".." in bucket:
        raise ValueError(f"blob store {shown!r}: {bucket!r} is not an S3 bucket name ({_URL_HINT})")
    prefix = prefix.strip("/")
    if len(prefix) > _MAX_PREFIX:
        raise ValueError(f"blob store {shown!r}: the prefix is longer than {_MAX_PREFIX} characters")
    if prefix:
        for part in prefix.split("/"):
            if part in ("", ".", "..") or _PREFIX_PART.fullmatch(part) is None:
                raise ValueError(
                    f"blob store {shown!r}: the prefix part {part!r} is not allowed "
                    "(use letters, digits and -_.!*'()+,;=@~ between single '/', no '.' or '..' parts)"
                )
        prefix += "/"
    return S3Location(bucket, prefix)


@dataclass(frozen=True)
class S3Settings:
    """How to reach an S3-compatible blob store (``kvgraft serve --s3-...``).

    Anything left None comes from the standard AWS configuration, as boto3 reads it:
    ``AWS_ENDPOINT_URL_S3`` or ``AWS_ENDPOINT_URL`` for the endpoint, ``AWS_REGION`` or
    ``AWS_DEFAULT_REGION``, and the credential chain (``AWS_ACCESS_KEY_ID`` and
    ``AWS_SECRET_ACCESS_KEY``, ``AWS_PROFILE``, the shared files, an instance role). The secret is
    read from a file, never taken on the command line, where any user of the host could see it.
    """

    #: The store's URL (``http://127.0.0.1:8333``, ``https://s3.eu-west-1.amazonaws.com``).
    endpoint_url: str | None = None
    region: str | None = None
    #: Both or neither: an access key id, and the file holding its secret (first line).
    access_key_id: str | None = None
    secret_access_key_file: Path | None = None
    #: Bytes per multipart part (and the largest blob sent in one PUT): memory per upload in flight.
    part_size: int = DEFAULT_S3_PART_SIZE
    #: Send each body's sha256 as x-amz-checksum-sha256, so the store refuses bytes damaged on the
    #: way; turn off for a store that rejects the header. The registry checks the digest itself either way.
    server_checksum: bool = True
    timeout: float = DEFAULT_S3_TIMEOUT
    max_attempts: int = DEFAULT_S3_MAX_ATTEMPTS
    max_connections: int = DEFAULT_S3_MAX_CONNECTIONS
    #: Bytes of upload buffers held at once across all uploads in flight; each upload reserves its
    #: buffer (its declared size, at most one part) before it reads a byte, so that stalled
    #: uploads cannot pin memory without bound. At least one part.
    memory_budget: int = DEFAULT_S3_MEMORY_BUDGET
    #: Seconds an upload waits for room in ``memory_budget``; then 503 ``uploads-busy``, Retry-After.
    memory_wait: float = DEFAULT_S3_MEMORY_WAIT

    def __post_init__(self) -> None:
        if self.endpoint_url is not None and re.fullmatch(r"https?://[^\s/?#]+(/[^\s?#]*)?", self.endpoint_url, re.ASCII) is None:
            raise ValueError(f"S3Settings.endpoint_url must be an http:// or https:// URL, got {self.endpoint_url!r}")
        if (self.access_key_id is None) != (self.secret_access_key_file is None):
            raise ValueError(
                "S3Settings.access_key_id and secret_access_key_file go together: pass both "
                "(--s3-access-key-id and --s3-secret-access-key-file), or neither to use the AWS environment"
            )
        if isinstance(self.part_size, bool) or not isinstance(self.part_size, int) or not MIN_S3_PART_SIZE <= self.part_size <= MAX_S3_PART_SIZE:
            raise ValueError(
                f"S3Settings.part_size must be an int from {MIN_S3_PART_SIZE} (5 MiB) to {MAX_S3_PART_SIZE} (5 GiB), got {self.part_size!r}"
            )
        if isinstance(self.timeout, bool) or not isinstance(self.timeout, int | float) or not (0 < self.timeout and math.isfinite(self.timeout)):
            raise ValueError(f"S3Settings.timeout must be a finite number > 0, got {self.timeout!r}")
        if isinstance(self.max_attempts, bool) or not isinstance(self.max_attempts, int) or not 1 <= self.max_attempts <= MAX_S3_MAX_ATTEMPTS:
            raise ValueError(f"S3Settings.max_attempts must be an int from 1 to {MAX_S3_MAX_ATTEMPTS}, got {self.max_attempts!r}")
        if isinstance(self.max_connections, bool) or not isinstance(self.max_connections, int) or self.max_connections < 1:
            raise ValueError(f"S3Settings.max_connections must be a positive int, got {self.max_connections!r}")
        if isinstance(self.memory_budget, bool) or not isinstance(self.memory_budget, int) or self.memory_budget < self.part_size:
            raise ValueError(
                f"S3Settings.memory_budget must be an int of at least part_size ({self.part_size}), got {self.memory_budget!r}"
            )
        if isinstance(self.memory_wait, bool) or not isinstance(self.memory_wait, int | float) or not (
            0 <= self.memory_wait <= 3600 and math.isfinite(self.memory_wait)
        ):
            raise ValueError(f"S3Settings.memory_wait must be a number of seconds from 0 to 3600, got {self.memory_wait!r}")

    @property
    def largest_blob(self) -> int:
        """The largest blob a multipart upload of ``part_size`` parts can hold."""
        return self.part_size * MAX_S3_PARTS
