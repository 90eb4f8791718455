"""``kvgraft serve``: the registry app under uvicorn."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import ipaddress
import json
import logging
import os
import shutil
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .errors import ConfigError, HeadersTooLargeError
from .service import Registry
from .settings import RegistrySettings


def local_url(host: str, port: int) -> str:
    """The URL admin commands on this machine use to reach a server bound to ``host:port``."""
    if host in ("", "0.0.0.0"):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    try:
        if ipaddress.ip_address(host).version == 6:
            host = f"[{host}]"
    except ValueError:
        pass  # a host name
    return f"http://{host}:{port}"


def _refusal(exc: HeadersTooLargeError) -> bytes:
    """A complete HTTP/1.1 431 answer with an RFC 9457 problem body, closing the connection."""
    body = json.dumps(
        {"type": exc.problem_type, "title": exc.title, "status": exc.status_code, "detail": exc.message, "hint": exc.hint}
    ).encode("utf-8")
    head = (
        f"HTTP/1.1 {exc.status_code} Request Header Fields Too Large\r\n"
        "content-type: application/problem+json\r\n"
        f"content-length: {len(body)}\r\n"
        "connection: close\r\n\r\n"
    )
    return head.encode("ascii") + body


def header_limited_protocol(max_header_bytes: int, max_header_count: int) -> type[asyncio.Protocol]:
    """uvicorn's httptools protocol, refusing a request head past the limits while it arrives.

    httptools gathers a header value by repeated ``bytes +=`` (quadratic in its length) and
    uvicorn keeps every header: without a bound, one 128 MiB header or 20,000 small ones cost
    seconds of the event loop and stall every other connection. This protocol counts the head's
    bytes as they are received (request line and headers, until the parser reports the headers
    complete) and the headers as they are parsed; past ``max_header_bytes`` or
    ``max_header_count`` it answers 431 with a problem document and closes the connection, so the
    rest of the head is never parsed. The app checks the same limits again (``HttpEdge``).

    A chunked body's trailers are header fields too, gathered the same way, after the head, even
    once the app has answered: they count against the same two limits (bytes of head plus
    trailers, and fields of head plus trailers). The parser says where a chunk starts
    (``on_chunk_header``) and where its data or its end is (``on_body``, ``on_chunk_complete``);
    a read that begins after a chunk header and reaches neither is trailer bytes (the last
    chunk's), so what a trailer holds in memory before the refusal is at most the limit and one
    read.
    """
    import httptools
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class _HeadTooLarge(Exception):
        def __init__(self, error: HeadersTooLargeError) -> None:
            super().__init__(error.message)
            self.error = error

    class HeaderLimitedProtocol(HttpToolsProtocol):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._head_open = True
            self._head_bytes = 0
            self._head_count = 0
            self._refused = False
            self._pending: HeadersTooLargeError | None = None
            # After a chunk header and before its data or its end: maybe the last chunk's trailers.
            self._after_chunk_header = False
            # Counts the chunk data and chunk ends the parser reported (a read that moved it is body).
            self._chunk_progress = 0

        def data_received(self, data: bytes) -> None:
            if self._refused:
                return
            if self._head_open:
                self._head_bytes += len(data)
            trailing, progress = self._after_chunk_header, self._chunk_progress
            # A callback's _HeadTooLarge reaches uvicorn as a parser error: send_400_response answers 431.
            super().data_received(data)
            if self._refused:
                return
            # Still inside the head after all of this chunk: every byte received was head.
            if self._head_open and self._head_bytes > max_header_bytes:
                self._refuse(HeadersTooLargeError(
                    f"the request's head is over {max_header_bytes} bytes; this registry accepts at most {max_header_bytes}"
                ))
            # Began and ended after the last chunk's header with no chunk data or end: all trailer bytes.
            elif trailing and self._after_chunk_header and progress == self._chunk_progress:
                self._head_bytes += len(data)
                if self._head_bytes > max_header_bytes:
                    self._refuse(HeadersTooLargeError(
                        f"the request's headers and chunked-body trailers are over {max_header_bytes} bytes; "
                        f"this registry accepts at most {max_header_bytes}",
                        hint="send no trailers, or short ones; the limit is the registry's max_header_bytes",
                    ))

        def send_400_response(self, msg: str) -> None:
            # A parser callback that raised _HeadTooLarge surfaces as a parser error: answer 431.
            cause = self._pending
            if cause is not None:
                self._pending = None
                self._refuse(cause)
                return
            super().send_400_response(msg)

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._head_open = True
            self._head_count = 0

        def on_header(self, name: bytes, value: bytes) -> None:
            self._head_count += 1
            if self._head_count > max_header_count:
                self._pending = HeadersTooLargeError(
                    f"the request has more than {max_header_count} headers; this registry accepts at most {max_header_count}"
                )
                raise _HeadTooLarge(self._pending)
            super().on_header(name, value)

        def on_headers_complete(self) -> None:
            self._head_open = False
            super().on_headers_complete()

        def on_chunk_header(self) -> None:
            self._after_chunk_header = True

        def on_body(self, body: bytes) -> None:
            self._after_chunk_header = False
            self._chunk_progress += 1
            super().on_body(body)

        def on_chunk_complete(self) -> None:
            self._after_chunk_header = False
            self._chunk_progress += 1

        def on_message_complete(self) -> None:
            super().on_message_complete()
            # The next request on this connection starts a new head.
            self._head_open = True
            self._head_bytes = 0
            self._after_chunk_header = False

        def _refuse(self, error: HeadersTooLargeError) -> None:
            self._refused = True
            self.logger.warning("request refused: %s", error.message)
            if not self.transport.is_closing():
                self.transport.write(_refusal(error))
                self.transport.close()

    del httptools  # imported only to fail here, not inside uvicorn, when it is missing
    return HeaderLimitedProtocol


def _http_protocol(settings: RegistrySettings) -> type[asyncio.Protocol] | str:
    try:
        return header_limited_protocol(settings.max_header_bytes, settings.max_header_count)
    except ImportError:
        return "h11"


def _check_data_dir(data_dir: Path, *, init: bool) -> bool:
    """Whether ``data_dir`` is new to the registry (missing, or an empty directory); ``ConfigError``
    for a missing one without ``init`` (a mistyped path must not start a new registry with a new
    key) and for a path that is not a directory."""
    if not data_dir.exists():
        if init:
            return True
        raise ConfigError(
            f"the data directory {data_dir} does not exist",
            hint=f"check the path for an existing registry; to start a new one there, create it (mkdir {data_dir}) "
            "or pass --init",
        )
    if not data_dir.is_dir():
        raise ConfigError(f"the data directory {data_dir} is not a directory", hint="pass a registry's data directory")
    try:
        return not any(data_dir.iterdir())
    except OSError as e:
        raise ConfigError(f"cannot read the data directory {data_dir}: {e.strerror or e}") from e


def _undo_init(data_dir: Path) -> Callable[[], None]:
    """Create ``data_dir`` (and missing parents) if needed; return what puts things back as they
    were: the created folders removed, or an existing empty directory emptied again."""
    missing = [p for p in (data_dir, *data_dir.parents) if not p.exists()]
    try:
        data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        # A new registry's directory is its owner's alone, as one the registry creates is: it will
        # hold the signing key, token hashes and the database (an empty one made by mkdir is 0755).
        data_dir.chmod(0o700)
    except OSError as e:
        raise ConfigError(f"cannot create the data directory {data_dir}: {e.strerror or e}") from e

    def undo() -> None:
        if missing:
            shutil.rmtree(missing[-1], ignore_errors=True)
            return
        for child in list(data_dir.iterdir()):
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    child.unlink()

    return undo


def _listen(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` (as uvicorn binds one), before anything is written: a port
    in use stops the start with nothing created."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family=family, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ConfigError(
            f"cannot listen on {host}:{port}: {e.strerror or e}; nothing was started or created",
            hint="stop the process using the port, or pass another --port (and --host)",
        ) from e
    return sock


def serve(
    data_dir: Path, *, host: str, port: int, settings: RegistrySettings, log_level: str = "info", init: bool = False
) -> bool:
    """Serve ``data_dir`` on ``host:port`` until interrupted (SIGINT/SIGTERM); False if it never started.

    ``data_dir`` must exist (``init``: it is created). A missing or empty one is initialised (a
    new registry key and log) and the log says so; if the start then fails (the port is in use,
    a bad setting, the database or blob store refuses) nothing is left of that initialisation.
    The port is bound first, then the data directory is opened once before the server starts,
    so that a bad setting, a locked database or a damaged log is reported plainly instead of
    from inside uvicorn.
    """
    import uvicorn

    from .http.app import create_app

    if not 1 <= port <= 65535:
        raise ConfigError(f"port {port} is not between 1 and 65535", hint="pass --port 8000, or another free port")
    fresh = _check_data_dir(data_dir, init=init)
    how = "was empty" if data_dir.is_dir() else "was created: --init"
    sock = _listen(host, port)
    # Every file this process creates without an explicit mode is private: the database and its
    # WAL (DuckDB takes no mode) hold token hashes. Public files (blobs) are chmod'ed explicitly.
    os.umask(0o077)
    undo: Callable[[], None] | None = None
    started = False
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s:     %(name)s: %(message)s"))
    registry_logger = logging.getLogger("kvgraft.registry")
    registry_logger.addHandler(handler)
    registry_logger.setLevel(log_level.upper())
    registry_logger.propagate = False
    try:
        undo = _undo_init(data_dir) if fresh else None
        with Registry.open(data_dir, settings) as registry:
            if fresh:
                registry_logger.warning(
                    "initialised a new registry in %s (the directory %s): a new registry key %s, log origin %s",
                    data_dir, how, registry.data.public_key_path, registry.log.origin,
                )
        app = create_app(data_dir, dataclasses.replace(settings, admin_url=local_url(host, port)))
        config = uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level=log_level,
            lifespan="on",
            server_header=False,
            # httptools, bounded in head size and header count (see header_limited_protocol); the h11
            # fallback bounds the head by h11's own limit.
            http=_http_protocol(settings),
            h11_max_incomplete_event_size=settings.max_header_bytes,
            # A client stuck mid-download must not keep a stopping server up for long.
            timeout_graceful_shutdown=10,
        )
        server = uvicorn.Server(config)
        server.run(sockets=[sock])
        started = bool(server.started)
        return started
    finally:
        sock.close()
        if undo is not None and not started:
            # A start that failed leaves no new registry behind (no key, no database).
            undo()
        registry_logger.removeHandler(handler)
        registry_logger.propagate = True
