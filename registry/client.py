"""The registry client: publish, pull and mirror over the HTTP API, built on httpx.

Every answer the registry gives is checked here, never trusted: a published entry's leaf is
recomputed from the envelope bytes and its inclusion proof is verified against a checkpoint
signed by the registry key; a pulled artifact's blobs are hashed while they stream, its
statement's subjects must be exactly the downloaded files, and its envelope is proved to be in
the log before the directory appears; a mirror ends with the target's signed tree at the copied
size equal to the source's, and a consistency proof from there to the target's current size.

Blobs stream both ways in 1 MiB chunks, so memory stays flat in the blob size. The registry key
is either pinned (a PEM file) or fetched from ``/v1/log/key`` and reported as trust on first use.

Nor are the registry's sizes and pace trusted (``ClientLimits``): every request has one total
deadline (connect to last byte, enforced on each socket read and write), a JSON answer is read
up to ``max_json_bytes`` and no further, a blob is written up to its Content-Length and no
further, and a listing must advance (a new cursor, strictly increasing log indexes) within
``max_pages`` and ``max_items``. Every checkpoint verified is compared with the newest one this
machine verified before for the same log (``CheckpointMemory``, under ``$KVGRAFT_HOME``): one
that does not provably extend it (RFC 9162 consistency proof) is refused, as Go's sumdb client
refuses a forked checksum database.

This module needs httpx (the ``registry`` extra) but not litestar, duckdb, uvicorn or the
server's modules; ``kvgraft.registry.client_cli`` imports it only when a command runs.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import datetime
import errno
import fcntl
import hashlib
import json
import math
import os
import shutil
import tempfile
import time
import urllib.parse
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import httpcore
import httpx
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

import kvgraft
from kvgraft.schemas import (
    KvArtifactStatement,
    KvgraftError,
    SchemaError,
    Statement,
    hex_of,
    parse_sha256,
    parse_statement,
)
from kvgraft.verifier import (
    RECORD_FILE,
    BadSignatureError,
    Checkpoint,
    ThresholdNotMetError,
    TrustedKeys,
    UnknownKeyError,
    VerificationError,
    b64decode_any,
    hash_leaf,
    keyid_of,
    load_public_key,
    parse_envelope,
    parse_public_key,
    public_key_pem,
    verify_checkpoint,
    verify_consistency,
    verify_inclusion,
    verify_statement_envelope,
    verify_subjects,
    write_atomic,
)

#: Blobs move in chunks of this size, both ways: memory stays flat in the blob size.
CHUNK = 1 << 20
#: The engine's file names (not imported: the engine needs torch, the client must not).
KV_FILE = "kv.safetensors"
STATEMENT_FILE = "statement.dsse.json"
#: The registry's default envelope limit is 16 MiB; refuse to read a local "envelope" far past it.
MAX_ENVELOPE_BYTES = 64 << 20
#: The largest page the registry serves.
PAGE_LIMIT = 500
#: No real chain is this deep; a cycle cannot make publish or pull recurse forever.
MAX_CHAIN = 1_000

# --- the client's limits (docs/registry.md, "Client limits") -----------------------------------

#: Seconds one request may take in all, from connecting to its last byte (``--timeout``).
DEFAULT_TIMEOUT = 60.0
#: The largest JSON answer read (``--max-json-bytes``); a longer one is refused unread.
DEFAULT_MAX_JSON_BYTES = 64 << 20
#: The deepest JSON answer accepted (the registry's documents nest a handful of levels).
DEFAULT_MAX_JSON_DEPTH = 64
#: The largest checkpoint note read (a note is a few hundred bytes; witnesses add lines).
DEFAULT_MAX_NOTE_BYTES = 64 << 10
#: The largest error document read before an error is reported.
DEFAULT_MAX_PROBLEM_BYTES = 64 << 10
#: The largest blob accepted (``--max-blob-bytes``): a larger Content-Length is refused before a byte.
DEFAULT_MAX_BLOB_BYTES = 64 << 30
#: A blob transfer gets ``--timeout`` plus its size at this rate in bytes/s (``--min-rate``).
DEFAULT_MIN_RATE = 1 << 20
#: The most pages and items one listing may take; past them the listing stops with an error.
DEFAULT_MAX_PAGES = 100_000
DEFAULT_MAX_ITEMS = 1_000_000

_HEX64 = frozenset("0123456789abcdef")


@dataclass(frozen=True)
class ClientLimits:
    """How much of a registry's time, memory and disk the client will spend on one request.

    A registry is not trusted with these: an answer past a limit ends the request with a
    one-line ``RegistryClientError`` naming the limit, never with a full memory or disk.
    """

    #: Seconds for one request in all (connect, send, headers, body): not per read.
    timeout: float = DEFAULT_TIMEOUT
    max_json_bytes: int = DEFAULT_MAX_JSON_BYTES
    max_json_depth: int = DEFAULT_MAX_JSON_DEPTH
    #: Envelopes are read whole; the registry's own default limit is 16 MiB.
    max_envelope_bytes: int = MAX_ENVELOPE_BYTES
    max_note_bytes: int = DEFAULT_MAX_NOTE_BYTES
    max_problem_bytes: int = DEFAULT_MAX_PROBLEM_BYTES
    max_blob_bytes: int = DEFAULT_MAX_BLOB_BYTES
    #: Bytes per second a blob transfer must average: its deadline is timeout + size / min_rate.
    min_rate: int = DEFAULT_MIN_RATE
    max_pages: int = DEFAULT_MAX_PAGES
    max_items: int = DEFAULT_MAX_ITEMS

    def __post_init__(self) -> None:
        if not (math.isfinite(self.timeout) and self.timeout > 0):
            raise RegistryClientError(f"timeout {self.timeout} is not a positive number of seconds", hint="pass --timeout S with S > 0")
        for name in (
            "max_json_bytes",
            "max_json_depth",
            "max_envelope_bytes",
            "max_note_bytes",
            "max_problem_bytes",
            "max_blob_bytes",
            "min_rate",
            "max_pages",
            "max_items",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise RegistryClientError(
                    f"{name} {value!r} is not a positive integer", hint="pass a positive whole number"
                )

    def blob_seconds(self, size: int) -> float:
        """The deadline of a blob transfer of ``size`` bytes: the timeout plus its time at ``min_rate``."""
        return self.timeout + size / self.min_rate


# --- errors ------------------------------------------------------------------------------------


class RegistryClientError(KvgraftError):
    """Base class of every failure of the registry client (a ``kvgraft.KvgraftError``)."""

    default_hint: str | None = "check the registry URL and the inputs named in the message"


class RegistryUnavailableError(RegistryClientError):
    """The registry could not be reached, or the connection broke mid-transfer."""

    default_hint = "check that the registry URL is right and the server is running, then retry"


class RegistryResponseError(RegistryClientError):
    """The registry answered with an error (an RFC 9457 problem) or with a malformed document."""

    default_hint = "see the registry's message; the API is described in docs/registry.md"

    def __init__(
        self, message: str, *, hint: str | None = None, status: int | None = None, problem: dict[str, Any] | None = None
    ) -> None:
        super().__init__(message, hint=hint)
        self.status = status
        #: The problem document as served (empty when the body was not one).
        self.problem: dict[str, Any] = dict(problem or {})

    @property
    def problem_type(self) -> str:
        """The problem's ``type`` URI ("" when there was none)."""
        value = self.problem.get("type")
        return value if isinstance(value, str) else ""


class RegistryAuthError(RegistryResponseError):
    """401 or 403: no token, an unknown or revoked token, or a key the token is not bound to."""

    default_hint = "pass a valid --token bound to the key that signed the envelope"


class RegistryNotFoundError(RegistryResponseError):
    """404: the registry holds no such artifact, entry or blob."""

    default_hint = "check the digest; list what the registry holds with GET /v1/artifacts"


class LocalFilesError(RegistryClientError):
    """A local directory or file cannot be published or written (missing, unsafe, already there)."""

    default_hint = "pass an artifact directory (kv.safetensors + statement.dsse.json) or a record directory"


class ParentNotPublishedError(RegistryClientError):
    """An artifact's parent tensors are neither on the registry nor found locally."""

    default_hint = "publish the parent artifact first: kvgraft publish --registry URL PARENT_DIR"


class BlobDigestError(RegistryClientError):
    """Bytes that arrived (or were sent) hash to another digest than the one they were asked for."""

    default_hint = "the registry served altered bytes; nothing was kept. Report it to the registry's operator"


class EvidenceError(RegistryClientError):
    """The registry's evidence does not hold: a checkpoint signature, an inclusion or consistency
    proof, a leaf hash, or a statement that does not describe what was downloaded."""

    default_hint = "do not use what this registry served; report it to the registry's operator"


class EnvelopeSignatureError(RegistryClientError):
    """A pulled envelope's signatures do not satisfy the trusted keys."""

    default_hint = "check --trusted-keys: it must hold the publisher's public key (kvgraft keys trust)"


class MirrorDivergedError(RegistryClientError):
    """The target's log is not a prefix of the source's (or does not extend it): it is not a mirror."""

    default_hint = "mirror into an empty registry, or into one that only ever received this source's entries"


# --- progress ----------------------------------------------------------------------------------


class ResponseTooLargeError(RegistryResponseError):
    """An answer is larger, deeper or slower to parse than the client's limits allow."""

    default_hint = (
        "the registry sent more than any kvgraft registry does: report it to its operator "
        "(raise --max-json-bytes only if you trust it)"
    )


class ListingError(RegistryResponseError):
    """A paged listing does not advance: its cursor repeats, its log indexes do not increase, or it
    runs past ``max_pages`` / ``max_items``."""

    default_hint = "the registry's listing does not end; report it to the registry's operator"


class DiskFullError(LocalFilesError):
    """A pulled file does not fit on the local disk (checked first; ENOSPC while writing)."""

    default_hint = "free space on that filesystem, or pull into a directory on another one"


class LogForkError(EvidenceError):
    """A checkpoint does not provably extend the newest one this machine verified for the same log:
    a possible split view (two trees for one log) or rollback (the log lost entries)."""

    default_hint = (
        "do not use this registry's answers: report both checkpoints to its operator. Only if the "
        "operator confirms the log was deliberately reset, remove the remembered checkpoint file named here"
    )


class CheckpointMemoryError(LocalFilesError):
    """The file that remembers a log's newest verified checkpoint cannot be read, verified or written."""

    default_hint = "check $KVGRAFT_HOME/checkpoints; remove the named file only if you know why it is damaged"


class Progress(Protocol):
    """The part of a tqdm bar the client uses."""

    def update(self, n: float | None = 1) -> bool | None: ...

    def close(self) -> None: ...


class _NoProgress:
    def update(self, n: float | None = 1) -> bool | None:
        return None

    def close(self) -> None:
        return None


def _bar(enabled: bool, total: int | None, desc: str, unit: str = "B") -> Progress:
    """A tqdm bar on stderr, or a no-op when disabled, pointless (nothing to do) or tqdm is missing."""
    if not enabled or total == 0:
        return _NoProgress()
    try:
        import sys

        from tqdm import tqdm
    except ImportError:
        # tqdm comes with the engine's dependencies; the registry extra alone may lack it.
        return _NoProgress()
    bar: Progress = tqdm(
        total=total, desc=desc, unit=unit, unit_scale=unit == "B", unit_divisor=1024, file=sys.stderr, leave=False
    )
    return bar


@contextlib.contextmanager
def _progress(enabled: bool, total: int | None, desc: str, unit: str = "B") -> Iterator[Progress]:
    bar = _bar(enabled, total, desc, unit)
    try:
        yield bar
    finally:
        bar.close()


# --- small helpers -----------------------------------------------------------------------------


def _digest(value: str, what: str = "digest") -> str:
    try:
        return str(parse_sha256(value))
    except SchemaError as e:
        raise RegistryClientError(
            f"{what} {value[:80]!r} is not sha256:<64 lowercase hex>", hint="copy the digest exactly"
        ) from e


def _sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _malformed(url: str, what: str) -> RegistryResponseError:
    return RegistryResponseError(
        f"{url} sent a malformed answer: {what}",
        hint="is this a kvgraft registry of the same version? report it to the registry's operator",
    )


def _field(doc: Any, key: str, kind: type | tuple[type, ...], where: str, url: str) -> Any:
    # The registry is not trusted: a missing or mistyped member is its fault, said in one line.
    if not isinstance(doc, dict) or key not in doc:
        raise _malformed(url, f"{where} has no {key!r}")
    value = doc[key]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise _malformed(url, f"{where}.{key} is {type(value).__name__}")
    return value


def _safe_path(root: Path, name: str, what: str) -> Path:
    """``root / name`` for a subject name, refusing names that would leave ``root``."""
    parts = name.split("/")
    if not name or name.startswith("/") or "\\" in name or any(p in ("", ".", "..") for p in parts) or "\0" in name:
        raise LocalFilesError(
            f"{what} names subject {name[:80]!r}, which is not a plain relative path",
            hint="subject names are relative paths inside the directory (kv.safetensors, logits/<hex>.f32)",
        )
    return root.joinpath(*parts)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def kvgraft_home() -> Path:
    """``$KVGRAFT_HOME`` (default ``~/.cache/kvgraft``), as the engine defines it.

    Repeated here because the engine's module imports torch, which the client must not need.
    """
    return Path(os.environ.get("KVGRAFT_HOME") or Path.home() / ".cache" / "kvgraft")


# --- deadlines ---------------------------------------------------------------------------------


class _Deadline:
    """A point in ``time.monotonic()`` by which a request must be done (movable: a blob's
    deadline is set once its Content-Length is known)."""

    __slots__ = ("at", "seconds")

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.at = time.monotonic() + seconds

    def extend_to(self, seconds: float) -> None:
        """Let the request run ``seconds`` from its start in all."""
        self.at += seconds - self.seconds
        self.seconds = seconds


#: The deadlines of the requests in progress in this context; nested requests (a mirror's GET
#: feeding a PUT) are bound by all of them.
_DEADLINES: contextvars.ContextVar[tuple[_Deadline, ...]] = contextvars.ContextVar(
    "kvgraft_registry_deadlines", default=()
)


def _time_left(timeout: float | None, error: type[Exception]) -> float | None:
    """The socket timeout for one read or write: the configured one, cut to the time left."""
    active = _DEADLINES.get()
    if not active:
        return timeout
    left = min(d.at for d in active) - time.monotonic()
    if left <= 0:
        raise error("the request's total deadline passed")
    return left if timeout is None else min(timeout, left)


class _DeadlineStream(httpcore.NetworkStream):
    """A socket stream whose every read and write waits at most until the request's deadline, so
    a registry that drips one byte per read cannot outlive ``--timeout``."""

    def __init__(self, inner: httpcore.NetworkStream) -> None:
        self._inner = inner

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return self._inner.read(max_bytes, _time_left(timeout, httpcore.ReadTimeout))

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self._inner.write(buffer, _time_left(timeout, httpcore.WriteTimeout))

    def close(self) -> None:
        self._inner.close()

    def start_tls(
        self, ssl_context: Any, server_hostname: str | None = None, timeout: float | None = None
    ) -> httpcore.NetworkStream:
        inner = self._inner.start_tls(ssl_context, server_hostname, _time_left(timeout, httpcore.ConnectTimeout))
        return _DeadlineStream(inner)

    def get_extra_info(self, info: str) -> Any:
        return self._inner.get_extra_info(info)


class _DeadlineBackend(httpcore.NetworkBackend):
    def __init__(self, inner: httpcore.NetworkBackend) -> None:
        self._inner = inner

    def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.NetworkStream:
        timeout = _time_left(timeout, httpcore.ConnectTimeout)
        return _DeadlineStream(self._inner.connect_tcp(host, port, timeout, local_address, socket_options))

    def connect_unix_socket(
        self, path: str, timeout: float | None = None, socket_options: Iterable[Any] | None = None
    ) -> httpcore.NetworkStream:
        timeout = _time_left(timeout, httpcore.ConnectTimeout)
        return _DeadlineStream(self._inner.connect_unix_socket(path, timeout, socket_options))

    def sleep(self, seconds: float) -> None:
        self._inner.sleep(seconds)


def _install_deadlines(http: httpx.Client) -> None:
    # httpx exposes no network backend option; its transports (and proxy mounts) each hold an
    # httpcore pool that does. Where a future httpx hides it, the client still checks the
    # deadline between chunks (see _read_body), a coarser bound.
    for transport in [http._transport, *http._mounts.values()]:
        pool = getattr(transport, "_pool", None)
        backend = getattr(pool, "_network_backend", None)
        if backend is not None and not isinstance(backend, _DeadlineBackend):
            pool._network_backend = _DeadlineBackend(backend)  # type: ignore[union-attr]


@contextlib.contextmanager
def _deadline(seconds: float) -> Iterator[_Deadline]:
    d = _Deadline(seconds)
    token = _DEADLINES.set((*_DEADLINES.get(), d))
    try:
        yield d
    finally:
        _DEADLINES.reset(token)


def _check_deadline(what: str) -> None:
    active = _DEADLINES.get()
    if active and time.monotonic() > min(d.at for d in active):
        raise httpx.ReadTimeout(f"{what}: the request's total deadline passed")


# --- bounded JSON ------------------------------------------------------------------------------


def _too_deep(doc: Any, limit: int) -> bool:
    # Iterative, so that checking a deep document cannot itself recurse.
    stack: list[tuple[Any, int]] = [(doc, 1)]
    while stack:
        value, depth = stack.pop()
        children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else None
        if children is None:
            continue
        if depth > limit:
            return True
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return False


def parse_json_answer(body: bytes, url: str, limits: ClientLimits) -> Any:
    """Parse a registry's JSON answer; every way it can fail is one ``RegistryResponseError``.

    A document nested past ``limits.max_json_depth`` (or past what Python's parser can recurse
    into), or one too large to hold in memory, is refused like a malformed one.
    """
    try:
        doc = json.loads(body)
    except RecursionError as e:
        raise ResponseTooLargeError(
            f"{url} sent JSON nested too deeply to parse (over {limits.max_json_depth} levels)"
        ) from e
    except MemoryError as e:
        raise ResponseTooLargeError(f"{url} sent a JSON answer of {len(body)} bytes that does not fit in memory") from e
    except (ValueError, UnicodeDecodeError) as e:
        raise _malformed(url, "the body is not JSON") from e
    if _too_deep(doc, limits.max_json_depth):
        raise ResponseTooLargeError(f"{url} sent JSON nested more than {limits.max_json_depth} levels deep")
    return doc


# --- the HTTP client ---------------------------------------------------------------------------


class RegistryClient:
    """One registry, over one ``httpx.Client``; use it as a context manager so the connection
    pool is closed when the block ends.

    ``token`` is sent as ``Authorization: Bearer`` on every request (writes need it; reads need
    it only on registries started with ``--reads-require-token``). ``limits`` bound every
    answer (``timeout``, when given, replaces ``limits.timeout``). ``memory`` remembers the
    newest checkpoint verified per log and refuses one that does not extend it: by default
    (None) ``CheckpointMemory.default()``, under ``$KVGRAFT_HOME``; ``NO_MEMORY`` turns it off.
    """

    def __init__(
        self,
        url: str,
        *,
        token: str | None = None,
        timeout: float | None = None,
        transport: httpx.BaseTransport | None = None,
        limits: ClientLimits | None = None,
        memory: CheckpointMemory | None | type[_NoMemory] = None,
    ) -> None:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise RegistryClientError(
                f"{url!r} is not a registry URL", hint="pass http(s)://host:port, e.g. http://127.0.0.1:8000"
            )
        self.url = url.rstrip("/")
        limits = limits or ClientLimits()
        if timeout is not None:
            limits = dataclasses.replace(limits, timeout=timeout)
        self.limits = limits
        self.memory: CheckpointMemory | None = (
            CheckpointMemory.default()
            if memory is None
            else (
                None if memory is _NoMemory else memory  # type: ignore[assignment]
            )
        )
        headers = {"User-Agent": f"kvgraft/{kvgraft.__version__}"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        self._http = httpx.Client(
            base_url=self.url,
            headers=headers,
            # Each read or write waits at most this long, and never past the request's deadline.
            timeout=httpx.Timeout(limits.timeout, connect=min(limits.timeout, 10.0)),
            transport=transport,
            follow_redirects=False,
        )
        _install_deadlines(self._http)

    def __enter__(self) -> RegistryClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the connection pool."""
        self._http.close()

    # --- plumbing ------------------------------------------------------------------------

    def _read_body(self, response: httpx.Response, limit: int, what: str) -> bytes:
        """The body of ``response``, refused past ``limit`` bytes (counted as decoded, so a
        compressed answer cannot expand past it either); never more than one chunk over."""
        url = f"{response.request.method} {response.request.url}"
        length = response.headers.get("content-length", "")
        if length.isascii() and length.isdigit() and int(length) > limit:
            raise ResponseTooLargeError(
                f"{url} announced {int(length)} bytes for {what}, more than the limit of {limit}"
            )
        body = bytearray()
        try:
            for chunk in response.iter_bytes():
                body += chunk
                if len(body) > limit:
                    raise ResponseTooLargeError(f"{url} sent more than {limit} bytes for {what}; the rest was not read")
                _check_deadline(url)
            return bytes(body)
        except MemoryError as e:
            raise ResponseTooLargeError(f"{url}: {what} of {len(body)} bytes so far does not fit in memory") from e

    def _error(self, response: httpx.Response) -> RegistryResponseError:
        problem: dict[str, Any] = {}
        with contextlib.suppress(ValueError, RecursionError, MemoryError, RegistryClientError, httpx.HTTPError):
            body = self._read_body(response, self.limits.max_problem_bytes, "an error document")
            doc = json.loads(body)
            if isinstance(doc, dict) and not _too_deep(doc, self.limits.max_json_depth):
                problem = doc
        status = response.status_code
        where = f"{response.request.method} {response.request.url}"
        detail = problem.get("detail") if isinstance(problem.get("detail"), str) else None
        title = problem.get("title") if isinstance(problem.get("title"), str) else response.reason_phrase
        message = f"{where} answered {status} {title}" + (f": {detail[:500]}" if detail else "")
        missing = problem.get("missing")
        if isinstance(missing, list) and missing and not detail:
            message += f" (missing {', '.join(map(str, missing[:5]))})"
        hint = problem.get("hint") if isinstance(problem.get("hint"), str) else None
        cls = (
            RegistryAuthError
            if status in (401, 403)
            else RegistryNotFoundError
            if status == 404
            else RegistryResponseError
        )
        return cls(message, hint=hint, status=status, problem=problem)

    @contextlib.contextmanager
    def _stream(
        self,
        method: str,
        path: str,
        *,
        expect: Sequence[int] = (200,),
        token: str | None = None,
        seconds: float | None = None,
        **kwargs: Any,
    ) -> Iterator[tuple[httpx.Response, _Deadline]]:
        """Send one request under one total deadline (``seconds``, default the timeout) and yield
        (the response, its deadline) with the body unread; a status not in ``expect`` raises."""
        headers = dict(kwargs.pop("headers", None) or {})
        if token:
            headers["Authorization"] = f"Bearer {token}"
        seconds = self.limits.timeout if seconds is None else seconds
        with _deadline(seconds) as deadline:
            try:
                with self._http.stream(method, path, headers=headers, **kwargs) as response:
                    if response.status_code not in expect:
                        raise self._error(response)
                    yield response, deadline
            except httpx.TimeoutException as e:
                raise RegistryUnavailableError(
                    f"{method} {self.url}{path} did not complete within its deadline of {deadline.seconds:.0f} s ({e})",
                    hint="the registry is too slow or stalls; retry, or raise --timeout (the limit for a whole request)",
                ) from e
            except httpx.HTTPError as e:
                raise RegistryUnavailableError(f"{method} {self.url}{path} failed: {str(e) or type(e).__name__}") from e

    def _request(
        self,
        method: str,
        path: str,
        *,
        expect: Sequence[int] = (200,),
        token: str | None = None,
        limit: int | None = None,
        what: str = "the answer",
        **kwargs: Any,
    ) -> tuple[int, bytes]:
        """(status, body) of one request, the body read up to ``limit`` bytes (default max_json_bytes)."""
        with self._stream(method, path, expect=expect, token=token, **kwargs) as (response, _):
            body = self._read_body(response, self.limits.max_json_bytes if limit is None else limit, what)
            return response.status_code, body

    def _json(self, path: str, *, method: str = "GET", **kwargs: Any) -> tuple[int, dict[str, Any]]:
        status, body = self._request(method, path, what="a JSON answer", **kwargs)
        doc = parse_json_answer(body, self.url + path, self.limits)
        if not isinstance(doc, dict):
            raise _malformed(self.url + path, f"the body is a JSON {type(doc).__name__}, not an object")
        return status, doc

    def _get_json(self, path: str, **kwargs: Any) -> dict[str, Any]:
        return self._json(path, **kwargs)[1]

    # --- the log -------------------------------------------------------------------------

    def log_key(self) -> dict[str, Any]:
        """``GET /v1/log/key``: origin, public key PEM, key id, note verifier key, tree size."""
        return self._get_json("/v1/log/key")

    def checkpoint(self, tree_size: int | None = None) -> bytes:
        """The signed checkpoint note, latest or at ``tree_size``, byte for byte as served (unchecked:
        see ``signed_head``)."""
        params = {} if tree_size is None else {"tree_size": tree_size}
        return self._request(
            "GET", "/v1/log/checkpoint", params=params, limit=self.limits.max_note_bytes, what="a checkpoint"
        )[1]

    def signed_head(self, key: RegistryKey, tree_size: int | None = None) -> tuple[Checkpoint, bytes]:
        """The checkpoint (latest, or at ``tree_size``) verified with ``key`` and against the
        remembered one (``CheckpointMemory``): (checkpoint, note bytes as served)."""
        note = self.checkpoint(tree_size)
        head = key.verify(note, self.url + "/v1/log/checkpoint")
        if tree_size is not None and head.size != tree_size:
            raise EvidenceError(f"{self.url} answered for its checkpoint at size {tree_size} with size {head.size}")
        self.remember(key, head, note, latest=tree_size is None)
        return head, note

    def remember(self, key: RegistryKey, head: Checkpoint, note: bytes, *, latest: bool) -> None:
        """Check a verified checkpoint against the remembered one and remember it when newer.

        ``latest``: the registry served it as its current head (a smaller size than remembered
        is then a rollback); otherwise it is a past head, which must be proved a prefix.
        """
        if self.memory is not None:
            self.memory.check(self, key, head, note, latest=latest)

    def inclusion_proof(self, index: int, tree_size: int | None = None) -> dict[str, Any]:
        """``{"log_index", "tree_size", "hashes"}`` for entry ``index``."""
        params: dict[str, int] = {"index": index}
        if tree_size is not None:
            params["tree_size"] = tree_size
        return self._get_json("/v1/log/proof/inclusion", params=params)

    def consistency_proof(self, old: int, new: int | None = None) -> dict[str, Any]:
        """``{"old_size", "new_size", "hashes"}`` between two tree sizes (new: latest)."""
        params: dict[str, int] = {"old": old}
        if new is not None:
            params["new"] = new
        return self._get_json("/v1/log/proof/consistency", params=params)

    def verify_extends(self, old: Checkpoint, new: Checkpoint) -> None:
        """Fetch and verify the consistency proof that ``new`` extends ``old`` (raises ``EvidenceError``)."""
        purl = self.url + "/v1/log/proof/consistency"
        if old.size == new.size or old.size == 0:
            hashes: list[Any] = []
        else:
            proof = self.consistency_proof(old.size, new.size)
            if (
                _field(proof, "old_size", int, "the consistency proof", purl) != old.size
                or _field(proof, "new_size", int, "the consistency proof", purl) != new.size
            ):
                raise EvidenceError(f"{purl}: the proof is not from size {old.size} to size {new.size}")
            hashes = _field(proof, "hashes", list, "the consistency proof", purl)
        try:
            path = [
                bytes.fromhex(h) if isinstance(h, str) and len(h) == 64 and set(h) <= _HEX64 else b"" for h in hashes
            ]
            verify_consistency(old.size, new.size, old.root_hash, new.root_hash, path)
        except VerificationError as e:
            raise EvidenceError(
                f"{self.url}'s log at size {new.size} is not proved to extend its log at size {old.size}: {e.message}"
            ) from e

    # --- blobs ---------------------------------------------------------------------------

    def blob_size(self, digest: str) -> int | None:
        """The stored blob's size (``HEAD``), or None when the registry does not hold it."""
        digest = _digest(digest)
        with self._stream("HEAD", f"/v1/blobs/{digest}", expect=(200, 404)) as (response, _):
            if response.status_code == 404:
                return None
            length = response.headers.get("content-length", "")
        if not (length.isascii() and length.isdigit()):
            raise _malformed(f"{self.url}/v1/blobs/{digest}", "HEAD sent no Content-Length")
        return int(length)

    def put_blob(self, digest: str, chunks: Iterable[bytes], size: int) -> bool:
        """Upload ``size`` bytes streamed from ``chunks`` as blob ``digest``; True when new.

        Content-Length is sent so that an oversized blob is refused before any byte goes. The
        upload's deadline is the timeout plus ``size`` at ``limits.min_rate``.
        """
        digest = _digest(digest)
        status, _ = self._request(
            "PUT",
            f"/v1/blobs/{digest}",
            expect=(200, 201),
            content=chunks,
            limit=self.limits.max_problem_bytes,
            headers={"Content-Length": str(size), "Content-Type": "application/octet-stream"},
            seconds=self.limits.blob_seconds(size),
        )
        return status == 201

    @contextlib.contextmanager
    def open_blob(self, digest: str) -> Iterator[tuple[int | None, Iterator[bytes]]]:
        """Stream blob ``digest``: yields (Content-Length or None, an iterator of chunks).

        The chunks are the bytes as served, unchecked: hash them (``download_blob`` does). They
        never add up to more than the Content-Length, which must be within ``max_blob_bytes``;
        the transfer's deadline is the timeout plus that length at ``min_rate``.
        """
        digest = _digest(digest)
        url = f"/v1/blobs/{digest}"
        # Identity, so that Content-Length is the blob's size, which bounds what is written.
        with self._stream("GET", url, headers={"Accept-Encoding": "identity"}) as (response, deadline):
            raw_length = response.headers.get("content-length", "")
            length = int(raw_length) if raw_length.isascii() and raw_length.isdigit() else None
            if response.headers.get("content-encoding", "identity").lower() != "identity":
                raise _malformed(
                    self.url + url, f"the blob came {response.headers['content-encoding']}-encoded, not as its bytes"
                )
            if length is not None and length > self.limits.max_blob_bytes:
                raise ResponseTooLargeError(
                    f"{self.url}{url} announced a blob of {length} bytes, more than the limit of {self.limits.max_blob_bytes}",
                    hint="raise --max-blob-bytes if the blob is really that large",
                )
            deadline.extend_to(self.limits.blob_seconds(length or 0))
            cap = self.limits.max_blob_bytes if length is None else length

            def chunks() -> Iterator[bytes]:
                got = 0
                try:
                    for chunk in response.iter_bytes(CHUNK):
                        got += len(chunk)
                        if got > cap:
                            raise ResponseTooLargeError(f"{self.url}{url} sent more than the {cap} bytes it announced")
                        _check_deadline(self.url + url)
                        yield chunk
                except httpx.TimeoutException as e:
                    raise RegistryUnavailableError(
                        f"reading blob {digest} from {self.url} did not complete within its deadline of "
                        f"{deadline.seconds:.0f} s ({e})",
                        hint="the registry is too slow or stalls; retry, or raise --timeout or lower --min-rate",
                    ) from e
                except httpx.HTTPError as e:
                    # Raised inside whatever consumes the chunks (maybe another registry's
                    # upload): name this registry as the one that failed.
                    raise RegistryUnavailableError(f"reading blob {digest} from {self.url} failed: {e}") from e

            yield length, chunks()

    def download_blob(
        self, digest: str, dest: Path, *, progress: Progress | None = None, space_dir: Path | None = None
    ) -> int:
        """Stream blob ``digest`` into the new file ``dest``, hashing as it goes; return its size.

        Raises ``BlobDigestError`` (and removes ``dest``) when the bytes hash to another digest.
        The registry must announce the size (Content-Length); nothing past it is written, and a
        blob that does not fit in the free space of ``dest``'s filesystem is refused before a
        byte is written (``DiskFullError``, naming ``space_dir``, default ``dest.parent``).
        """
        digest = _digest(digest)
        where = space_dir or dest.parent
        h = hashlib.sha256()
        size = 0
        # Created first and exclusively: on failure only a file this call made is removed.
        try:
            f = dest.open("xb")
        except OSError as e:
            raise local_write_error(e, dest, where) from e
        try:
            with f, self.open_blob(digest) as (length, chunks):
                if length is None:
                    raise _malformed(f"{self.url}/v1/blobs/{digest}", "the blob came without a Content-Length")
                free = _free_bytes(dest.parent)
                if free is not None and free < length:
                    raise DiskFullError(f"blob {digest} needs {length} bytes in {where}, which has {free} bytes free")
                try:
                    for chunk in chunks:
                        h.update(chunk)
                        f.write(chunk)
                        size += len(chunk)
                        if progress is not None:
                            progress.update(len(chunk))
                    f.flush()
                    os.fsync(f.fileno())
                except OSError as e:
                    raise local_write_error(e, dest, where, needed=length) from e
            got = "sha256:" + h.hexdigest()
            if got != digest:
                raise BlobDigestError(f"{self.url} served {size} bytes for blob {digest} that hash to {got}")
        except BaseException:
            dest.unlink(missing_ok=True)
            raise
        return size

    # --- entries, artifacts, records -------------------------------------------------------

    def post_entry(self, envelope: bytes, *, token: str | None = None) -> tuple[dict[str, Any], bool]:
        """``POST /v1/entries`` with the envelope bytes as given; (document, created)."""
        status, doc = self._json(
            "/v1/entries",
            method="POST",
            expect=(200, 201),
            token=token,
            content=envelope,
            headers={"Content-Type": "application/json"},
        )
        return doc, status == 201

    def entry(self, ref: int | str) -> dict[str, Any]:
        """``{"entry", "inclusion_proof", "checkpoint"}`` by log index or envelope digest."""
        return self._get_json(f"/v1/entries/{ref}")

    def envelope(self, ref: int | str) -> bytes:
        """An entry's envelope bytes exactly as stored (unchecked: see ``hash_leaf``)."""
        return self._request(
            "GET", f"/v1/entries/{ref}/envelope", limit=self.limits.max_envelope_bytes, what="an envelope"
        )[1]

    def artifact(self, digest: str) -> dict[str, Any]:
        """``GET /v1/artifacts/sha256:HEX``: the artifact by its tensors' digest."""
        return self._get_json(f"/v1/artifacts/{_digest(digest, 'artifact digest')}")

    def _pages(self, path: str, params: dict[str, Any], *, below: int | None = None) -> Iterator[dict[str, Any]]:
        """Every item of a paged listing, in log order, up to (not including) log index ``below``.

        The listing must advance: each cursor new, each item's ``log_index`` larger than the
        last, within ``max_pages`` pages and ``max_items`` items; else ``ListingError``.
        """
        url = self.url + path
        cursor: str | None = None
        seen: set[str] = set()
        last = -1
        items_read = 0
        for page_number in range(1, self.limits.max_pages + 1):
            query = {k: v for k, v in params.items() if v is not None} | {"limit": PAGE_LIMIT}
            if cursor is not None:
                query["cursor"] = cursor
            page = self._get_json(path, params=query)
            items = _field(page, "items", list, "the page", url)
            next_cursor = page.get("next_cursor")
            if next_cursor is not None:
                if not isinstance(next_cursor, str) or not items:
                    raise _malformed(url, "next_cursor is not a string, or a page with a cursor is empty")
                if next_cursor in seen or next_cursor == cursor:
                    raise ListingError(
                        f"{url} sent the cursor {next_cursor[:40]!r} again on page {page_number}: the listing would never end"
                    )
                seen.add(next_cursor)
            for item in items:
                index = _field(item, "log_index", int, "a listed item", url)
                if index <= last:
                    raise ListingError(
                        f"{url} listed log index {index} after {last} on page {page_number}: a listing must advance in log order"
                    )
                last = index
                if below is not None and index >= below:
                    return
                items_read += 1
                if items_read > self.limits.max_items:
                    raise ListingError(
                        f"{url} listed more than {self.limits.max_items} items; stopped",
                        hint="narrow the listing, or name the entries you want",
                    )
                yield item
            if next_cursor is None:
                return
            cursor = next_cursor
        raise ListingError(f"{url} is still listing after {self.limits.max_pages} pages; stopped")

    def iter_entries(self, *, below: int | None = None) -> Iterator[dict[str, Any]]:
        """Every entry's metadata, in log order (``GET /v1/entries``, all pages), up to log index ``below``."""
        return self._pages("/v1/entries", {}, below=below)

    def list_artifacts(
        self,
        *,
        model: str | None = None,
        profile: str | None = None,
        parent: str | None = None,
        publisher: str | None = None,
        q: str | None = None,
    ) -> Iterator[dict[str, Any]]:
        """Artifacts in log order, filtered as ``GET /v1/artifacts`` filters (all pages)."""
        return self._pages(
            "/v1/artifacts", {"model": model, "profile": profile, "parent": parent, "publisher": publisher, "q": q}
        )

    def list_records(
        self, *, artifact: str | None = None, kind: str | None = None, publisher: str | None = None
    ) -> Iterator[dict[str, Any]]:
        """Records in log order, filtered as ``GET /v1/records`` filters (all pages)."""
        return self._pages("/v1/records", {"artifact": artifact, "type": kind, "publisher": publisher})


# --- local disk --------------------------------------------------------------------------------


def _free_bytes(directory: Path) -> int | None:
    try:
        return shutil.disk_usage(directory).free
    except OSError:
        return None


def local_write_error(
    e: OSError, path: Path, directory: Path | None = None, *, needed: int | None = None
) -> LocalFilesError:
    """A one-line error for a failed local write: ``DiskFullError`` (naming ``directory``, the
    space needed and the space free) for ENOSPC/EDQUOT, else ``LocalFilesError``."""
    directory = directory or path.parent
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        free = _free_bytes(path.parent if path.parent.exists() else directory)
        need = f"{needed} bytes are needed, " if needed is not None else ""
        return DiskFullError(
            f"no space left on the device of {directory} while writing {path.name}: {need}"
            f"{free if free is not None else 'an unknown number of'} bytes are free; nothing was kept"
        )
    return LocalFilesError(f"cannot write {path}: {e.strerror or e}", hint="check that the directory is writable")


# --- remembered checkpoints --------------------------------------------------------------------


class _NoMemory:
    """Pass ``memory=NO_MEMORY`` to ``RegistryClient`` to remember nothing (tests of the log itself)."""


#: ``RegistryClient(memory=NO_MEMORY)``: no checkpoint is remembered or compared.
NO_MEMORY = _NoMemory


@dataclass(frozen=True)
class RememberedHead:
    """The newest checkpoint verified for one log, as stored in its memory file."""

    head: Checkpoint
    note: bytes
    registry: str
    verified_at: str
    path: Path

    def describe(self) -> str:
        """One phrase: size, root and when and where it was verified."""
        return (
            f"tree size {self.head.size} with root {self.head.root_hash.hex()[:16]}, verified from {self.registry} "
            f"at {self.verified_at} (remembered in {self.path})"
        )


class CheckpointMemory:
    """The newest checkpoint this machine verified per log, one file per (key id, origin).

    ``DIR/<keyid>.<sha256(origin)[:16]>.json`` holds ``{"format", "keyid", "origin",
    "tree_size", "root_hash", "checkpoint" (the signed note), "registry", "verified_at"}``,
    written atomically (temp file, fsync, rename) under an exclusive lock file beside it. The
    note is re-verified with the registry key on every read, so a damaged file is an error,
    never a silent reset. Invariant: the remembered tree size only grows, and only by a
    verified RFC 9162 consistency proof.
    """

    FORMAT = "kvgraft-checkpoint-memory/v1"

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    @classmethod
    def default(cls) -> CheckpointMemory:
        """``$KVGRAFT_HOME/checkpoints``."""
        return cls(kvgraft_home() / "checkpoints")

    def path(self, keyid: str, origin: str) -> Path:
        """The memory file of the log ``origin`` signed by key ``keyid``."""
        return self.directory / f"{keyid}.{hashlib.sha256(origin.encode()).hexdigest()[:16]}.json"

    @contextlib.contextmanager
    def _locked(self, path: Path) -> Iterator[None]:
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            fd = os.open(path.with_suffix(".lock"), os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise CheckpointMemoryError(f"cannot open the checkpoint memory {path}: {e.strerror}") from e
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def load(self, key: RegistryKey, origin: str) -> RememberedHead | None:
        """The remembered head of ``origin`` under ``key``, re-verified; None when there is none."""
        path = self.path(key.keyid, origin)
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as e:
            raise CheckpointMemoryError(f"cannot read the remembered checkpoint {path}: {e.strerror}") from e
        try:
            doc = json.loads(raw)
            note = doc["checkpoint"].encode("utf-8")
            head = verify_checkpoint(note, origin, key.public_key, origin=origin)
            return RememberedHead(head, note, str(doc["registry"]), str(doc["verified_at"]), path)
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError, VerificationError) as e:
            raise CheckpointMemoryError(
                f"the remembered checkpoint {path} is damaged or not signed by {key.describe()}: {e}",
            ) from e

    def _save(self, key: RegistryKey, head: Checkpoint, note: bytes, registry: str) -> None:
        path = self.path(key.keyid, head.origin)
        doc = {
            "format": self.FORMAT,
            "keyid": key.keyid,
            "origin": head.origin,
            "tree_size": head.size,
            "root_hash": head.root_hash.hex(),
            "checkpoint": note.decode("utf-8"),
            "registry": registry,
            "verified_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        }
        try:
            write_atomic(path, json.dumps(doc, indent=2).encode() + b"\n", 0o644)
        except OSError as e:
            raise CheckpointMemoryError(f"cannot write the remembered checkpoint {path}: {e.strerror}") from e

    def check(self, client: RegistryClient, key: RegistryKey, head: Checkpoint, note: bytes, *, latest: bool) -> None:
        """Refuse ``head`` (verified with ``key``) unless it provably extends the remembered head,
        or, when it is not ``latest``, is provably a prefix of it; remember it when newer.

        A latest head smaller than the remembered one is a rollback; one of the same size with
        another root is a split view; a larger one needs the registry's consistency proof from
        the remembered size (``LogForkError`` otherwise).
        """
        path = self.path(key.keyid, head.origin)
        with self._locked(path):
            known = self.load(key, head.origin)
            if known is None:
                self._save(key, head, note, client.url)
                return
            old = known.head
            if head.size == old.size:
                if head.root_hash != old.root_hash:
                    raise LogForkError(
                        f"possible split view: {client.url} signed log {head.origin!r} at tree size {head.size} with root "
                        f"{head.root_hash.hex()[:16]}, but this machine verified another root at that size: {known.describe()}"
                    )
                return
            if head.size < old.size:
                if latest:
                    raise LogForkError(
                        f"possible rollback: {client.url} says log {head.origin!r} is at tree size {head.size}, "
                        f"but this machine verified {known.describe()}; the log lost entries or runs from an old copy"
                    )
                try:
                    client.verify_extends(head, old)
                except (EvidenceError, RegistryResponseError) as e:
                    raise LogForkError(
                        f"possible rollback or split view: {client.url} cannot prove that its tree at size {head.size} is a "
                        f"prefix of the one this machine verified, {known.describe()}: {e.message}"
                    ) from e
                return
            try:
                client.verify_extends(old, head)
            except (EvidenceError, RegistryResponseError) as e:
                raise LogForkError(
                    f"possible split view: {client.url}'s log {head.origin!r} at tree size {head.size} is not proved to "
                    f"extend the one this machine verified, {known.describe()}: {e.message}"
                ) from e
            self._save(key, head, note, client.url)


# --- the registry key --------------------------------------------------------------------------


@dataclass(frozen=True)
class RegistryKey:
    """The key a registry's checkpoints must be signed with, and how it came to be trusted."""

    public_key: Ed25519PublicKey
    #: The log's origin when known (fetched from the registry); None for a pinned PEM, whose
    #: checkpoints are checked under their own origin line (the signature decides).
    origin: str | None
    #: True for a PEM the caller passed; False for a key fetched from the registry itself.
    pinned: bool
    #: The PEM file, or the URL the key was fetched from.
    source: str

    @property
    def keyid(self) -> str:
        """The key's id (sha256 of its raw public key, hex)."""
        return str(keyid_of(self.public_key))

    @property
    def trust(self) -> str:
        """``pinned`` or ``trust-on-first-use``."""
        return "pinned" if self.pinned else "trust-on-first-use"

    def describe(self) -> str:
        """One phrase for the output."""
        if self.pinned:
            return f"registry key {self.keyid[:16]} (pinned: {self.source})"
        return (
            f"registry key {self.keyid[:16]} fetched from {self.source} (trust on first use: "
            "save its public_key_pem and pass --registry-key to pin it)"
        )

    def to_json(self) -> dict[str, Any]:
        """The key's identity for ``--json`` output."""
        return {
            "keyid": self.keyid,
            "origin": self.origin,
            "trust": self.trust,
            "source": self.source,
            "public_key_pem": public_key_pem(self.public_key).decode("ascii"),
        }

    def verify(self, note: bytes, url: str) -> Checkpoint:
        """Verify a signed checkpoint note served by ``url``; return the checkpoint."""
        # Without a known origin the note's own first line names the key; a note signed by
        # anything but this key fails whatever it claims.
        name = self.origin or note.split(b"\n", 1)[0].decode("utf-8", "replace")
        try:
            return verify_checkpoint(note, name, self.public_key, origin=self.origin)
        except VerificationError as e:
            raise EvidenceError(
                f"the checkpoint from {url} does not verify with {self.describe()}: {e.message}",
                hint="pass the right --registry-key; if it is right, the registry's log was tampered with",
            ) from e


def registry_key(client: RegistryClient, pem: Path | None) -> RegistryKey:
    """The registry key: the PEM file ``pem`` (pinned), else the registry's own (trust on first use)."""
    if pem is not None:
        try:
            return RegistryKey(load_public_key(pem), None, True, str(pem))
        except VerificationError as e:
            raise LocalFilesError(
                f"--registry-key: {e.message}", hint="pass the registry's registry-key.pub.pem"
            ) from e
    doc = client.log_key()
    url = client.url + "/v1/log/key"
    pem_text = _field(doc, "public_key_pem", str, "the log key", url)
    origin = _field(doc, "origin", str, "the log key", url)
    try:
        key = parse_public_key(pem_text.encode("ascii", "replace"), source=f"the public key from {url}")
    except VerificationError as e:
        raise _malformed(url, e.message) from e
    return RegistryKey(key, origin, False, url)


def _verify_entry_evidence(
    client: RegistryClient, url: str, envelope: bytes, entry: dict[str, Any], proof: Any, note: Any, key: RegistryKey
) -> tuple[int, Checkpoint]:
    """Check that ``envelope`` is ``entry``, and is its leaf in the signed checkpoint ``note``.

    Returns (log index, checkpoint). Every registry claim is checked against the bytes, and the
    checkpoint against the one remembered for this log (``RegistryClient.remember``).
    """
    digest = _field(entry, "digest", str, "the entry", url)
    index = _field(entry, "log_index", int, "the entry", url)
    if _sha256(envelope) != digest:
        raise EvidenceError(
            f"{url} says entry {index} has digest {digest}, but its envelope bytes hash to {_sha256(envelope)}"
        )
    leaf = hash_leaf(envelope)
    leaf_hex = entry.get("leaf_hash")
    if leaf_hex is not None and leaf_hex != leaf.hex():
        raise EvidenceError(
            f"{url} says entry {index}'s leaf hash is {leaf_hex}, but SHA-256(0x00 || envelope) is {leaf.hex()}"
        )
    if not isinstance(note, str):
        raise _malformed(url, "the checkpoint is not a string")
    note_bytes = note.encode("utf-8")
    head = key.verify(note_bytes, url)
    # Served beside an entry, it may be a moment old: a smaller size must be proved a prefix.
    client.remember(key, head, note_bytes, latest=False)
    proof_index = _field(proof, "log_index", int, "the inclusion proof", url)
    proof_size = _field(proof, "tree_size", int, "the inclusion proof", url)
    hashes = _field(proof, "hashes", list, "the inclusion proof", url)
    if proof_index != index or proof_size != head.size:
        raise EvidenceError(
            f"{url}: the inclusion proof is for entry {proof_index} at tree size {proof_size}, "
            f"but the entry is {index} and the checkpoint is at size {head.size}"
        )
    try:
        path = [bytes.fromhex(h) if isinstance(h, str) and len(h) == 64 and set(h) <= _HEX64 else b"" for h in hashes]
        verify_inclusion(leaf, index, head.size, path, head.root_hash)
    except VerificationError as e:
        raise EvidenceError(f"{url}: entry {index} is not proved to be in the signed log: {e.message}") from e
    return index, head


# --- reading a local directory ---------------------------------------------------------------------


@dataclass(frozen=True)
class LocalEntry:
    """An artifact or record directory, read for publishing (the statement is not verified here:
    the registry verifies it against the keys the token is bound to)."""

    directory: Path
    envelope_path: Path
    envelope: bytes
    statement: Statement
    #: (subject name, sha256:hex, local path)
    subjects: tuple[tuple[str, str, Path], ...]

    @property
    def kind(self) -> str:
        """``artifact`` or ``record``."""
        return "artifact" if self.envelope_path.name == STATEMENT_FILE else "record"

    @property
    def artifact_digest(self) -> str | None:
        """The tensors' digest of an artifact."""
        return next((d for n, d, _ in self.subjects if n == KV_FILE), None) if self.kind == "artifact" else None

    @property
    def parent(self) -> str | None:
        """The parent's tensors digest of a child artifact."""
        s = self.statement
        return str(s.predicate.parent) if isinstance(s, KvArtifactStatement) and s.predicate.parent else None


def _statement_of(envelope: bytes, what: str) -> Statement:
    try:
        parsed = parse_envelope(envelope, source=what)
        return parse_statement(b64decode_any(parsed.payload, what=f"{what} payload"), what=f"statement in {what}")
    except VerificationError as e:
        raise LocalFilesError(e.message, hint="pass the .dsse.json file as the signer wrote it") from e
    except SchemaError as e:
        raise LocalFilesError(f"{what}: {e}", hint="pass the .dsse.json file as the signer wrote it") from e


def read_local(directory: Path) -> LocalEntry:
    """Read an artifact directory (``statement.dsse.json``) or a record directory (``record.dsse.json``)."""
    if not directory.is_dir():
        raise LocalFilesError(f"{directory} is not a directory")
    for name in (STATEMENT_FILE, RECORD_FILE):
        path = directory / name
        if path.is_file():
            break
    else:
        raise LocalFilesError(f"{directory} holds neither {STATEMENT_FILE} nor {RECORD_FILE}")
    try:
        if path.stat().st_size > MAX_ENVELOPE_BYTES:
            raise LocalFilesError(f"{path} is larger than {MAX_ENVELOPE_BYTES} bytes; it is not an envelope")
        envelope = path.read_bytes()
    except OSError as e:
        raise LocalFilesError(f"cannot read {path}: {e.strerror}") from e
    statement = _statement_of(envelope, str(path))
    if name == STATEMENT_FILE and not isinstance(statement, KvArtifactStatement):
        raise LocalFilesError(f"{path} holds a {statement.predicate_type} statement, not a KV artifact")
    subjects = []
    for s in statement.subject:
        subjects.append((s.name, "sha256:" + s.digest.sha256, _safe_path(directory, s.name, str(path))))
    if name == STATEMENT_FILE and KV_FILE not in {n for n, _, _ in subjects}:
        raise LocalFilesError(f"{path} names no {KV_FILE} subject")
    return LocalEntry(directory, path, envelope, statement, tuple(subjects))


def find_local_artifact(digest: str, near: Path) -> Path | None:
    """An artifact directory whose tensors have ``digest``: the local index, or a sibling of ``near``.

    The same places the engine's ``find_artifact`` looks. A candidate counts only when its
    statement names these tensors and its kv.safetensors hashes to them.
    """
    candidates: list[Path] = []
    with contextlib.suppress(OSError):
        candidates.append(Path((kvgraft_home() / "index" / hex_of(digest)).read_text().strip()))
    with contextlib.suppress(OSError):
        candidates += sorted(p for p in near.resolve().parent.iterdir() if p.is_dir())
    for c in candidates:
        with contextlib.suppress(LocalFilesError, OSError):
            local = read_local(c)
            if local.kind == "artifact" and local.artifact_digest == digest and _file_digest(c / KV_FILE) == digest:
                return c
    return None


def _file_digest(path: Path) -> str:
    with path.open("rb") as f:
        return "sha256:" + hashlib.file_digest(f, "sha256").hexdigest()


# --- publish -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class PublishResult:
    """What ``publish`` did and proved."""

    registry: str
    directory: Path
    kind: str
    predicate_type: str
    artifact_digest: str | None
    log_index: int
    entry_digest: str
    tree_size: int
    root_hash: str
    #: False when these exact envelope bytes were already logged (the same entry came back).
    created: bool
    uploaded: tuple[str, ...]
    uploaded_bytes: int
    #: Blobs the registry already held (not sent again).
    skipped: tuple[str, ...]
    registry_key: RegistryKey
    #: Parents published first because the registry lacked them (nearest last).
    parents: tuple[PublishResult, ...] = ()
    #: A parent whose tensors are on the registry but no entry describes them (not an error).
    notes: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        """A JSON object for ``--json`` output."""
        return {
            "registry": self.registry,
            "directory": str(self.directory),
            "kind": self.kind,
            "predicate_type": self.predicate_type,
            "artifact_digest": self.artifact_digest,
            "log_index": self.log_index,
            "entry_digest": self.entry_digest,
            "tree_size": self.tree_size,
            "root_hash": self.root_hash,
            "created": self.created,
            "blobs": {
                "uploaded": list(self.uploaded),
                "uploaded_bytes": self.uploaded_bytes,
                "skipped": list(self.skipped),
            },
            "registry_key": self.registry_key.to_json(),
            "parents": [p.to_json() for p in self.parents],
            "notes": list(self.notes),
            "verified": ["leaf_hash", "inclusion", "checkpoint_signature"],
        }


def publish(
    client: RegistryClient,
    directory: Path,
    *,
    registry_key_file: Path | None = None,
    publish_parents: bool = True,
    progress: bool = False,
) -> PublishResult:
    """Publish an artifact or record directory: the blobs the registry lacks, then the envelope.

    Each blob is first asked for (``HEAD``); only the missing ones are sent, streamed, so a
    publish that broke off resumes where it stopped. A child artifact needs its parent's
    tensors on the registry: a parent with no entry there that is found locally (the local
    index or a sibling directory) is published first, unless ``publish_parents`` is False;
    otherwise ``ParentNotPublishedError``. The answer is verified: the entry's leaf is
    SHA-256(0x00 || the envelope bytes), its inclusion proof leads to the returned checkpoint,
    and that checkpoint is signed by the registry key (``registry_key_file``, else fetched
    from the registry and reported as trust on first use).
    """
    local = read_local(directory)  # local mistakes fail before anything is asked of the registry
    key = registry_key(client, registry_key_file)
    return _publish(client, local, key, publish_parents=publish_parents, progress=progress, depth=0)


def _publish(
    client: RegistryClient, local: LocalEntry, key: RegistryKey, *, publish_parents: bool, progress: bool, depth: int
) -> PublishResult:
    directory = local.directory
    if depth > MAX_CHAIN:
        raise LocalFilesError(f"the parent chain of {directory} is longer than {MAX_CHAIN} (a cycle?)")
    parents: list[PublishResult] = []
    notes: list[str] = []
    if local.parent is not None:
        parent_result, note = _ensure_parent(
            client, local, key, publish_parents=publish_parents, progress=progress, depth=depth
        )
        if parent_result is not None:
            parents += [*parent_result.parents, parent_result]
        if note:
            notes.append(note)

    # One path per digest: two subjects with the same bytes are one blob.
    wanted = dict((d, p) for _, d, p in reversed(local.subjects))
    missing = [(d, p) for d, p in wanted.items() if client.blob_size(d) is None]
    skipped = tuple(d for d in wanted if d not in dict(missing))
    sizes = []
    for d, p in missing:
        try:
            sizes.append(p.stat().st_size)
        except OSError as e:
            raise LocalFilesError(
                f"subject {p.relative_to(directory)} ({d}) is missing from {directory} and not on {client.url}",
                hint="publish from the directory that holds every file the statement names",
            ) from e
    uploaded_bytes = 0
    with _progress(progress, sum(sizes), f"publish {directory.name}") as bar:
        for (d, p), size in zip(missing, sizes, strict=True):
            _upload_file(client, d, p, size, bar)
            uploaded_bytes += size

    doc, created = client.post_entry(local.envelope)
    url = client.url + "/v1/entries"
    entry = _field(doc, "entry", dict, "the answer", url)
    index, head = _verify_entry_evidence(
        client, url, local.envelope, entry, doc.get("inclusion_proof"), doc.get("checkpoint"), key
    )
    return PublishResult(
        registry=client.url,
        directory=directory,
        kind=local.kind,
        predicate_type=local.statement.predicate_type,
        artifact_digest=local.artifact_digest,
        log_index=index,
        entry_digest=_sha256(local.envelope),
        tree_size=head.size,
        root_hash=head.root_hash.hex(),
        created=created,
        uploaded=tuple(d for d, _ in missing),
        uploaded_bytes=uploaded_bytes,
        skipped=skipped,
        registry_key=key,
        parents=tuple(parents),
        notes=tuple(notes),
    )


def _upload_file(client: RegistryClient, digest: str, path: Path, size: int, bar: Progress) -> None:
    h = hashlib.sha256()

    def chunks() -> Iterator[bytes]:
        with path.open("rb") as f:
            while chunk := f.read(CHUNK):
                h.update(chunk)
                bar.update(len(chunk))
                yield chunk

    try:
        client.put_blob(digest, chunks(), size)
    except RegistryResponseError as e:
        got = "sha256:" + h.hexdigest()
        if e.status == 400 and got != digest:
            raise LocalFilesError(
                f"{path} hashes to {got}, but the statement names it as {digest}; the registry kept nothing",
                hint="the file was altered after signing: capture or sign it again",
            ) from e
        raise
    except OSError as e:
        raise LocalFilesError(f"cannot read {path}: {e.strerror}") from e


def _ensure_parent(
    client: RegistryClient, local: LocalEntry, key: RegistryKey, *, publish_parents: bool, progress: bool, depth: int
) -> tuple[PublishResult | None, str | None]:
    parent = local.parent
    if parent is None:
        return None, None
    try:
        client.artifact(parent)
        return None, None
    except RegistryNotFoundError:
        pass
    found = find_local_artifact(parent, local.directory)
    if found is not None and publish_parents:
        return _publish(client, read_local(found), key, publish_parents=True, progress=progress, depth=depth + 1), None
    if client.blob_size(parent) is not None:
        # The registry accepts a child whose parent tensors it holds, even without their entry.
        return None, f"the parent tensors {parent} are on the registry, but no entry describes them"
    where = f"; it is at {found}" if found is not None else " and was not found on this machine"
    raise ParentNotPublishedError(
        f"the parent artifact {parent} of {local.directory} is not on {client.url}{where}",
        hint=f"publish the parent first: kvgraft publish --registry {client.url} "
        + (str(found) if found is not None else "PARENT_DIR"),
    )


# --- pull --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PullResult:
    """What ``pull`` wrote and proved for one artifact."""

    registry: str
    directory: Path
    artifact_digest: str
    parent: str | None
    log_index: int
    entry_digest: str
    tree_size: int
    root_hash: str
    files: tuple[str, ...]
    size: int
    #: The names of the trusted keys that signed, or () when no trusted keys were given.
    signers: tuple[str, ...]
    signature_checked: bool
    registry_key: RegistryKey
    #: The token positions [start, end) the artifact covers.
    positions: tuple[int, int] = (0, 0)
    #: With ``with_parents``: the parents pulled into sibling directories, nearest first.
    parents: tuple[PullResult, ...] = ()

    @property
    def signature(self) -> str:
        """One phrase on the envelope's signature."""
        if self.signature_checked:
            return "signature verified: signed by " + ", ".join(self.signers)
        return "signature NOT checked (no --trusted-keys given)"

    def to_json(self) -> dict[str, Any]:
        """A JSON object for ``--json`` output."""
        return {
            "registry": self.registry,
            "directory": str(self.directory),
            "artifact_digest": self.artifact_digest,
            "parent": self.parent,
            "positions": list(self.positions),
            "log_index": self.log_index,
            "entry_digest": self.entry_digest,
            "tree_size": self.tree_size,
            "root_hash": self.root_hash,
            "files": list(self.files),
            "size": self.size,
            "signature_checked": self.signature_checked,
            "signers": list(self.signers),
            "registry_key": self.registry_key.to_json(),
            "parents": [p.to_json() for p in self.parents],
            "verified": ["blob_digests", "subjects", "leaf_hash", "inclusion", "checkpoint_signature"]
            + (["envelope_signature"] if self.signature_checked else []),
        }


def pull(
    client: RegistryClient,
    digest: str,
    out: Path,
    *,
    trusted_keys: TrustedKeys | None = None,
    registry_key_file: Path | None = None,
    with_parents: bool = False,
    progress: bool = False,
) -> PullResult:
    """Pull the artifact whose tensors have ``digest`` into the new directory ``out``.

    Everything is written to a temporary directory beside ``out`` and checked there: every
    blob's sha256 while it streams, the envelope's signature against ``trusted_keys`` (when
    given; otherwise the result says it was not checked), that the statement is about exactly
    these files, and that the envelope is in the log (inclusion proof against a checkpoint
    signed by the registry key). Only then is the directory renamed to ``out``; on any failure
    nothing appears at ``out`` and the temporary directory is removed. With ``with_parents``
    the parent chain is pulled too, into ``OUT.parent-1`` (the parent), ``OUT.parent-2``, ...
    beside ``out``, where the engine finds them; all of them appear, or none.
    """
    digest = _digest(digest, "artifact digest")
    if out.exists() or out.is_symlink():
        raise LocalFilesError(f"{out} already exists", hint="pull into a new directory")
    key = registry_key(client, registry_key_file)
    temps: list[Path] = []
    results: list[PullResult] = []
    placed: list[Path] = []
    try:
        current: str | None = digest
        while current is not None:
            if len(results) > MAX_CHAIN:
                raise EvidenceError(f"the parent chain of {digest} is longer than {MAX_CHAIN} (a cycle?)")
            target = out if not results else out.with_name(f"{out.name}.parent-{len(results)}")
            if target.exists() or target.is_symlink():
                raise LocalFilesError(f"{target} already exists", hint="pull into a new directory")
            try:
                target.parent.mkdir(parents=True, exist_ok=True)
                temps.append(Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.pull-")))
            except OSError as e:
                raise local_write_error(e, target, target.parent) from e
            result = _stage(client, current, temps[-1], target, key, trusted_keys, progress)
            if results:
                _check_link(client.url, results[-1], result)
            results.append(result)
            current = result.parent if with_parents else None
        # Root first, so that a child never appears without its parents.
        try:
            for tmp, result in zip(reversed(temps), reversed(results), strict=True):
                os.rename(tmp, result.directory)
                placed.append(result.directory)
            _fsync_dir(out.parent)
        except OSError as e:
            raise local_write_error(e, out, out.parent) from e
    except BaseException:
        for tmp in temps:
            shutil.rmtree(tmp, ignore_errors=True)
        for target in placed:
            shutil.rmtree(target, ignore_errors=True)
        raise
    return dataclasses.replace(results[0], parents=tuple(results[1:]))


def _check_link(url: str, child: PullResult, parent: PullResult) -> None:
    # The parent was fetched by the digest the child names, and its statement was checked to be
    # about those tensors; the positions must join too (the engine re-checks chain keys on load).
    if child.parent != parent.artifact_digest or parent.positions[1] != child.positions[0]:
        raise EvidenceError(
            f"{url}: artifact {parent.artifact_digest} (positions {list(parent.positions)}) does not lead to its child "
            f"{child.artifact_digest} (positions {list(child.positions)})",
            hint="the chain on the registry is inconsistent; report it to the registry's operator",
        )


def _stage(
    client: RegistryClient,
    digest: str,
    tmp: Path,
    target: Path,
    key: RegistryKey,
    trusted: TrustedKeys | None,
    progress: bool,
) -> PullResult:
    url = f"{client.url}/v1/artifacts/{digest}"
    doc = client.artifact(digest)
    entry = _field(doc, "entry", dict, "the artifact document", url)
    entry_digest = _field(entry, "digest", str, "the entry", url)
    envelope = client.envelope(_digest(entry_digest, "entry digest"))
    index, head = _verify_entry_evidence(
        client, url, envelope, entry, doc.get("inclusion_proof"), doc.get("checkpoint"), key
    )

    # The statement is read from the logged envelope bytes, never from the server's decoded copy.
    signers: tuple[str, ...] = ()
    try:
        parsed = parse_envelope(envelope, source=f"the envelope of entry {index}")
        if trusted is not None:
            verified, statement = verify_statement_envelope(parsed, trusted)
            signers = tuple(k.name for k in verified.signers)
        else:
            statement = parse_statement(
                b64decode_any(parsed.payload, what="envelope payload"), what=f"statement of entry {index}"
            )
    except (UnknownKeyError, BadSignatureError, ThresholdNotMetError) as e:
        raise EnvelopeSignatureError(
            f"artifact {digest} (entry {index} of {client.url}): {e.message}", hint=e.hint
        ) from e
    except VerificationError as e:
        raise EvidenceError(f"the envelope of entry {index} of {client.url} is not usable: {e.message}") from e
    except SchemaError as e:
        raise EvidenceError(f"the statement of entry {index} of {client.url} is not valid: {e}") from e
    if not isinstance(statement, KvArtifactStatement):
        raise EvidenceError(
            f"entry {index} of {client.url} is a {statement.predicate_type} statement, not a KV artifact"
        )
    subjects = {s.name: "sha256:" + s.digest.sha256 for s in statement.subject}
    if subjects.get(KV_FILE) != digest:
        raise EvidenceError(
            f"{client.url} answered for artifact {digest} with entry {index}, whose statement is about "
            f"{KV_FILE} {subjects.get(KV_FILE)}",
            hint="the registry served the wrong artifact; report it to the registry's operator",
        )

    files = []
    size = 0
    with _progress(progress, None, f"pull {target.name}") as bar:
        for name, subject_digest in subjects.items():
            path = _safe_path(tmp, name, f"entry {index}")
            path.parent.mkdir(parents=True, exist_ok=True)
            size += client.download_blob(subject_digest, path, progress=bar, space_dir=target.parent)
            files.append(name)
    envelope_path = tmp / STATEMENT_FILE
    if STATEMENT_FILE in subjects:
        raise EvidenceError(f"entry {index} names a subject {STATEMENT_FILE}, which would overwrite the envelope")
    try:
        with envelope_path.open("xb") as f:
            f.write(envelope)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        raise local_write_error(e, envelope_path, target.parent, needed=len(envelope)) from e
    try:
        verify_subjects(statement, tmp, exclude=[envelope_path])
    except VerificationError as e:
        raise EvidenceError(f"the files pulled for {digest} are not the statement's subjects: {e.message}") from e
    _fsync_dir(tmp)
    p = statement.predicate
    return PullResult(
        registry=client.url,
        directory=target,
        artifact_digest=digest,
        parent=str(p.parent) if p.parent else None,
        log_index=index,
        entry_digest=entry_digest,
        tree_size=head.size,
        root_hash=head.root_hash.hex(),
        files=tuple(sorted(files)),
        size=size,
        signers=signers,
        signature_checked=trusted is not None,
        registry_key=key,
        positions=(p.positions.start, p.positions.end),
    )


# --- mirror ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MirrorResult:
    """What ``mirror`` copied, and the proof that the target's log extends the source's."""

    source: str
    target: str
    #: The target's size before copying: entries below it were already there.
    start_size: int
    #: N: the source's size when the mirror began; entries [start_size, N) were copied.
    copied_size: int
    copied_entries: int
    blobs_copied: tuple[str, ...]
    blobs_skipped: int
    bytes_copied: int
    #: The source's signed root at N, and the target's at N (equal), and at its current size.
    source_root: str
    target_root_at_copied: str
    target_size: int
    target_root: str
    source_key: RegistryKey
    target_key: RegistryKey
    notes: tuple[str, ...] = field(default=())

    def to_json(self) -> dict[str, Any]:
        """A JSON object for ``--json`` output."""
        return {
            "source": self.source,
            "target": self.target,
            "start_size": self.start_size,
            "copied_size": self.copied_size,
            "copied_entries": self.copied_entries,
            "blobs_copied": list(self.blobs_copied),
            "blobs_skipped": self.blobs_skipped,
            "bytes_copied": self.bytes_copied,
            "source_root": self.source_root,
            "target_root_at_copied": self.target_root_at_copied,
            "target_size": self.target_size,
            "target_root": self.target_root,
            "source_key": self.source_key.to_json(),
            "target_key": self.target_key.to_json(),
            "notes": list(self.notes),
            "verified": ["source_checkpoint", "target_checkpoints", "roots_equal_at_copied_size", "consistency"],
        }


def mirror(
    source: RegistryClient,
    target: RegistryClient,
    *,
    source_key_file: Path | None = None,
    target_key_file: Path | None = None,
    extra_tokens: Sequence[str] = (),
    progress: bool = False,
) -> MirrorResult:
    """Copy every entry of ``source`` that ``target`` lacks, with its blobs, in log order.

    The target must be a mirror of the source so far: its log's first entries must be the
    source's (checked by comparing signed roots) or ``MirrorDivergedError``. The source's size
    N is fixed when the mirror begins; entries [target size, N) are copied. Each envelope is
    posted byte for byte as the source stored it (checked against the source's digest and leaf
    hash), after every blob it names: blobs the target holds are skipped, others stream from a
    GET on the source into a PUT on the target, hashed on the way. Re-running copies only what
    is new.

    Then the proof: the source's checkpoint at N (signed by the source key) and the target's
    checkpoint at N (signed by the target key) must have the same root, and the target's
    consistency proof from N to its current size must verify against the source's root at N.

    ``target`` carries the token; the target's rule is that a token may publish only under keys
    it is bound to, so it must be bound to the keys of the source's publishers. A post refused
    as ``key-not-bound`` is retried with each of ``extra_tokens`` in turn (one per publisher).
    """
    source_key = registry_key(source, source_key_file)
    target_key = registry_key(target, target_key_file)
    source_head, _ = source.signed_head(source_key)
    target_head, _ = target.signed_head(target_key)
    n = source_head.size
    start = target_head.size
    common = min(n, start)
    if common:
        # The target must hold exactly the source's first entries, else copying would misplace them.
        source_common, _ = source.signed_head(source_key, common)
        target_common, _ = target.signed_head(target_key, common)
        if source_common.root_hash != target_common.root_hash:
            raise MirrorDivergedError(
                f"the first {common} entries of {target.url} are not those of {source.url} "
                f"(roots {target_common.root_hash.hex()[:16]} and {source_common.root_hash.hex()[:16]} differ)"
            )
    notes = []
    if start > n:
        notes.append(f"the target already holds {start - n} entries past the source's {n}")

    copied = 0
    blobs_copied: list[str] = []
    blobs_skipped = 0
    bytes_copied = 0
    present: set[str] = set()
    tokens: list[str | None] = [None, *extra_tokens]
    entries = source.iter_entries(below=n) if start < n else iter(())
    with _progress(progress, max(n - start, 0), f"mirror {source.url} -> {target.url}", unit="entry") as bar:
        # Metadata is listed from the start (the API's cursors are opaque); only entries from
        # the target's size on are copied.
        for item in entries:
            index = _field(item, "log_index", int, "an entry", source.url + "/v1/entries")
            if index < start:
                continue
            if index >= n:
                break
            if index != start + copied:
                raise EvidenceError(f"{source.url} listed entry {index} where entry {start + copied} was due")
            envelope = _source_envelope(source, item, index)
            for blob in _blobs_of(item, source.url):
                if blob in present:
                    continue
                if target.blob_size(blob) is None:
                    bytes_copied += _copy_blob(source, target, blob)
                    blobs_copied.append(blob)
                else:
                    blobs_skipped += 1
                present.add(blob)
            doc = _post_with_tokens(target, envelope, tokens, index)
            entry = _field(doc, "entry", dict, "the answer", target.url + "/v1/entries")
            if entry.get("log_index") != index or entry.get("digest") != item["digest"]:
                raise MirrorDivergedError(
                    f"{target.url} logged source entry {index} ({item['digest']}) as entry {entry.get('log_index')}: "
                    "something else was published to the target meanwhile"
                )
            copied += 1
            bar.update(1)
    if start + copied < n:
        raise EvidenceError(
            f"{source.url} listed entries only up to {start + copied - 1}, but its checkpoint is at size {n}"
        )

    # The proof, from signed checkpoints only.
    final, _ = target.signed_head(target_key)
    at_n, _ = target.signed_head(target_key, n)
    if at_n.root_hash != source_head.root_hash:
        raise MirrorDivergedError(
            f"after copying, {target.url} at size {n} has root {at_n.root_hash.hex()}, "
            f"but {source.url} at size {n} has root {source_head.root_hash.hex()}"
        )
    proof = target.consistency_proof(n, final.size)
    purl = target.url + "/v1/log/proof/consistency"
    if (
        _field(proof, "old_size", int, "the consistency proof", purl) != n
        or _field(proof, "new_size", int, "the consistency proof", purl) != final.size
    ):
        raise EvidenceError(f"{purl}: the proof is not from size {n} to size {final.size}")
    hashes = _field(proof, "hashes", list, "the consistency proof", purl)
    try:
        path = [bytes.fromhex(h) if isinstance(h, str) and len(h) == 64 and set(h) <= _HEX64 else b"" for h in hashes]
        verify_consistency(n, final.size, source_head.root_hash, final.root_hash, path)
    except VerificationError as e:
        raise EvidenceError(
            f"{target.url}'s log at size {final.size} is not proved to extend the source's at size {n}: {e.message}"
        ) from e
    return MirrorResult(
        source=source.url,
        target=target.url,
        start_size=start,
        copied_size=n,
        copied_entries=copied,
        blobs_copied=tuple(blobs_copied),
        blobs_skipped=blobs_skipped,
        bytes_copied=bytes_copied,
        source_root=source_head.root_hash.hex(),
        target_root_at_copied=at_n.root_hash.hex(),
        target_size=final.size,
        target_root=final.root_hash.hex(),
        source_key=source_key,
        target_key=target_key,
        notes=tuple(notes),
    )


def _source_envelope(source: RegistryClient, item: dict[str, Any], index: int) -> bytes:
    url = f"{source.url}/v1/entries/{index}/envelope"
    digest = _field(item, "digest", str, f"entry {index}", source.url + "/v1/entries")
    leaf = _field(item, "leaf_hash", str, f"entry {index}", source.url + "/v1/entries")
    envelope = source.envelope(index)
    if _sha256(envelope) != digest or hash_leaf(envelope).hex() != leaf:
        raise EvidenceError(
            f"{url}: the envelope bytes hash to {_sha256(envelope)}, not the entry's digest {digest} and leaf"
        )
    return envelope


def _blobs_of(item: dict[str, Any], url: str) -> list[str]:
    # What the target will require before it accepts the entry: every subject, and a child
    # artifact's parent tensors.
    subjects = _field(item, "subjects", list, "an entry", url)
    blobs = [_digest(_field(s, "digest", str, "a subject", url), "subject digest") for s in subjects]
    artifact = item.get("artifact")
    if isinstance(artifact, dict) and isinstance(artifact.get("parent"), str):
        blobs.append(_digest(artifact["parent"], "parent digest"))
    return list(dict.fromkeys(blobs))


def _copy_blob(source: RegistryClient, target: RegistryClient, digest: str) -> int:
    h = hashlib.sha256()
    sent = 0
    with source.open_blob(digest) as (length, chunks):
        if length is None:
            raise _malformed(f"{source.url}/v1/blobs/{digest}", "the blob came without a Content-Length")

        def hashed() -> Iterator[bytes]:
            nonlocal sent
            for chunk in chunks:
                h.update(chunk)
                sent += len(chunk)
                yield chunk

        try:
            target.put_blob(digest, hashed(), length)
        except RegistryResponseError as e:
            got = "sha256:" + h.hexdigest()
            if got != digest:
                raise BlobDigestError(
                    f"{source.url} served {sent} bytes for blob {digest} that hash to {got}; the target kept nothing"
                ) from e
            raise
    if "sha256:" + h.hexdigest() != digest:
        raise BlobDigestError(f"{source.url} served bytes for blob {digest} that hash to sha256:{h.hexdigest()}")
    return sent


def _post_with_tokens(
    target: RegistryClient, envelope: bytes, tokens: Sequence[str | None], index: int
) -> dict[str, Any]:
    for i, token in enumerate(tokens):
        try:
            doc, _ = target.post_entry(envelope, token=token)
            return doc
        except RegistryAuthError as e:
            if e.problem_type.endswith("/key-not-bound") and i + 1 < len(tokens):
                continue
            if e.problem_type.endswith("/key-not-bound"):
                raise RegistryAuthError(
                    f"{target.url} refused source entry {index}: {e.problem.get('detail', e.message)}",
                    hint="on the target, bind a token to the source publisher's key (kvgraft token create --data DIR "
                    "--publisher NAME --key PUB.pem) and pass it with --token (repeat --token, one per publisher)",
                    status=e.status,
                    problem=e.problem,
                ) from e
            raise
    raise RegistryClientError("no token to publish with", hint="pass --token")  # unreachable: tokens has one entry
