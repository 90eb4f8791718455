"""The registry's HTTP edge and its errors: RFC 9457 problem answers, the ASGI wrapper that runs
before any route (header limits, OPTIONS, HEAD), and bounded body reads.

Shared by the registry app (app.py) and the witness (witness.py). Every answer that carries a
message goes through ``scrub``: the one path-scrub rule (``security.scrub_paths``) that the
browser's pages use too.
"""

from __future__ import annotations

import http
import json
import logging
from typing import Any

from litestar import Litestar, Request, Response
from litestar.enums import ScopeType
from litestar.exceptions import HTTPException, MethodNotAllowedException, NotFoundException, ValidationException
from litestar.types import ASGIApp, HTTPScope, Message, Receive, Scope, Send
from litestar.utils import normalize_path

from ..errors import HeadersTooLargeError, PayloadTooLargeError, RegistryError, storage_error
from ..settings import RegistrySettings
from .security import scrub_paths
from .ui import browser_error_page

logger = logging.getLogger("kvgraft.registry")

PROBLEM_JSON = "application/problem+json"


# --- problems ----------------------------------------------------------------------------------


def problem(
    status: int,
    title: str,
    detail: str,
    *,
    type_: str = "about:blank",
    instance: str | None = None,
    hint: str | None = None,
    extra: dict[str, Any] | None = None,
    headers: dict[str, str] | None = None,
) -> Response[dict[str, Any]]:
    """An RFC 9457 problem response."""
    body: dict[str, Any] = {"type": type_, "title": title, "status": status, "detail": detail}
    if instance is not None:
        body["instance"] = instance
    if hint is not None:
        body["hint"] = hint
    for key, value in (extra or {}).items():
        body.setdefault(key, value)
    return Response(content=body, status_code=status, media_type=PROBLEM_JSON, headers=headers or {})


def scrub(request: Request[Any, Any, Any], text: str, *, server_side: bool) -> str:
    """``text`` as an answer to ``request`` may show it: ``security.scrub_paths`` with the app's
    data directory (``app.state.scrub_roots``). No HTTP answer may name a file on the host: the
    log has the full message."""
    return scrub_paths(text, getattr(request.app.state, "scrub_roots", ()), server_side=server_side)


def scrub_extra(request: Request[Any, Any, Any], extra: dict[str, Any], *, server_side: bool) -> dict[str, Any]:
    """``extra``'s string values scrubbed as ``scrub`` does."""
    return {k: scrub(request, v, server_side=server_side) if isinstance(v, str) else v for k, v in extra.items()}


def registry_error(request: Request[Any, Any, Any], exc: RegistryError) -> Response[dict[str, Any]]:
    """The problem answer of a ``RegistryError`` (its class fixes status and type); 5xx logged and scrubbed of every path."""
    if type(exc) is RegistryError:
        # A plain RegistryError wraps a library failure (DuckDB's "could not write ..."): a full
        # or read-only disk is the operator's to fix and says so (507/503), not a bare 500.
        mapped = storage_error(exc.__cause__ if exc.__cause__ is not None else exc, exc.message.partition(":")[0])
        if mapped is not None:
            logger.error("%s %s failed: %s", request.method, request.url.path, exc, exc_info=exc)
            exc = mapped
    if exc.status_code >= 500:
        logger.error("%s %s failed: %s", request.method, request.url.path, exc, exc_info=exc)
    server_side = exc.status_code >= 500
    return problem(
        exc.status_code,
        exc.title,
        scrub(request, exc.message, server_side=server_side),
        type_=exc.problem_type,
        instance=request.url.path,
        hint=scrub(request, exc.hint, server_side=server_side) if exc.hint is not None else None,
        extra=scrub_extra(request, exc.extra, server_side=server_side),
        headers=exc.headers(),
    )


def http_error(request: Request[Any, Any, Any], exc: HTTPException) -> Response[Any]:
    """Litestar's own refusals (404, 405, validation) as problems, or as HTML pages on a browser's path."""
    page = browser_error_page(request, exc)  # a browser's path (not /v1, /schema, /tlog) gets an HTML page
    if page is not None:
        return page
    status = exc.status_code
    try:
        title = http.HTTPStatus(status).phrase
    except ValueError:
        title = "Error"
    detail = exc.detail or title
    extra: dict[str, Any] = {}
    if isinstance(exc, ValidationException) and isinstance(exc.extra, list) and exc.extra:
        # Litestar's detail names only the route; say which parameter was wrong.
        parts = []
        for item in exc.extra:
            if isinstance(item, dict):
                where = " ".join(str(getattr(item[k], "value", item[k])) for k in ("source", "key") if item.get(k))
                parts.append(f"{where}: {item.get('message', 'invalid')}" if where else str(item.get("message", "invalid")))
        if parts:
            detail = "invalid request: " + "; ".join(parts)
        extra["errors"] = exc.extra
    hint = None
    headers = dict(exc.headers or {})
    if isinstance(exc, MethodNotAllowedException):
        # Litestar's Allow omits HEAD (answered for every GET route, see HttpEdge) and, on a path
        # shared by several handlers, some of the methods: recompute it from the routes.
        allowed = allowed_methods(request.app, request.scope["path"])
        if allowed:
            headers = {k: v for k, v in headers.items() if k.lower() != "allow"} | {"Allow": ", ".join(allowed)}
    if status in (404, 405) and detail == title:
        detail = f"{request.method} {request.url.path} is not part of this registry's API"
        hint = "the API is described at /schema (OpenAPI) and in docs/registry.md"
    if status >= 500:
        logger.error("%s %s failed: %s", request.method, request.url.path, detail)
    detail = scrub(request, detail, server_side=status >= 500)
    return problem(status, title, detail, instance=request.url.path, hint=hint, extra=extra, headers=headers)


def internal_error(request: Request[Any, Any, Any], exc: Exception) -> Response[dict[str, Any]]:
    """Any other exception: logged with its traceback, answered 500 (or 507/503 for a full or read-only disk) without it."""
    logger.error("%s %s failed", request.method, request.url.path, exc_info=exc)
    mapped = storage_error(exc, "the request could not be completed") if isinstance(exc, OSError) else None
    if mapped is not None:
        return registry_error(request, mapped)
    return problem(
        500,
        "Internal Server Error",
        "the registry failed to handle this request",
        instance=request.url.path,
        hint="retry; if it persists, report it to the registry's operator (the server log has the details)",
    )


# --- the HTTP edge: header limits, OPTIONS and HEAD, before any route runs -------------------------

#: The methods a route may have, in the order an Allow header lists them.
METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE")


def allowed_methods(app: Litestar, path: str) -> list[str]:
    """The methods ``path`` answers (HEAD wherever GET is, OPTIONS always); [] when no route matches."""
    normalized = normalize_path(path)
    found: list[str] = []
    for method in METHODS:
        try:
            app.asgi_router.handle_routing(path=normalized, method=method)
        except MethodNotAllowedException:
            continue
        except NotFoundException:
            return []
        found.append(method)
    if "GET" in found and "HEAD" not in found:
        found.insert(found.index("GET") + 1, "HEAD")
    return [*found, "OPTIONS"] if found else []


def problem_messages(exc: RegistryError, path: str) -> tuple[Message, Message]:
    """The two ASGI messages of a problem answer sent before any route runs (the connection then closes)."""
    body = {
        "type": exc.problem_type, "title": exc.title, "status": exc.status_code, "detail": exc.message,
        "instance": path, "hint": exc.hint,
    }
    data = json.dumps(body).encode("utf-8")
    start: Message = {
        "type": "http.response.start",
        "status": exc.status_code,
        "headers": [
            (b"content-type", PROBLEM_JSON.encode("ascii")),
            (b"content-length", str(len(data)).encode("ascii")),
            # The client sent what this server will not parse again on this connection.
            (b"connection", b"close"),
        ],
    }
    return start, {"type": "http.response.body", "body": data, "more_body": False}


class HttpEdge:
    """ASGI wrapper around the app's router, run for every HTTP request, matched or not.

    - Requests whose headers exceed ``max_header_bytes`` (names, values and 4 bytes of ': '
      and CRLF each) or ``max_header_count`` are answered 431 before routing (the uvicorn
      protocol in server.py refuses them earlier still, while they arrive).
    - ``OPTIONS`` answers 204 with an ``Allow`` listing exactly the path's methods.
    - ``HEAD`` on a route that has GET but no HEAD handler runs GET and sends its headers only.
    """

    def __init__(self, app: Litestar, inner: ASGIApp, settings: RegistrySettings) -> None:
        self.app = app
        self.inner = inner
        self.max_header_bytes = settings.max_header_bytes
        self.max_header_count = settings.max_header_count

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != ScopeType.HTTP:  # a str enum: equal to the server's plain "http"
            await self.inner(scope, receive, send)
            return
        # ASGI gives the headers as an iterable of pairs (servers pass a list); read them once.
        headers = list(scope["headers"])
        if len(headers) > self.max_header_count:
            await self._refuse(send, scope, HeadersTooLargeError(
                f"the request has {len(headers)} headers; this registry accepts at most {self.max_header_count}"
            ))
            return
        size = sum(len(name) + len(value) + 4 for name, value in headers)
        if size > self.max_header_bytes:
            await self._refuse(send, scope, HeadersTooLargeError(
                f"the request's headers are {size} bytes; this registry accepts at most {self.max_header_bytes}"
            ))
            return
        method = scope["method"]
        if method in ("OPTIONS", "HEAD"):
            allowed = allowed_methods(self.app, scope["path"])
            if method == "OPTIONS" and allowed:
                await send({"type": "http.response.start", "status": 204, "headers": [(b"allow", ", ".join(allowed).encode("ascii"))]})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                return
            if method == "HEAD" and allowed and not self._has_head_handler(scope["path"]):
                as_get: HTTPScope = {**scope, "method": "GET"}
                await self.inner(as_get, receive, headers_only(send))
                return
        await self.inner(scope, receive, send)

    def _has_head_handler(self, path: str) -> bool:
        try:
            self.app.asgi_router.handle_routing(path=normalize_path(path), method="HEAD")
        except (MethodNotAllowedException, NotFoundException):
            return False
        return True

    @staticmethod
    async def _refuse(send: Send, scope: Scope, exc: RegistryError) -> None:
        logger.warning("%s %s refused: %s", scope.get("method"), scope.get("path"), exc.message)
        for message in problem_messages(exc, str(scope.get("path", ""))):
            await send(message)


def headers_only(send: Send) -> Send:
    """``send`` for a HEAD answered by GET: the start message as is, the body dropped."""
    done = False

    async def wrapped(message: Message) -> None:
        nonlocal done
        if message["type"] == "http.response.body":
            if not done and not message.get("more_body", False):
                done = True
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            return
        await send(message)

    return wrapped


async def read_limited(request: Request[Any, Any, Any], limit: int, what: str) -> bytes:
    """The whole body of ``request``, refused (413 ``PayloadTooLargeError``) past ``limit`` bytes,
    declared or streamed; ``what`` names it in the message."""
    declared = request.headers.get("content-length")
    # ASCII digits only: str.isdigit() also takes '²', which int() refuses.
    if declared is not None and not (declared.isascii() and declared.isdigit()):
        declared = None
    if declared is not None and int(declared) > limit:
        raise PayloadTooLargeError(f"the {what} is {declared} bytes; this registry accepts at most {limit}", extra={"limit": limit})
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise PayloadTooLargeError(f"the {what} is larger than this registry's limit of {limit} bytes", extra={"limit": limit})
        chunks.append(chunk)
    return b"".join(chunks)
