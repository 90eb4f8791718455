"""The client's bounded HTTP layer: limits, one total deadline per request, bounded JSON read
into the shared wire models, and the registry's error documents mapped to client errors.

A registry is not trusted with its sizes or its pace (``ClientLimits``): every request has one
total deadline (connect to last byte, enforced on each socket read and write), a JSON answer is
read up to ``max_json_bytes`` and no further and parsed into its wire model (``kvgraft.schemas``,
strictly: a document of the wrong shape is one ``RegistryResponseError``), a blob is written up to
its Content-Length and no further, and a listing must advance (a new cursor, strictly increasing
log indexes) within ``max_pages`` and ``max_items``.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import hashlib
import json
import math
import os
import sys
import time
import urllib.parse
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import httpcore
import httpx
from pydantic import BaseModel, ValidationError

import kvgraft
from kvgraft.schemas import (
    ArtifactDocument,
    BlobStored,
    ConsistencyProof,
    DigestMatches,
    EntryDocument,
    InclusionProof,
    Listing,
    LogKey,
    SchemaError,
    parse_sha256,
)
from kvgraft.verifier import Checkpoint, WitnessPolicy

from .errors import (
    AmbiguousDigestError,
    BlobDigestError,
    DiskFullError,
    EvidenceError,
    ListingError,
    RegistryAuthError,
    RegistryClientError,
    RegistryNotFoundError,
    RegistryResponseError,
    RegistryUnavailableError,
    ResponseTooLargeError,
    UnwitnessedCheckpointError,
    malformed,
    malformed_document,
)
from .evidence import NO_MEMORY, CheckpointMemory, _NoMemory, prove_extends
from .store import MAX_ENVELOPE_BYTES, free_bytes, local_write_error

if TYPE_CHECKING:
    from .evidence import RegistryKey

#: Blobs move in chunks of this size, both ways: memory stays flat in the blob size.
CHUNK = 1 << 20
#: The largest page the registry serves.
PAGE_LIMIT = 500

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
#: Seconds a client with a witness policy waits for a checkpoint holding its entry to be cosigned
#: (``--witness-wait``): witnesses cosign within moments of a publish when they are up.
DEFAULT_WITNESS_WAIT = 30.0
#: The first and the longest pause between two asks for a witnessed checkpoint.
_WITNESS_POLL_FIRST = 0.25
_WITNESS_POLL_MAX = 2.0

_M = TypeVar("_M", bound=BaseModel)


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
        for f in dataclasses.fields(self):
            if f.name == "timeout":
                continue
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise RegistryClientError(
                    f"{f.name} {value!r} is not a positive integer", hint="pass a positive whole number"
                )

    def blob_seconds(self, size: int) -> float:
        """The deadline of a blob transfer of ``size`` bytes: the timeout plus its time at ``min_rate``."""
        return self.timeout + size / self.min_rate


# --- progress ----------------------------------------------------------------------------------


class Progress(Protocol):
    """The part of a tqdm bar the client uses."""

    def update(self, n: float | None = 1) -> bool | None: ...

    def close(self) -> None: ...


class _NoProgress:
    def update(self, n: float | None = 1) -> bool | None:
        return None

    def close(self) -> None:
        return None


class _LineProgress:
    """Progress where stderr is not a terminal (a log, CI): one plain line when the step ends,
    never a bar's carriage-return residue such as ``0.00B [00:00, ?B/s]``."""

    def __init__(self, desc: str, unit: str) -> None:
        self.desc, self.unit, self.n = desc, unit, 0

    def update(self, n: float | None = 1) -> bool | None:
        self.n += int(n or 0)
        return None

    def close(self) -> None:
        unit = "byte" if self.unit == "B" else self.unit
        plural = unit if self.n == 1 else unit[:-1] + "ies" if unit.endswith("y") else unit + "s"
        done = f"{self.n} {plural}"
        sys.stderr.write(f"kvgraft: {self.desc}: {done}\n")
        sys.stderr.flush()


def _bar(enabled: bool, total: int | None, desc: str, unit: str = "B") -> Progress:
    """A tqdm bar on stderr when it is a terminal, a plain line per step otherwise; a no-op when
    disabled, pointless (nothing to do) or tqdm is missing."""
    if not enabled or total == 0:
        return _NoProgress()
    if not sys.stderr.isatty():
        return _LineProgress(desc, unit)
    try:
        from tqdm import tqdm
    except ImportError:
        # tqdm comes with the engine's dependencies; the registry extra alone may lack it.
        return _NoProgress()
    bar: Progress = tqdm(
        total=total, desc=desc, unit=unit, unit_scale=unit == "B", unit_divisor=1024, file=sys.stderr, leave=False
    )
    return bar


@contextlib.contextmanager
def progress_bar(enabled: bool, total: int | None, desc: str, unit: str = "B") -> Iterator[Progress]:
    """A progress bar (``_bar``) closed when the block ends."""
    bar = _bar(enabled, total, desc, unit)
    try:
        yield bar
    finally:
        bar.close()


# --- small helpers -----------------------------------------------------------------------------


def checked_digest(value: str, what: str = "digest") -> str:
    """``value`` when it is ``sha256:<64 lowercase hex>``, else a one-line ``RegistryClientError``."""
    try:
        return str(parse_sha256(value))
    except SchemaError as e:
        raise RegistryClientError(
            f"{what} {value[:80]!r} is not sha256:<64 lowercase hex>", hint="copy the digest exactly"
        ) from e


def sha256_of(data: bytes) -> str:
    """``sha256:<hex>`` of ``data``."""
    return "sha256:" + hashlib.sha256(data).hexdigest()


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
        raise malformed(url, "the body is not JSON") from e
    if _too_deep(doc, limits.max_json_depth):
        raise ResponseTooLargeError(f"{url} sent JSON nested more than {limits.max_json_depth} levels deep")
    return doc


def parse_wire(model: type[_M], doc: Any, url: str, what: str) -> _M:
    """``doc`` (parsed JSON) as the wire model ``model``, strictly (nothing coerced: ``"1"`` is not
    an index, ``true`` is not a size); a document of another shape is one ``RegistryResponseError``."""
    if not isinstance(doc, dict):
        raise malformed(url, f"{what} is a JSON {type(doc).__name__}, not an object")
    try:
        return model.model_validate(doc, strict=True)
    except ValidationError as e:
        raise malformed_document(url, e, what) from e


# --- the HTTP client ---------------------------------------------------------------------------


class RegistryClient:
    """One registry, over one ``httpx.Client``; use it as a context manager so the connection
    pool is closed when the block ends.

    ``token`` is sent as ``Authorization: Bearer`` on every request (writes need it; reads need
    it only on registries started with ``--reads-require-token``). ``limits`` bound every
    answer (``timeout``, when given, replaces ``limits.timeout``). ``memory`` remembers the
    newest checkpoint verified per log and refuses one that does not extend it: by default
    (None) ``CheckpointMemory.default()``, under ``$KVGRAFT_HOME``; ``NO_MEMORY`` turns it off.
    ``witness_policy``, when given, is the quorum of witness cosignatures every checkpoint this
    client accepts must carry (``registry_key`` puts it on the key); ``witness_wait`` bounds how
    long it waits for the witnesses to cosign a checkpoint that holds a given entry.

    JSON answers come back as the wire models of ``kvgraft.schemas`` (``LogKey``,
    ``EntryDocument``, ...); listings yield each item as the registry sent it (a dict with at
    least a ``log_index``).
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
        witness_policy: WitnessPolicy | None = None,
        witness_wait: float = DEFAULT_WITNESS_WAIT,
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
        if not (math.isfinite(witness_wait) and witness_wait >= 0):
            raise RegistryClientError(
                f"witness wait {witness_wait} is not a number of seconds >= 0", hint="pass --witness-wait S with S >= 0"
            )
        self.witness_policy = witness_policy
        self.witness_wait = witness_wait
        self.memory: CheckpointMemory | None = (
            CheckpointMemory.default() if memory is None else None if memory is NO_MEMORY else memory  # type: ignore[assignment]
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
        # The problem document is read leniently (a dict as served): it only words the error.
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

    def _document(self, model: type[_M], path: str, what: str, *, method: str = "GET", **kwargs: Any) -> tuple[int, _M]:
        """(status, the JSON answer as ``model``): read within ``max_json_bytes`` and
        ``max_json_depth``, then parsed strictly (``parse_wire``)."""
        status, body = self._request(method, path, what="a JSON answer", **kwargs)
        url = self.url + path
        return status, parse_wire(model, parse_json_answer(body, url, self.limits), url, what)

    # --- short digests --------------------------------------------------------------------

    def resolve_digest(self, text: str, *, artifacts_only: bool = True) -> str:
        """``text`` as a full ``sha256:<hex>`` digest: itself when it is one; else a short digest
        (``sha256:1f2e3d4c`` or ``1f2e3d4c``, at least 4 hex digits) resolved by the registry
        (``GET /v1/digests/{prefix}``) as git resolves an abbreviation: the one digest it starts,
        ``RegistryNotFoundError`` for none, ``AmbiguousDigestError`` listing the candidates for several."""
        hex_part = text.removeprefix("sha256:")
        if len(hex_part) == 64:
            return checked_digest(text)
        if not (4 <= len(hex_part) < 64 and all(c in "0123456789abcdef" for c in hex_part)):
            raise RegistryClientError(f"{text[:80]!r} is neither a digest nor a short one",
                                      hint="pass sha256:<64 lowercase hex>, or a unique start of one (at least 4 hex digits)")
        query = "?kind=artifact" if artifacts_only else ""
        found = self._document(DigestMatches, f"/v1/digests/sha256:{hex_part}{query}", "the digests")[1]
        # The registry's answer is checked, not trusted: every match must start with what was asked.
        matches = [m.digest for m in found.matches if m.digest.startswith(f"sha256:{hex_part}")]
        what = "artifact digest" if artifacts_only else "digest"
        if not matches:
            raise RegistryNotFoundError(f"no {what} in {self.url} starts with sha256:{hex_part}",
                                        hint="check the digest; list the registry's artifacts with GET /v1/artifacts")
        if len(matches) > 1 or found.more:
            listed = ", ".join(matches) + (", ..." if found.more else "")
            raise AmbiguousDigestError(f"sha256:{hex_part} is the start of several {what}s in {self.url}: {listed}")
        return checked_digest(matches[0])

    # --- the log -------------------------------------------------------------------------

    def log_key(self) -> LogKey:
        """``GET /v1/log/key``: origin, public key PEM, key id, note verifier key, tree size."""
        return self._document(LogKey, "/v1/log/key", "the log key")[1]

    def checkpoint(self, tree_size: int | None = None, *, witnessed: int | None = None) -> bytes:
        """The signed checkpoint note, latest, at ``tree_size``, or the newest cosigned by at least
        ``witnessed`` witnesses, byte for byte as served (unchecked: see ``signed_head``)."""
        params = {} if tree_size is None else {"tree_size": tree_size}
        if witnessed is not None:
            params["witnessed"] = witnessed
        return self._request(
            "GET", "/v1/log/checkpoint", params=params, limit=self.limits.max_note_bytes, what="a checkpoint"
        )[1]

    def signed_head(self, key: RegistryKey, tree_size: int | None = None) -> tuple[Checkpoint, bytes]:
        """The checkpoint (latest, or at ``tree_size``) verified with ``key`` and against the
        remembered one (``CheckpointMemory``): (checkpoint, note bytes as served).

        With a witness policy on ``key`` the latest is the newest *witnessed* checkpoint
        (``witnessed_head``), and one at ``tree_size`` must be signed by the log and either meet the
        policy itself or be proved (consistency proof) a prefix of the newest witnessed one.
        """
        if key.policy is not None:
            return self._witnessed_signed_head(key, tree_size)
        note = self.checkpoint(tree_size)
        head = key.verify(note, self.url + "/v1/log/checkpoint")
        if tree_size is not None and head.size != tree_size:
            raise EvidenceError(f"{self.url} answered for its checkpoint at size {tree_size} with size {head.size}")
        self.remember(key, head, note, latest=tree_size is None)
        return head, note

    def _witnessed_signed_head(self, key: RegistryKey, tree_size: int | None) -> tuple[Checkpoint, bytes]:
        witnessed, witnessed_note = self.witnessed_head(key)
        if tree_size is None or tree_size == witnessed.size:
            return witnessed, witnessed_note
        url = self.url + "/v1/log/checkpoint"
        note = self.checkpoint(tree_size)
        head = key.verify_signed(note, url) if tree_size < witnessed.size else key.verify(note, url)
        if head.size != tree_size:
            raise EvidenceError(f"{self.url} answered for its checkpoint at size {tree_size} with size {head.size}")
        if head.size < witnessed.size:
            # Signed by the log, and a prefix of a tree the witnesses vouch for: as good as witnessed.
            self.verify_extends(head, witnessed)
        self.remember(key, head, note, latest=False)
        return head, note

    def witnessed_head(self, key: RegistryKey, *, min_size: int = 0) -> tuple[Checkpoint, bytes]:
        """The newest checkpoint meeting ``key``'s witness policy, of at least ``min_size`` entries.

        Asks ``/v1/log/checkpoint?witnessed=K`` (K: the fewest cosignatures the quorum can be met
        with) until the answer is at least ``min_size`` and meets the policy, for at most
        ``witness_wait`` seconds; then ``UnwitnessedCheckpointError`` saying what it got. The
        checkpoint is checked against the remembered one and remembered (as a past head: the
        registry may hold newer, not yet witnessed ones).
        """
        policy = key.policy
        if policy is None:
            raise RegistryClientError("witnessed_head needs a key with a witness policy", hint="this is a bug in kvgraft")
        url = self.url + "/v1/log/checkpoint"
        deadline = time.monotonic() + self.witness_wait
        pause = _WITNESS_POLL_FIRST
        while True:
            try:
                note = self.checkpoint(witnessed=policy.min_cosignatures())
                head = key.verify(note, url)
                if head.size >= min_size:
                    self.remember(key, head, note, latest=False)
                    return head, note
                why = (
                    f"the newest checkpoint cosigned as {policy.source} requires is at tree size {head.size}, and "
                    f"entry {min_size - 1} needs one of at least {min_size}"
                )
            except RegistryNotFoundError as e:
                why = f"it holds no checkpoint cosigned by {policy.min_cosignatures()} witness(es) ({e.message})"
            except UnwitnessedCheckpointError as e:
                why = e.message
            if time.monotonic() + pause > deadline:
                raise UnwitnessedCheckpointError(
                    f"{self.url} serves no checkpoint that meets the witness policy's quorum, {policy.describe()}, "
                    f"after waiting {self.witness_wait:g} s: {why}"
                )
            time.sleep(pause)
            pause = min(pause * 2, _WITNESS_POLL_MAX)

    def remember(self, key: RegistryKey, head: Checkpoint, note: bytes, *, latest: bool) -> None:
        """Check a verified checkpoint against the remembered one and remember it when newer.

        ``latest``: the registry served it as its current head (a smaller size than remembered
        is then a rollback); otherwise it is a past head, which must be proved a prefix.
        """
        if self.memory is not None:
            self.memory.check(self, key, head, note, latest=latest)

    def inclusion_proof(self, index: int, tree_size: int | None = None) -> InclusionProof:
        """The inclusion proof (``log_index``, ``tree_size``, ``hashes``) of entry ``index``."""
        params: dict[str, int] = {"index": index}
        if tree_size is not None:
            params["tree_size"] = tree_size
        return self._document(InclusionProof, "/v1/log/proof/inclusion", "the inclusion proof", params=params)[1]

    def consistency_proof(self, old: int, new: int | None = None) -> ConsistencyProof:
        """The consistency proof (``old_size``, ``new_size``, ``hashes``) between two tree sizes (new: latest)."""
        params: dict[str, int] = {"old": old}
        if new is not None:
            params["new"] = new
        return self._document(ConsistencyProof, "/v1/log/proof/consistency", "the consistency proof", params=params)[1]

    def verify_extends(self, old: Checkpoint, new: Checkpoint) -> None:
        """Fetch and verify the consistency proof that ``new`` extends ``old`` (raises ``EvidenceError``)."""
        prove_extends(self, old, new)

    # --- blobs ---------------------------------------------------------------------------

    def blob_size(self, digest: str) -> int | None:
        """The stored blob's size (``HEAD``), or None when the registry does not hold it."""
        digest = checked_digest(digest)
        with self._stream("HEAD", f"/v1/blobs/{digest}", expect=(200, 404)) as (response, _):
            if response.status_code == 404:
                return None
            length = response.headers.get("content-length", "")
        if not (length.isascii() and length.isdigit()):
            raise malformed(f"{self.url}/v1/blobs/{digest}", "HEAD sent no Content-Length")
        return int(length)

    def put_blob(self, digest: str, chunks: Iterable[bytes], size: int) -> bool:
        """Upload ``size`` bytes streamed from ``chunks`` as blob ``digest``; True when new.

        Content-Length is sent so that an oversized blob is refused before any byte goes. The
        upload's deadline is the timeout plus ``size`` at ``limits.min_rate``. The answer must be
        a ``BlobStored`` for ``digest``.
        """
        digest = checked_digest(digest)
        path = f"/v1/blobs/{digest}"
        status, body = self._request(
            "PUT",
            path,
            expect=(200, 201),
            content=chunks,
            limit=self.limits.max_problem_bytes,
            headers={"Content-Length": str(size), "Content-Type": "application/octet-stream"},
            seconds=self.limits.blob_seconds(size),
        )
        url = self.url + path
        stored = parse_wire(BlobStored, parse_json_answer(body, url, self.limits), url, "the blob answer")
        if stored.digest != digest:
            raise malformed(url, f"the upload of {digest} was answered for blob {stored.digest}")
        return status == 201

    @contextlib.contextmanager
    def open_blob(self, digest: str) -> Iterator[tuple[int | None, Iterator[bytes]]]:
        """Stream blob ``digest``: yields (Content-Length or None, an iterator of chunks).

        The chunks are the bytes as served, unchecked: hash them (``download_blob`` does). They
        never add up to more than the Content-Length, which must be within ``max_blob_bytes``;
        the transfer's deadline is the timeout plus that length at ``min_rate``.
        """
        digest = checked_digest(digest)
        url = f"/v1/blobs/{digest}"
        # Identity, so that Content-Length is the blob's size, which bounds what is written.
        with self._stream("GET", url, headers={"Accept-Encoding": "identity"}) as (response, deadline):
            raw_length = response.headers.get("content-length", "")
            length = int(raw_length) if raw_length.isascii() and raw_length.isdigit() else None
            if response.headers.get("content-encoding", "identity").lower() != "identity":
                raise malformed(
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
        digest = checked_digest(digest)
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
                    raise malformed(f"{self.url}/v1/blobs/{digest}", "the blob came without a Content-Length")
                free = free_bytes(dest.parent)
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

    def post_entry(self, envelope: bytes, *, token: str | None = None) -> tuple[EntryDocument, bool]:
        """``POST /v1/entries`` with the envelope bytes as given; (the entry document, created)."""
        status, doc = self._document(
            EntryDocument,
            "/v1/entries",
            "the publish answer",
            method="POST",
            expect=(200, 201),
            token=token,
            content=envelope,
            headers={"Content-Type": "application/json"},
        )
        return doc, status == 201

    def entry(self, ref: int | str) -> EntryDocument:
        """The entry (by log index or envelope digest), its inclusion proof and the latest checkpoint."""
        return self._document(EntryDocument, f"/v1/entries/{ref}", "the entry document")[1]

    def envelope(self, ref: int | str) -> bytes:
        """An entry's envelope bytes exactly as stored (unchecked: see ``hash_leaf``)."""
        return self._request(
            "GET", f"/v1/entries/{ref}/envelope", limit=self.limits.max_envelope_bytes, what="an envelope"
        )[1]

    def artifact(self, digest: str, *, signer: str | None = None) -> ArtifactDocument:
        """``GET /v1/artifacts/sha256:HEX``: the artifact by its tensors' digest, as the first entry
        signed by key id ``signer`` claims it (default: the first entry logged)."""
        path = f"/v1/artifacts/{checked_digest(digest, 'artifact digest')}"
        params = {} if signer is None else {"signer": signer}
        return self._document(ArtifactDocument, path, "the artifact document", params=params)[1]

    def _pages(self, path: str, params: dict[str, Any], *, below: int | None = None) -> Iterator[dict[str, Any]]:
        """Every item of a paged listing, in log order, up to (not including) log index ``below``.

        Each page is read as a ``Listing`` (items with a ``log_index``, a cursor). The listing must
        advance: each cursor new, each item's ``log_index`` larger than the last, within
        ``max_pages`` pages and ``max_items`` items; else ``ListingError``.
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
            raw = parse_json_answer(self._request("GET", path, params=query, what="a JSON answer")[1], url, self.limits)
            page = parse_wire(Listing, raw, url, "the page")
            next_cursor = page.next_cursor
            if next_cursor is not None:
                if not page.items:
                    raise malformed(url, "a page with a cursor is empty")
                if next_cursor in seen or next_cursor == cursor:
                    raise ListingError(
                        f"{url} sent the cursor {next_cursor[:40]!r} again on page {page_number}: the listing would never end"
                    )
                seen.add(next_cursor)
            for item, doc in zip(page.items, raw["items"], strict=True):
                index = item.log_index
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
                yield doc
            if next_cursor is None:
                return
            cursor = next_cursor
        raise ListingError(f"{url} is still listing after {self.limits.max_pages} pages; stopped")

    def iter_entries(self, *, below: int | None = None) -> Iterator[dict[str, Any]]:
        """Every entry's metadata, in log order (``GET /v1/entries``, all pages), up to log index ``below``.

        Each item is as served; read it with ``kvgraft.schemas.EntryMeta`` (``mirror`` does)."""
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
        """Artifacts in log order, filtered as ``GET /v1/artifacts`` filters (all pages); each item
        as served (an ``ArtifactSummary``)."""
        return self._pages(
            "/v1/artifacts", {"model": model, "profile": profile, "parent": parent, "publisher": publisher, "q": q}
        )

    def list_records(
        self, *, artifact: str | None = None, kind: str | None = None, publisher: str | None = None
    ) -> Iterator[dict[str, Any]]:
        """Records in log order, filtered as ``GET /v1/records`` filters (all pages); each item as
        served (an ``EntryMeta``)."""
        return self._pages("/v1/records", {"artifact": artifact, "type": kind, "publisher": publisher})
