"""The engine server's Litestar app: the OpenAI-compatible routes, the one model worker and its
bounded queue, and OpenAI-style error bodies (docs/engine-serve.md).

How a request is answered:

1. the handler reads the body (at most ``max_body_bytes``), parses it into the shared wire model
   (``kvgraft.schemas``' engine wire) and checks what kvgraft serves (the model id; no tools,
   response formats or log probabilities; several choices only unstreamed) and how it samples
   (greedy unless a temperature; a seed drawn when none is sent); every refusal is an
   ``EngineServerError``, whose class fixes the HTTP status;
2. it admits a ``_Job`` to the queue: a memory stream holding at most ``max_queue`` jobs while the
   worker answers one, so a full queue is a 429 at once, never a wait; one client (its address)
   holds at most its share of the places and tokens (``ServeSettings``), also a 429;
3. the one worker task (started in the lifespan) takes jobs in order and runs each in a thread
   (``anyio.to_thread``), one at a time, so torch forward passes never overlap: the library lookup
   across every library (``lookup_all``), then ``Library.answer`` (or ``ask_model`` without a
   library), whose decode loop is the engine's one (``greedy_decode``);
4. the decode loop calls the job's ``on_token`` after every token with the answer's text so far:
   it ends decoding when a stop string appears, the request's deadline passes, the client hung up
   or the server is stopping, and (streaming) hands the new text to the event stream;
5. the handler answers the job's result, or its error, waiting at most until the deadline and
   watching for the client hanging up; a stream is started only once its first token is decoded,
   so a refusal before that (a bad artifact, a question too long) still has its own status.

Nothing a request sends reaches a traceback: the body's faults are 4xx with what to fix, and an
unexpected failure is a plain 500 whose details go to the server log only.
"""

from __future__ import annotations

import contextlib
import logging
import math
import re
import secrets
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import anyio
import anyio.from_thread
import anyio.to_thread
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
from litestar import Litestar, Request, Response, get, post
from litestar.background_tasks import BackgroundTask
from litestar.exceptions import HTTPException, MethodNotAllowedException, NotFoundException
from litestar.response import Stream
from litestar.types import ASGIApp, Message, Receive, Scope, Send
from pydantic import BaseModel

from kvgraft.schemas import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatDelta,
    Completion,
    CompletionChoice,
    CompletionRequest,
    DeterminismProfile,
    ErrorBody,
    ErrorDetail,
    FinishReason,
    KvgraftError,
    ModelCard,
    ModelList,
    Usage,
)

from .errors import (
    ArtifactRefusedError,
    ClientClosedRequestError,
    ContextWindowError,
    EngineServerError,
    InputTextError,
    InvalidRequestError,
    MethodNotServedError,
    ModelNotServedError,
    PromptTooLongError,
    QueueFullError,
    RequestTimeoutError,
    RouteNotFoundError,
    ServerStoppingError,
)
from .library import Answer, Library, answer_kind, grafted_hit, lookup_all
from .llamacpp import LlamaCppModel
from .ops import GREEDY, AnyModel, Sampling, load_model_for
from .profiles import current_profile
from .serve import LOGGER, ServeConfig
from .serve_requests import chat_question, check_request, parse_request, question_of, read_body, sampling_of
from .unassisted import Question, ask_model, ask_model_stream

logger = logging.getLogger(LOGGER)

#: Where the server says how it is (not part of OpenAI's API; for readiness probes and operators).
HEALTH_PATH = "/health"


@dataclass
class StartupFailure:
    """Where the lifespan leaves the ``KvgraftError`` that kept the server from starting, so that
    ``serve_engine`` raises it (one line) after uvicorn stops, instead of uvicorn logging a traceback."""

    error: KvgraftError | None = None


# --- what is served ------------------------------------------------------------------------------


@dataclass
class _Served:
    """The lifespan's state: the loaded model, its libraries, the queue into the worker."""

    config: ServeConfig
    model: AnyModel
    profile: DeterminismProfile
    libraries: list[Library]
    #: Unix time the model was loaded (``created`` of its ``/v1/models`` card).
    created: int
    queue: MemoryObjectSendStream[_Job] | None = None
    #: Set when the server stops: every decoding still running ends at its next token.
    stopping: bool = False
    running: bool = False
    #: Each client's (remote address's) requests held now, running or waiting: [requests, max_tokens summed].
    clients: dict[str, list[int]] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.config.model

    def admit(self, job: _Job, client: str) -> None:
        """Put ``job`` in the queue for ``client`` (its remote address), or refuse it
        (``QueueFullError``): ``client_quota`` when the client already holds its share of the
        server (``ServeSettings.client_requests`` requests, ``max_client_tokens`` tokens),
        ``queue_full`` when every place is taken. The share is given back when the job finishes
        (run, skipped or cancelled), however its client left."""
        if self.queue is None or self.stopping:
            raise ServerStoppingError("the server is stopping and takes no new requests")
        settings = self.config.settings
        held = self.clients.setdefault(client, [0, 0])
        if held[0] >= settings.client_requests or held[1] + job.cost > settings.max_client_tokens:
            if held[0] == 0:
                del self.clients[client]
            raise QueueFullError(
                f"this client ({client[:64]}) already holds {held[0]} requests of {held[1]} max_tokens, running or waiting; "
                f"one client's share of this server is {settings.client_requests} requests and {settings.max_client_tokens} "
                "tokens, so that the other places stay free for others",
                hint="wait for an answer before sending more, or ask for fewer max_tokens", code="client_quota",
            )
        try:
            self.queue.send_nowait(job)
        except anyio.WouldBlock as e:
            if held[0] == 0:
                del self.clients[client]
            limit = settings.max_queue
            raise QueueFullError(
                f"the server is answering one request and {limit} more are waiting, its limit (--max-queue {limit})"
            ) from e
        held[0] += 1
        held[1] += job.cost

        def release() -> None:
            held[0] -= 1
            held[1] -= job.cost
            if held[0] == 0 and self.clients.get(client) is held:
                del self.clients[client]

        job.on_finish = release


def _stops(stop: str | list[str] | None) -> tuple[str, ...]:
    """The request's stop strings: a single one is a tuple of one, none an empty tuple."""
    if stop is None:
        return ()
    return (stop,) if isinstance(stop, str) else tuple(stop)


def _held_back(text: str, stops: tuple[str, ...]) -> str:
    """``text`` less what may not be streamed yet: a trailing partial character (the tokenizer
    decodes an incomplete UTF-8 sequence as U+FFFD) and a tail that may be the start of a stop
    string (a stop string is never sent, not even in part)."""
    text = text.rstrip("\ufffd")
    for n in range(min(len(text), max((len(s) for s in stops), default=1) - 1), 0, -1):
        if any(s.startswith(text[-n:]) for s in stops):
            return text[:-n]
    return text


class _Job:
    """One request for the model worker: its question, budget, stop strings and deadline; what
    the worker found (entry, method), what it answered or why it failed, and (streaming) the text
    deltas as they are decoded.

    ``cancel``, ``finish`` and the events belong to the event loop; ``run`` and ``on_token`` run in
    the worker's thread, which talks to the loop only through ``anyio.from_thread``.
    """

    def __init__(self, question: str, *, param: str, max_tokens: int, stops: tuple[str, ...], stream: bool,
                 timeout: float, sampling: Sampling = GREEDY, n: int = 1) -> None:
        self.question = question
        #: The request field the question came from (named by a refusal of the question).
        self.param = param
        self.max_tokens = max_tokens
        #: How tokens are chosen (greedy unless the request sampled), and how many choices: choice
        #: ``i`` is decoded with ``sampling.offset(i)``.
        self.sampling = sampling
        self.n = n
        #: What a client's share counts for this job: every choice may decode ``max_tokens``.
        self.cost = max_tokens * n
        self.stops = stops
        self.stream = stream
        self.deadline = time.monotonic() + timeout
        self.timeout = timeout
        self.cancelled = False
        self.timed_out = False
        #: Set (on the loop) when the worker starts running this job.
        self.running = False
        self.started = anyio.Event()
        self.done = anyio.Event()
        self.answer: Answer | None = None
        #: Every choice's answer (``answer`` is the first).
        self.answers: list[Answer] = []
        self.error: EngineServerError | None = None
        self.method = "none"
        self.entry: str | None = None
        #: What the answer is (``AnswerKind``), known once the lookup ran, before decoding.
        self.kind = "unassisted"
        #: The text streamed so far (written by the worker's thread, read once it is done).
        self.sent = ""
        self._first_token = True
        self._served: _Served | None = None
        #: Called once when the worker is done with this job or it is cancelled (``_Served.admit``
        #: gives the client's share back).
        self.on_finish: Callable[[], None] | None = None
        send, receive = anyio.create_memory_object_stream[str](max_buffer_size=math.inf)
        self._deltas_send: MemoryObjectSendStream[str] = send
        self.deltas: MemoryObjectReceiveStream[str] = receive

    def remaining(self) -> float:
        """Seconds until the deadline (0 once it passed)."""
        return max(self.deadline - time.monotonic(), 0.0)

    def cancel(self) -> None:
        """Stop this job: skipped when still queued, its decoding ended at the next token when
        running. A running job gives its client's share back now: the client has its answer (a
        timeout, a hang-up), and what is left of it ends within a token. A queued one keeps it
        until the worker skips it: requests sent and given up at once still count against their
        client's share, never against everyone's queue."""
        self.cancelled = True
        if self.running:
            self.release()

    def release(self) -> None:
        """Give the job's client its share back (``_Served.admit``), once."""
        if self.on_finish is not None:
            release, self.on_finish = self.on_finish, None
            release()

    def cut(self, text: str) -> tuple[str, bool]:
        """``text`` up to the first stop string (cut off, as OpenAI does) and whether one occurs."""
        found = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        return (text[:min(found)], True) if found else (text, False)

    def timeout_error(self) -> RequestTimeoutError:
        return RequestTimeoutError(f"the answer was not ready within the server's request timeout of {self.timeout:g} s; "
                                   "its decoding was stopped")

    # --- in the worker's thread ---------------------------------------------------------------------

    def on_token(self, text: str) -> bool:
        """The decode loop's extra stop rule, called after every token with the answer's text so
        far: true ends decoding (a stop string, the deadline, the client gone, the server stopping)."""
        if self.stream and self._first_token:
            self._first_token = False
            self._to_loop(self.started.set)
        if self.cancelled or (self._served is not None and self._served.stopping):
            return True
        if time.monotonic() >= self.deadline:
            self.timed_out = True
            return True
        visible, hit = self.cut(text)
        # A recall's text is its verified answer box, sent whole at the end: what the model
        # restates on the way is never streamed as if it were the verified answer.
        if self.stream and self.kind != "recalled":
            ready = visible if hit else _held_back(visible, self.stops)
            if len(ready) > len(self.sent) and ready.startswith(self.sent):
                delta, self.sent = ready[len(self.sent):], ready
                self._to_loop(lambda: self._deltas_send.send_nowait(delta))
        return hit

    def _to_loop(self, call: Any) -> None:
        try:
            anyio.from_thread.run_sync(call)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, RuntimeError):
            # The stream's reader is gone (the client hung up) or the loop is stopping.
            self.cancelled = True

    def run(self, served: _Served) -> None:
        """Answer the question (in the worker's thread): the best entry across the libraries, or
        the model alone without any; every failure is kept as the ``EngineServerError`` to answer."""
        self._served = served
        try:
            if served.libraries:
                found = lookup_all(served.libraries, self.question)
                library, hit = found if found is not None else (served.libraries[0], None)
                grafted = grafted_hit(hit, library.graft_threshold)
                self.kind = answer_kind(grafted)
                if grafted is not None:
                    self.method, self.entry = grafted.method, grafted.entry.artifact
                lib: Library = library

                def one(sampling: Sampling) -> Answer:
                    return lib.answer(self.question, hit, max_new_tokens=self.max_tokens, stop=self.on_token, sampling=sampling)
            else:

                def one(sampling: Sampling) -> Answer:
                    return ask_model(served.model, served.profile, self.question, max_new_tokens=self.max_tokens,
                                     stop=self.on_token, sampling=sampling)
            for i in range(self.n):
                if self.answers and (self.sampling.greedy or self.kind == "recalled"):
                    # Greedy decoding (and a recall) has one answer: every choice is the same.
                    self.answers.append(self.answers[0])
                    continue
                self.answers.append(one(self.sampling.offset(i)))
                if self.cancelled or self.timed_out:
                    break
            self.answer = self.answers[0]
        except InputTextError as e:
            self.refuse(e)
        except KvgraftError as e:
            # Everything else the library raises is about its files: an artifact that does not verify
            # (signature, digest, lineage, the signed text) or an index that was altered. Never grafted.
            logger.error("request refused: %s", e)
            self.error = _caused(ArtifactRefusedError(f"the library entry this question needs was refused, not grafted: "
                                                      f"{_scrub(e.message)}"), e)
        except Exception as e:
            logger.error("the model worker failed", exc_info=e)
            self.error = _caused(EngineServerError("the model worker failed to answer this request"), e)

    def as_question(self) -> Question:
        """This job's question as the decoder takes it: its budget, its stop rule, its sampling."""
        return Question(self.question, max_new_tokens=self.max_tokens, stop=self.on_token, sampling=self.sampling)

    def refuse(self, e: InputTextError) -> None:
        """Keep the refusal of this job's question as the 400 to answer: past the window, or else invalid."""
        error = PromptTooLongError if isinstance(e, ContextWindowError) else InvalidRequestError
        self.error = _caused(error(e.message, hint=e.hint, param=self.param), e)

    # --- on the event loop --------------------------------------------------------------------------

    def finish(self) -> None:
        """The worker is done with this job (run or skipped): close its deltas, wake its handler,
        give its client's share back."""
        self.release()
        self._deltas_send.close()
        self.started.set()
        self.done.set()


_E = TypeVar("_E", bound=BaseException)


def _caused(error: _E, cause: BaseException) -> _E:
    error.__cause__ = cause
    return error


#: An absolute path in a message: the server's files are nobody else's business (the log has them).
_ABSOLUTE_PATH = re.compile(r"(?<![\w:/.~-])/(?:[\w.@+~-]+/)+[\w.@+~-]*")


def _scrub(text: str) -> str:
    return _ABSOLUTE_PATH.sub("<path>", text)


async def _worker(served: _Served, jobs: MemoryObjectReceiveStream[_Job]) -> None:
    """The one model worker: each job in order, in a thread, one at a time (see the module
    docstring); on llama.cpp without a library, base answers are decoded together with
    continuous batching (``_run_together``: jobs join the llama.cpp batch as rows free up, and
    each is answered as soon as its own decode ends)."""
    together = isinstance(served.model, LlamaCppModel) and not served.libraries
    async with jobs:
        async for first in jobs:
            if together and first.n == 1:
                await anyio.to_thread.run_sync(_run_together, first, jobs, served)
                continue
            try:
                if first.cancelled or served.stopping:
                    continue
                if first.remaining() <= 0:
                    first.error = first.timeout_error()
                    continue
                served.running = True
                first.running = True
                # Not abandoned on cancellation: the thread ends at its next token (on_token sees
                # stopping), and the next job never starts while a forward pass still runs.
                await anyio.to_thread.run_sync(first.run, served)
            finally:
                served.running = False
                first.finish()


def _live(job: _Job, served: _Served) -> bool:
    """Whether a job taken from the queue is still to be run (on the loop); a dead one is finished
    here: skipped when cancelled or the server stops, a timeout when its deadline passed."""
    if job.cancelled or served.stopping:
        job.finish()
        return False
    if job.remaining() <= 0:
        job.error = job.timeout_error()
        job.finish()
        return False
    job.running = True
    served.running = True
    return True


def _run_together(first: _Job, jobs: MemoryObjectReceiveStream[_Job], served: _Served) -> None:
    """Base answers (no library) decoded together, in the worker's thread (``ask_model_stream``):
    ``first``, then whatever waits in the queue whenever a row is free, up to the context's
    sequences. Each job is finished on the loop as soon as its answer (or refusal) is ready. A
    job that asks for several choices waits for the rows to drain and runs alone (``_Job.run``)."""
    limit = served.model.settings.n_seq_max if isinstance(served.model, LlamaCppModel) else 1
    held: list[_Job] = []  # a job with several choices, taken from the queue: it runs after the rest
    inflight: list[_Job] = []  # every job handed to the decoder, answered or not

    def take(free: int) -> list[tuple[_Job, Question]]:
        def on_loop() -> list[_Job]:
            got: list[_Job] = []
            while len(got) < free and not held:
                try:
                    job = jobs.receive_nowait()
                except (anyio.WouldBlock, anyio.EndOfStream, anyio.ClosedResourceError):
                    break
                if job.n != 1:
                    held.append(job)
                elif _live(job, served):
                    got.append(job)
            return got

        taken = anyio.from_thread.run_sync(on_loop) if not served.stopping else []
        for job in taken:
            job._served = served  # what on_token reads to stop when the server stops
            inflight.append(job)
        return [(job, job.as_question()) for job in taken]

    def answered(job: _Job, answer: Answer) -> None:
        job.answers = [answer]
        job.answer = answer
        anyio.from_thread.run_sync(job.finish)

    def refused(job: _Job, e: InputTextError) -> None:
        job.refuse(e)
        anyio.from_thread.run_sync(job.finish)

    started = [False]

    def first_then_queue(free: int) -> list[tuple[_Job, Question]]:
        if not started[0]:
            started[0] = True
            if not anyio.from_thread.run_sync(_live, first, served):
                return take(free)
            first._served = served
            inflight.append(first)
            return [(first, first.as_question()), *take(free - 1)]
        return take(free)

    try:
        ask_model_stream(served.model, served.profile, first_then_queue, on_answer=answered, on_refused=refused, batch=limit)
    except Exception as e:
        logger.error("the model worker failed", exc_info=e)
        # Every job still running gets the failure; finish is idempotent for those already answered.
        error = _caused(EngineServerError("the model worker failed to answer this request"), e)

        def fail_all() -> None:
            for job in inflight:
                if job.answer is None and job.error is None:
                    job.error = error
                job.finish()

        anyio.from_thread.run_sync(fail_all)
    for job in held:
        try:
            if anyio.from_thread.run_sync(_live, job, served):
                job.run(served)
        finally:
            anyio.from_thread.run_sync(job.finish)
    anyio.from_thread.run_sync(lambda: setattr(served, "running", False))


# --- requests ------------------------------------------------------------------------------------

_Model = TypeVar("_Model", bound=BaseModel)


def _served(request: Request[Any, Any, Any]) -> _Served:
    served: _Served = request.app.state.served
    return served


async def _wait(request: Request[Any, Any, Any], job: _Job, event: anyio.Event) -> None:
    """Until ``event``, the deadline, or the client hanging up (each of the last two cancels the job)."""
    gone = False
    async with anyio.create_task_group() as tg:

        async def watch() -> None:
            nonlocal gone
            while True:
                message = await request.receive()
                if message["type"] == "http.disconnect":
                    gone = True
                    job.cancel()
                    tg.cancel_scope.cancel()
                    return

        tg.start_soon(watch)
        with anyio.move_on_after(job.remaining()):
            await event.wait()
        tg.cancel_scope.cancel()
    if gone:
        raise ClientClosedRequestError("the client hung up before its answer was ready")
    if not event.is_set():
        job.cancel()
        raise job.timeout_error()


def _result(job: _Job) -> Answer:
    """The answer of a finished job, or (raised) the ``EngineServerError`` it is answered with."""
    if job.error is not None:
        raise job.error
    if job.timed_out:
        raise job.timeout_error()
    if job.answer is None:
        # Skipped: the server is stopping (a job cancelled by its own client has nobody to answer).
        raise ServerStoppingError("the server stopped before answering this request")
    return job.answer


def _finish_reason(job: _Job, answer: Answer) -> FinishReason:
    # A recall's text is the whole verified answer, however many tokens the model's restating took.
    if job.cut(answer.text)[1] or answer.stopped_by in ("eos", "stop") or answer.kind == "recalled":
        return "stop"
    return "length"


def _usage(answers: list[Answer]) -> Usage:
    """OpenAI's usage of ``answers`` (every choice's): the prompt counted once, the decoded tokens summed."""
    prompt, completion = answers[0].prompt_tokens, sum(a.decode_tokens for a in answers)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def _json(model: BaseModel, *, status: int = 200, headers: dict[str, str] | None = None) -> Response[bytes]:
    return Response(content=model.model_dump_json().encode("utf-8"), status_code=status,
                    media_type="application/json", headers=headers or {})


def _event(model: BaseModel | None) -> bytes:
    """One server-sent event: ``data: <json>``, or ``data: [DONE]`` for None."""
    return b"data: " + (model.model_dump_json().encode("utf-8") if model is not None else b"[DONE]") + b"\n\n"


def _error_body(error: EngineServerError) -> ErrorBody:
    return ErrorBody(error=ErrorDetail(message=str(error), type=error.error_type, param=error.param, code=error.code))


def _provenance_headers(job: _Job) -> dict[str, str]:
    return {"X-Kvgraft-Kind": job.kind, "X-Kvgraft-Method": job.method, "X-Kvgraft-Entry": job.entry or "none"}


def _client(request: Request[Any, Any, Any]) -> str:
    """The key a client's share is kept under: its remote address (``ServeSettings``)."""
    return request.client.host if request.client is not None else "unknown"


async def _answer(request: Request[Any, Any, Any], question: tuple[str, str], req: ChatCompletionRequest | CompletionRequest,
                  max_tokens: int | None, *, chat: bool) -> Response[Any]:
    """Queue the question, then answer it whole or as an event stream (see the module docstring)."""
    served = _served(request)
    settings = served.config.settings
    job = _Job(question[0], param=question[1], max_tokens=max_tokens or settings.default_max_tokens, stops=_stops(req.stop),
               stream=bool(req.stream), timeout=settings.request_timeout, sampling=sampling_of(req), n=req.n or 1)
    served.admit(job, _client(request))
    ident = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
    created = int(time.time())
    if not job.stream:
        await _wait(request, job, job.done)
        answer = _result(job)
        answers = job.answers
        # With several choices each carries its own provenance (its seed, its answer); the top-level is the first's.
        each: list[dict[str, Any]] = [{"kvgraft": a.provenance()} if len(answers) > 1 else {} for a in answers]
        body: BaseModel
        if chat:
            body = ChatCompletion(id=ident, created=created, model=served.name, usage=_usage(answers), kvgraft=answer.provenance(),
                                  choices=[ChatChoice.model_validate({
                                      "index": i, "message": AssistantMessage(content=job.cut(a.text)[0]),
                                      "finish_reason": _finish_reason(job, a), **each[i]}) for i, a in enumerate(answers)])
        else:
            body = Completion(id=ident, created=created, model=served.name, usage=_usage(answers), kvgraft=answer.provenance(),
                              choices=[CompletionChoice.model_validate({
                                  "index": i, "text": job.cut(a.text)[0], "finish_reason": _finish_reason(job, a), **each[i]})
                                  for i, a in enumerate(answers)])
        return _json(body, headers=_provenance_headers(job))
    # A stream starts once its first token is decoded: what fails before that has its own status.
    await _wait(request, job, job.started)
    if job.done.is_set():
        _result(job)
    include_usage = bool(req.stream_options and req.stream_options.include_usage)

    def chunk(text: str | None, *, first: bool = False, answer: Answer | None = None, usage: bool = False) -> BaseModel:
        finish: FinishReason | None = _finish_reason(job, answer) if answer is not None and not usage else None
        provenance = answer.provenance() if answer is not None else None
        counted = _usage([answer]) if answer is not None and usage else None
        if chat:
            choices = [] if usage else [ChatChunkChoice(
                delta=ChatDelta(role="assistant" if first else None, content=text), finish_reason=finish)]
            return ChatCompletionChunk(id=ident, created=created, model=served.name, choices=choices, usage=counted,
                                       kvgraft=provenance)
        return Completion(id=ident, created=created, model=served.name, usage=counted, kvgraft=provenance,
                          choices=[] if usage else [CompletionChoice(text=text or "", finish_reason=finish)])

    async def events() -> AsyncIterator[bytes]:
        try:
            if chat:
                yield _event(chunk("", first=True))
            while True:
                try:
                    # The deadline bounds each wait, never a yield (a cancel scope must not span one).
                    with anyio.fail_after(job.remaining() + 1.0):
                        delta = await job.deltas.receive()
                except anyio.EndOfStream:
                    break
                except TimeoutError:
                    job.cancel()
                    yield _event(_error_body(job.timeout_error()))
                    return
                yield _event(chunk(delta))
            try:
                answer = _result(job)
            except EngineServerError as e:
                # The answer has begun (status 200): the failure is the stream's last event.
                logger.warning("stream %s ended early: %s", ident, e)
                yield _event(_error_body(e))
                return
            content = job.cut(answer.text)[0]
            # What was held back (a partial stop string that never completed, the last characters).
            rest = content[len(job.sent):] if content.startswith(job.sent) else ""
            yield _event(chunk(rest, answer=answer))
            if include_usage:
                yield _event(chunk(None, answer=answer, usage=True))
            yield _event(None)
        finally:
            # The client hung up (Litestar cancels the stream) or the stream ended: stop decoding.
            job.cancel()
            job.deltas.close()

    async def ended() -> None:
        # After the stream, however it ended: a hang-up cancels the stream while the generator may be
        # suspended at a yield (its finally runs only when it is collected), so stop decoding here too.
        job.cancel()
        job.deltas.close()

    return Stream(events(), media_type="text/event-stream", background=BackgroundTask(ended),
                  headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **_provenance_headers(job)})


# --- routes --------------------------------------------------------------------------------------


@get("/v1/models")
async def list_models(request: Request[Any, Any, Any]) -> Response[bytes]:
    """The served model, as OpenAI lists models."""
    served = _served(request)
    return _json(ModelList(data=[ModelCard(id=served.name, created=served.created)]))


@get("/v1/models/{model_id:str}")
async def retrieve_model(request: Request[Any, Any, Any], model_id: str) -> Response[bytes]:
    """One served model's card, as OpenAI's ``models.retrieve`` reads it; another id is 404."""
    served = _served(request)
    if model_id != served.name:
        raise ModelNotServedError(f"the model {model_id[:80]!r} is not served here; this server serves {served.name!r}",
                                  param="model")
    return _json(ModelCard(id=served.name, created=served.created))


@get(HEALTH_PATH)
async def health(request: Request[Any, Any, Any]) -> dict[str, Any]:
    """``{"status": "ok", "model", "libraries", "entries", "running", "queued", "max_queue"}``."""
    served = _served(request)
    queued = served.queue.statistics().current_buffer_used if served.queue is not None else 0
    return {"status": "stopping" if served.stopping else "ok", "model": served.name, "libraries": len(served.libraries),
            "entries": sum(len(lib.entries) for lib in served.libraries), "running": served.running, "queued": queued,
            "max_queue": served.config.settings.max_queue}


@post("/v1/chat/completions", request_max_body_size=None, status_code=200)
async def chat_completions(request: Request[Any, Any, Any]) -> Response[Any]:
    """A chat completion: the question is the last user message's content; other messages are ignored."""
    served = _served(request)
    req = parse_request(ChatCompletionRequest, await read_body(request, served.config.settings.max_body_bytes))
    check_request(served.name, req)
    return await _answer(request, chat_question(req), req, req.max_completion_tokens or req.max_tokens, chat=True)


@post("/v1/completions", request_max_body_size=None, status_code=200)
async def completions(request: Request[Any, Any, Any]) -> Response[Any]:
    """A completion: the question is ``prompt`` (a string, or a list of one string)."""
    served = _served(request)
    req = parse_request(CompletionRequest, await read_body(request, served.config.settings.max_body_bytes))
    check_request(served.name, req)
    prompt = req.prompt if isinstance(req.prompt, str) else req.prompt[0]
    return await _answer(request, question_of(prompt, "prompt"), req, req.max_tokens, chat=False)


# --- errors --------------------------------------------------------------------------------------


def _server_error(request: Request[Any, Any, Any], exc: EngineServerError) -> Response[bytes]:
    if exc.status_code >= 500:
        logger.error("%s %s failed: %s", request.method, request.url.path, exc)
    elif isinstance(exc, QueueFullError | ClientClosedRequestError):
        logger.info("%s %s: %s", request.method, request.url.path, exc)
    return _json(_error_body(exc), status=exc.status_code, headers=exc.headers())


def _http_error(request: Request[Any, Any, Any], exc: HTTPException) -> Response[bytes]:
    mapped: EngineServerError
    if isinstance(exc, NotFoundException):
        mapped = RouteNotFoundError(f"{request.method} {request.url.path[:200]} is not part of this server's API")
    elif isinstance(exc, MethodNotAllowedException):
        mapped = MethodNotServedError(f"{request.url.path[:200]} does not answer {request.method}")
    else:
        mapped = InvalidRequestError(exc.detail or "the request cannot be answered")
        mapped.status_code = exc.status_code if 400 <= exc.status_code < 500 else 400
    return _server_error(request, mapped)


def _internal_error(request: Request[Any, Any, Any], exc: Exception) -> Response[bytes]:
    logger.error("%s %s failed", request.method, request.url.path, exc_info=exc)
    return _server_error(request, EngineServerError("the server failed to answer this request"))


# --- the app -------------------------------------------------------------------------------------


def _load(config: ServeConfig) -> _Served:
    """The model and its libraries, each library's prefix verified now (a library that does not
    verify keeps the server from starting); entries are verified when they are grafted."""
    # The profile first: one this machine cannot run is refused before loading runs any kernel.
    profile = current_profile(config.profile)
    model = load_model_for(config.model, profile)
    libraries = []
    for directory in config.libraries:
        trust = config.trust
        library = Library.open(directory, model, profile, trusted=trust.keys if trust else None,
                               insecure_skip_verify=bool(trust and trust.skip))
        library.prefix()
        libraries.append(library)
    return _Served(config, model, profile, libraries, created=int(time.time()))


@dataclass
class StartupEdge:
    """ASGI wrapper around the app (uvicorn runs this): a lifespan startup failure is reported as
    its one-line error (``failure``), not as the traceback Litestar formats."""

    inner: ASGIApp
    failure: StartupFailure

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "lifespan":
            await self.inner(scope, receive, send)
            return

        async def one_line(message: Message) -> None:
            if message["type"] == "lifespan.startup.failed" and self.failure.error is not None:
                message = {**message, "message": f"cannot start: {self.failure.error}"}
            await send(message)

        await self.inner(scope, receive, one_line)


def create_app(config: ServeConfig, *, failure: StartupFailure | None = None) -> Litestar:
    """The app serving ``config``. Its lifespan loads the model and the libraries (off the event
    loop), starts the one model worker, and on shutdown ends every decoding at its next token.
    A ``KvgraftError`` while loading is left in ``failure`` (for ``serve_engine`` to raise)."""
    holder = failure if failure is not None else StartupFailure()

    @contextlib.asynccontextmanager
    async def lifespan(app: Litestar) -> AsyncIterator[None]:
        try:
            served = await anyio.to_thread.run_sync(_load, config)
        except KvgraftError as e:
            holder.error = e
            raise
        send, receive = anyio.create_memory_object_stream[_Job](max_buffer_size=config.settings.max_queue)
        served.queue = send
        app.state.served = served
        logger.info("serving %s with %d libraries (%d entries)", config.model, len(served.libraries),
                    sum(len(lib.entries) for lib in served.libraries))
        async with anyio.create_task_group() as tg:
            tg.start_soon(_worker, served, receive)
            try:
                yield
            finally:
                served.stopping = True
                send.close()  # the worker skips what is queued, then ends

    return Litestar(
        route_handlers=[list_models, retrieve_model, health, chat_completions, completions],
        lifespan=[lifespan],
        exception_handlers={EngineServerError: _server_error, HTTPException: _http_error, Exception: _internal_error},
        # The app logs through "kvgraft.engine.serve"; serve_engine configures the process's logging.
        logging_config=None,
        openapi_config=None,
    )
