"""The client ``kvgraft ask --engine URL`` asks a running ``kvgraft engine serve`` with.

One ``httpx.Client`` per ``EngineClient`` (a context manager). Nothing the server sends is
trusted with memory or time: every answer is read up to ``max_response_bytes`` and every request
has one total deadline (``timeout``, connecting and reading together); each body is parsed with
the wire models the server answers with (``kvgraft.schemas``' engine wire), strictly. Every
failure is one ``CliError`` line: the server is down, too slow, answered an error (its OpenAI
error message, which says what to fix), or sent something that is not an engine server's answer.
Needs httpx, not the engine: asking a server loads no model and imports no torch.
"""

from __future__ import annotations

import time
from types import TracebackType
from typing import Any, TypeVar

import httpx
from pydantic import BaseModel, ValidationError

from kvgraft.schemas import ChatCompletion, ChatCompletionRequest, ChatMessage, ErrorBody, ModelList

from ._common import CliError

#: An answer is a few kilobytes (one question's text and its provenance).
MAX_RESPONSE_BYTES = 4 << 20
#: Seconds a whole request may take: above the server's own default request timeout (120 s).
DEFAULT_TIMEOUT = 180.0

_Model = TypeVar("_Model", bound=BaseModel)

_START = "start one with 'kvgraft engine serve --model NAME --library DIR --trusted-keys FILE', or check --engine"


class EngineClient:
    """A running engine server at ``url`` (``http://host:port``); use it in a ``with`` block."""

    def __init__(self, url: str, *, timeout: float = DEFAULT_TIMEOUT, max_response_bytes: int = MAX_RESPONSE_BYTES) -> None:
        if not url.startswith(("http://", "https://")):
            raise CliError(f"--engine {url[:200]!r} is not an http:// or https:// URL", hint="pass --engine http://127.0.0.1:8000")
        if not 0 < timeout <= 24 * 3600:
            raise CliError(f"--timeout {timeout} is not between 0 and a day (in seconds)", hint="pass --timeout 180")
        self.url = url.rstrip("/")
        self.timeout = timeout
        self.max_response_bytes = max_response_bytes
        self._http = httpx.Client(base_url=self.url, timeout=httpx.Timeout(timeout, connect=min(timeout, 10.0)),
                                  follow_redirects=False, headers={"User-Agent": "kvgraft-ask"})

    def __enter__(self) -> EngineClient:
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        """Close the connection pool."""
        self._http.close()

    def models(self) -> ModelList:
        """``GET /v1/models``."""
        return self._call("GET", "/v1/models", ModelList)

    def chat(self, request: ChatCompletionRequest) -> ChatCompletion:
        """``POST /v1/chat/completions`` (not streamed)."""
        return self._call("POST", "/v1/chat/completions", ChatCompletion,
                          body=request.model_dump(mode="json", exclude_none=True))

    def ask(self, question: str, *, model: str | None = None, max_tokens: int | None = None) -> ChatCompletion:
        """The server's answer to ``question`` (one user message), from ``model`` (default: the one
        model the server serves)."""
        if model is None:
            served = [card.id for card in self.models().data]
            if len(served) != 1:
                raise CliError(f"the engine server at {self.url} serves {len(served)} models ({', '.join(served[:8])})",
                               hint="pass --model NAME, one of them")
            model = served[0]
        try:
            request = ChatCompletionRequest(model=model, messages=[ChatMessage(role="user", content=question)],
                                            max_tokens=max_tokens)
        except ValidationError as e:
            raise CliError(f"the question cannot be sent: {e.errors()[0]['msg']}",
                           hint="ask a shorter question, with --max-new-tokens between 1 and 65536") from e
        return self.chat(request)

    # --- one request -----------------------------------------------------------------------------

    def _call(self, method: str, path: str, model: type[_Model], *, body: dict[str, Any] | None = None) -> _Model:
        status, data = self._request(method, path, body)
        if status >= 400:
            raise self._error(path, status, data)
        try:
            return model.model_validate_json(data)
        except ValidationError as e:
            first = e.errors(include_url=False)[0]
            where = ".".join(str(p) for p in first["loc"]) or "the body"
            raise CliError(f"{self.url}{path} sent an answer that is not an engine server's: {where}: {first['msg']}",
                           hint="is --engine the URL of a 'kvgraft engine serve'?") from e

    def _request(self, method: str, path: str, body: dict[str, Any] | None) -> tuple[int, bytes]:
        deadline = time.monotonic() + self.timeout
        try:
            with self._http.stream(method, path, json=body) as response:
                length = response.headers.get("content-length", "")
                if length.isascii() and length.isdigit() and int(length) > self.max_response_bytes:
                    raise CliError(f"{self.url}{path} announced {int(length)} bytes, more than the limit of {self.max_response_bytes}",
                                   hint="is --engine the URL of a 'kvgraft engine serve'?")
                chunks: list[bytes] = []
                size = 0
                for chunk in response.iter_bytes():
                    size += len(chunk)
                    if size > self.max_response_bytes:
                        raise CliError(f"{self.url}{path} sent more than {self.max_response_bytes} bytes; the rest was not read",
                                       hint="is --engine the URL of a 'kvgraft engine serve'?")
                    if time.monotonic() > deadline:
                        raise httpx.ReadTimeout("the request's total deadline passed")
                    chunks.append(chunk)
                return response.status_code, b"".join(chunks)
        except httpx.ConnectError as e:
            raise CliError(f"cannot reach the engine server at {self.url}: {e}", hint=_START) from e
        except httpx.TimeoutException as e:
            raise CliError(f"the engine server at {self.url} did not answer {method} {path} within {self.timeout:g} s",
                           hint="raise --timeout, or ask for fewer tokens with --max-new-tokens") from e
        except httpx.HTTPError as e:
            raise CliError(f"{method} {self.url}{path} failed: {type(e).__name__}: {e}", hint=_START) from e

    def _error(self, path: str, status: int, data: bytes) -> CliError:
        try:
            message = ErrorBody.model_validate_json(data).error.message
        except ValidationError:
            message = f"(not an OpenAI error body) {data[:200].decode('utf-8', 'replace')}"
        if status == 429:
            hint = "the server's queue is full; retry in a few seconds"
        elif status == 504:
            hint = "the server took too long; ask for fewer tokens with --max-new-tokens, or retry"
        elif status >= 500:
            hint = "the server's operator can see what failed in its log"
        else:
            hint = "change the request as the server's message says"
        return CliError(f"the engine server at {self.url} answered {path} with {status}: {message}", hint=hint)
