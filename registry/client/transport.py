"""The client's bounded HTTP layer: limits, one total deadline per request, bounded JSON read
into the shared wire models, and the registry's error documents mapped to client errors.

A registry is not trusted with its sizes or its pace (``ClientLimits``): every request has one
total deadline (connect to last byte, enforced on each socket read and write), a JSON answer is
read up to ``max_json_bytes`` and no further and parsed into its wire model (``kvgraft.schemas``,
strictly: a document of the wrong shape is one ``RegistryResponseError``), and an error answer's
problem document is read up to ``max_problem_bytes`` and raised as the matching
``RegistryClientError``. The endpoints themselves (``RegistryClient``) are in ``http``.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import json
import math
import time
import urllib.parse
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import httpcore
import httpx
from pydantic import BaseModel, ValidationError

import kvgraft

from .errors import (
    RegistryAuthError,
    RegistryClientError,
    RegistryNotFoundError,
    RegistryResponseError,
    RegistryUnavailableError,
    ResponseTooLargeError,
    malformed,
    malformed_document,
)
from .store import MAX_ENVELOPE_BYTES

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


# --- deadlines ---------------------------------------------------------------------------------


class Deadline:
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
_DEADLINES: contextvars.ContextVar[tuple[Deadline, ...]] = contextvars.ContextVar(
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
    # deadline between chunks (see Transport.read_body), a coarser bound.
    for transport in [http._transport, *http._mounts.values()]:
        pool = getattr(transport, "_pool", None)
        backend = getattr(pool, "_network_backend", None)
        if backend is not None and not isinstance(backend, _DeadlineBackend):
            pool._network_backend = _DeadlineBackend(backend)  # type: ignore[union-attr]


@contextlib.contextmanager
def _deadline(seconds: float) -> Iterator[Deadline]:
    d = Deadline(seconds)
    token = _DEADLINES.set((*_DEADLINES.get(), d))
    try:
        yield d
    finally:
        _DEADLINES.reset(token)


def check_deadline(what: str) -> None:
    """Raise ``httpx.ReadTimeout`` when a request in progress in this context is past its deadline."""
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



# --- one registry's HTTP session -----------------------------------------------------------------


def registry_url(url: str) -> str:
    """``url`` without its trailing slashes when it is an http(s) URL with a host, else a one-line
    ``RegistryClientError``."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise RegistryClientError(
            f"{url!r} is not a registry URL", hint="pass http(s)://host:port, e.g. http://127.0.0.1:8000"
        )
    return url.rstrip("/")


class Transport:
    """One registry's ``httpx.Client`` under ``ClientLimits``: every request under one total
    deadline, every body read within its limit, every status outside the expected ones raised
    as the error its problem document describes. ``RegistryClient`` makes its calls through it.

    ``url`` is a checked registry URL (``registry_url``); ``token`` is sent as ``Authorization:
    Bearer`` on every request; ``transport`` replaces httpx's (tests).
    """

    def __init__(
        self, url: str, limits: ClientLimits, *, token: str | None = None, transport: httpx.BaseTransport | None = None
    ) -> None:
        self.url = url
        self.limits = limits
        headers = {"User-Agent": f"kvgraft/{kvgraft.__version__}"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        self._client = httpx.Client(
            base_url=self.url,
            headers=headers,
            # Each read or write waits at most this long, and never past the request's deadline.
            timeout=httpx.Timeout(limits.timeout, connect=min(limits.timeout, 10.0)),
            transport=transport,
            follow_redirects=False,
        )
        _install_deadlines(self._client)

    def close(self) -> None:
        """Close the connection pool."""
        self._client.close()

    def read_body(self, response: httpx.Response, limit: int, what: str) -> bytes:
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
                check_deadline(url)
            return bytes(body)
        except MemoryError as e:
            raise ResponseTooLargeError(f"{url}: {what} of {len(body)} bytes so far does not fit in memory") from e

    def error(self, response: httpx.Response) -> RegistryResponseError:
        # The problem document is read leniently (a dict as served): it only words the error.
        problem: dict[str, Any] = {}
        with contextlib.suppress(ValueError, RecursionError, MemoryError, RegistryClientError, httpx.HTTPError):
            body = self.read_body(response, self.limits.max_problem_bytes, "an error document")
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
    def stream(
        self,
        method: str,
        path: str,
        *,
        expect: Sequence[int] = (200,),
        token: str | None = None,
        seconds: float | None = None,
        **kwargs: Any,
    ) -> Iterator[tuple[httpx.Response, Deadline]]:
        """Send one request under one total deadline (``seconds``, default the timeout) and yield
        (the response, its deadline) with the body unread; a status not in ``expect`` raises."""
        headers = dict(kwargs.pop("headers", None) or {})
        if token:
            headers["Authorization"] = f"Bearer {token}"
        seconds = self.limits.timeout if seconds is None else seconds
        with _deadline(seconds) as deadline:
            try:
                with self._client.stream(method, path, headers=headers, **kwargs) as response:
                    if response.status_code not in expect:
                        raise self.error(response)
                    yield response, deadline
            except httpx.TimeoutException as e:
                raise RegistryUnavailableError(
                    f"{method} {self.url}{path} did not complete within its deadline of {deadline.seconds:.0f} s ({e})",
                    hint="the registry is too slow or stalls; retry, or raise --timeout (the limit for a whole request)",
                ) from e
            except httpx.HTTPError as e:
                raise RegistryUnavailableError(f"{method} {self.url}{path} failed: {str(e) or type(e).__name__}") from e

    def request(
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
        with self.stream(method, path, expect=expect, token=token, **kwargs) as (response, _):
            body = self.read_body(response, self.limits.max_json_bytes if limit is None else limit, what)
            return response.status_code, body

    def document(self, model: type[_M], path: str, what: str, *, method: str = "GET", **kwargs: Any) -> tuple[int, _M]:
        """(status, the JSON answer as ``model``): read within ``max_json_bytes`` and
        ``max_json_depth``, then parsed strictly (``parse_wire``)."""
        status, body = self.request(method, path, what="a JSON answer", **kwargs)
        url = self.url + path
        return status, parse_wire(model, parse_json_answer(body, url, self.limits), url, what)
