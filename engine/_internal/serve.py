"""``kvgraft engine serve``: the engine's OpenAI-compatible server under uvicorn (docs/engine-serve.md).

``serve_engine`` checks what it can cheaply (the port, each library's model and profile), then
runs the app of ``serve_app.py`` under uvicorn until SIGINT/SIGTERM. The app's lifespan loads
the model and opens the libraries (verifying each one's prefix); a failure there is reported
as the one-line error it is, never as a traceback. Importing this module imports neither
litestar nor uvicorn: they are loaded when the server starts, so the engine works without them.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from .errors import EngineServerConfigError, LibraryError
from .library import read_meta, require_library_match
from .trust import Trust

if TYPE_CHECKING:
    from litestar import Litestar

#: Requests that may wait for the model worker besides the one it is answering.
DEFAULT_MAX_QUEUE = 16
#: Seconds a request may take, queue wait included, before it is answered 504 and its decoding stops.
DEFAULT_REQUEST_TIMEOUT = 120.0
#: The largest request body read (a chat request is a few kilobytes).
DEFAULT_MAX_BODY_BYTES = 1 << 20
#: ``max_tokens`` when a request gives none (a recall still stops after 16).
DEFAULT_MAX_TOKENS = 256
#: Request heads (request line and headers) past this many bytes are refused by the HTTP parser.
MAX_HEADER_BYTES = 32 * 1024
#: The sum of ``max_tokens`` one client's requests may hold at once (running and waiting): one
#: request of the largest budget (``MAX_TOKENS_LIMIT``).
DEFAULT_MAX_CLIENT_TOKENS = 1 << 16
#: The log every part of the server writes to.
LOGGER = "kvgraft.engine.serve"


@dataclass(frozen=True)
class ServeSettings:
    """The server's limits. ``max_queue``: requests waiting for the one model worker (0: none
    wait; a request finding the queue full is answered 429). ``request_timeout``: seconds from a
    request's arrival to its last token (504, or a failed stream, past it). ``max_body_bytes``:
    the largest request body (413 past it). ``default_max_tokens``: the budget of a request
    giving no ``max_tokens``.

    Per-client fairness (issue 37): one client (its remote address) may hold at most
    ``max_client_requests`` requests at once, running or waiting (None: half the server's
    places, ``(max_queue + 1) // 2``, at least 1), and at most ``max_client_tokens`` of
    ``max_tokens`` summed over them; past either it is answered 429 ``client_quota`` while the
    other places stay free for everyone else. The key is the address, not a bearer token: the
    server checks no tokens, so a token would be an identity any client could make up anew."""

    max_queue: int = DEFAULT_MAX_QUEUE
    request_timeout: float = DEFAULT_REQUEST_TIMEOUT
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    default_max_tokens: int = DEFAULT_MAX_TOKENS
    max_client_requests: int | None = None
    max_client_tokens: int = DEFAULT_MAX_CLIENT_TOKENS

    @property
    def client_requests(self) -> int:
        """The requests one client may hold at once (``max_client_requests``, or half the places)."""
        if self.max_client_requests is not None:
            return self.max_client_requests
        return max(1, (self.max_queue + 1) // 2)

    def check(self) -> None:
        """Refuse limits that cannot work (``EngineServerConfigError``)."""
        if not 0 <= self.max_queue <= 1 << 20:
            raise EngineServerConfigError(f"--max-queue {self.max_queue} is not between 0 and {1 << 20}",
                                          hint="pass --max-queue 16, or another small number")
        if not 0 < self.request_timeout <= 24 * 3600:
            raise EngineServerConfigError(f"--request-timeout {self.request_timeout} is not between 0 and a day (in seconds)",
                                          hint="pass --request-timeout 120")
        if not 1024 <= self.max_body_bytes <= 1 << 30:
            raise EngineServerConfigError(f"--max-body-bytes {self.max_body_bytes} is not between 1 KiB and 1 GiB",
                                          hint="pass --max-body-bytes 1048576")
        if self.default_max_tokens < 1:
            raise EngineServerConfigError("the default max_tokens must be at least 1")
        if self.max_client_requests is not None and not 1 <= self.max_client_requests <= self.max_queue + 1:
            raise EngineServerConfigError(
                f"a client's share of {self.max_client_requests} requests is not between 1 and the server's "
                f"{self.max_queue + 1} places (--max-queue {self.max_queue} waiting, one running)",
                hint="leave it out: a client may hold half the places")
        if not 1 <= self.max_client_tokens <= 1 << 30:
            raise EngineServerConfigError(f"a client's share of {self.max_client_tokens} tokens is not between 1 and {1 << 30}",
                                          hint=f"leave it out: {DEFAULT_MAX_CLIENT_TOKENS}")


@dataclass(frozen=True)
class ServeConfig:
    """What the server serves: ``model`` (a ``kvgraft models list`` name) under ``profile``, the
    ``libraries`` (each for that model and profile, in lookup order), the ``trust`` every grafted
    artifact is verified against (required when there are libraries; ``Trust.skipped()`` is the
    loud opt-out), and the limits."""

    model: str
    profile: str
    libraries: tuple[Path, ...]
    trust: Trust | None
    settings: ServeSettings


def check_config(config: ServeConfig) -> None:
    """What can be checked before any model is loaded: the limits, that the libraries are
    libraries of ``config.model`` under ``config.profile``, named once each, and trusted."""
    config.settings.check()
    seen: set[Path] = set()
    for directory in config.libraries:
        resolved = directory.resolve()
        if resolved in seen:
            raise EngineServerConfigError(f"--library {directory} is given twice", hint="name each library once")
        seen.add(resolved)
        try:
            require_library_match(directory, read_meta(directory), model=config.model, profile=config.profile)
        except LibraryError as e:
            raise EngineServerConfigError(e.message, hint=f"{e.hint}, or leave --library {directory} out") from e
    if config.libraries and config.trust is None:
        raise EngineServerConfigError("libraries are served only with keys to verify their artifacts against",
                                      hint="pass --trusted-keys FILE (or --trust-local-key); --insecure-skip-verify skips the check")


def create_engine_app(config: ServeConfig) -> Litestar:
    """The Litestar app serving ``config`` (see ``serve_app.create_app``)."""
    from .serve_app import create_app

    return create_app(config)


def serve_engine(config: ServeConfig, *, host: str, port: int, log_level: str = "info") -> bool:
    """Serve ``config`` on ``host:port`` until interrupted (SIGINT/SIGTERM); False when it
    stopped without starting. A failure while loading (the model, a library that does not
    verify) is raised after uvicorn has stopped, as the ``KvgraftError`` it was."""
    import uvicorn

    from .serve_app import StartupEdge, StartupFailure, create_app

    if not 1 <= port <= 65535:
        raise EngineServerConfigError(f"port {port} is not between 1 and 65535", hint="pass --port 8000, or another free port")
    check_config(config)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s:     %(name)s: %(message)s"))
    logger = logging.getLogger(LOGGER)
    logger.addHandler(handler)
    logger.setLevel(log_level.upper())
    logger.propagate = False
    failure = StartupFailure()
    try:
        app = StartupEdge(create_app(config, failure=failure), failure)
        server = uvicorn.Server(uvicorn.Config(
            app, host=host, port=port, log_level=log_level, lifespan="on", server_header=False,
            # h11 bounds the request head (httptools does not); the model, not the parser, is the bottleneck.
            http="h11", h11_max_incomplete_event_size=MAX_HEADER_BYTES,
            # A stopping server cancels the decoding still running (its clients see the stream end).
            timeout_graceful_shutdown=5,
        ))
        try:
            server.run()
        except SystemExit as e:
            # uvicorn exits (status 3) when the lifespan fails or the port cannot be bound.
            if failure.error is not None:
                raise failure.error from e
            return False
        if failure.error is not None:
            raise failure.error
        return bool(server.started)
    finally:
        logger.removeHandler(handler)
        logger.propagate = True

