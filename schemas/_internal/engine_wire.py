"""The engine server's wire format: the OpenAI-compatible subset ``kvgraft engine serve`` speaks.

Shared by both ends: the server (``kvgraft.engine``'s ``serve_app.py``) parses every request body
into a request model and answers with the response models; ``kvgraft ask --engine URL`` parses
every answer with the same models (strictly), so a body of the wrong shape is refused in one
place. It lives here, not in the engine, so that the client needs neither torch nor the engine.

Requests (``ChatCompletionRequest``, ``CompletionRequest``) ignore fields they do not know (an
OpenAI client sends more than kvgraft uses) and coerce nothing: ``"max_tokens": "8"`` or
``"stream": 1`` is a 400, not a guess. Every size a stranger controls has a limit here
(messages, parts, characters, stop strings, tokens). Responses allow extra keys, so a field the
server adds later does not break an older client.

Every answer carries its provenance (``Provenance``) in a ``kvgraft`` member: which library
entry was grafted (its artifact digest) and how it was found, the signature check, the token
counts, time and energy. docs/engine-serve.md documents all of it.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from .wire import DIGEST_PATTERN

#: The most messages a chat request may hold (only the last user message is read).
MAX_MESSAGES = 256
#: The most content parts one message may hold.
MAX_CONTENT_PARTS = 64
#: The most characters of one text (a message's content, a part, a prompt).
MAX_TEXT_CHARS = 256 * 1024
#: The most stop strings, and characters in each (as OpenAI allows).
MAX_STOP_STRINGS = 4
MAX_STOP_CHARS = 256
#: The largest ``max_tokens`` accepted (decoding also ends at the model's window).
MAX_TOKENS_LIMIT = 1 << 16
#: The most choices (``n``) one request may ask for.
MAX_CHOICES = 8
#: The highest sampling temperature (OpenAI's range).
MAX_TEMPERATURE = 2.0
#: Seeds are 0 .. 2**63 - 1.
MAX_SEED = (1 << 63) - 1
#: The longest model name a request may send.
MAX_MODEL_NAME_CHARS = 256

#: What a served model's ``owned_by`` says.
OWNED_BY = "kvgraft"

Text = Annotated[str, Field(max_length=MAX_TEXT_CHARS)]
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]
Stop = StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)]
TokenBudget = Annotated[int, Field(ge=1, le=MAX_TOKENS_LIMIT)]
#: Why an answer ended: ``stop`` (its own end, EOS, or a stop string) or ``length`` (``max_tokens``
#: or the model's window).
FinishReason = Literal["stop", "length"]
#: How the library entry was found: the same normalized problem, the most similar one, none, or
#: ``fixed``: the one entry an evaluation grafts before every problem (``kvgraft eval
#: --library-entry``; the engine server never answers so).
AnswerMethod = Literal["exact", "similar", "none", "fixed"]
#: What an answer is (issue 39), the one word every surface shows it by:
#:
#: - ``recalled``: the question is a deposited problem; the answer is the verified one its entry's
#:   signed text states (the grader confirmed it against the dataset's key at deposit);
#: - ``assisted``: a verified entry was grafted as context (a similar problem, at or above the
#:   library's similarity threshold); the answer is the model's own, unverified;
#: - ``unassisted``: nothing was grafted but the instruction (or nothing at all); the answer is
#:   the model's own, unverified.
AnswerKind = Literal["recalled", "assisted", "unassisted"]


class EngineRequest(BaseModel):
    """Base of the request models: unknown fields are ignored, nothing is coerced."""

    model_config = ConfigDict(extra="ignore", strict=True, frozen=True)


class EngineWire(BaseModel):
    """Base of the response models: extra keys pass through (a newer server's fields)."""

    model_config = ConfigDict(extra="allow", strict=True, frozen=True)


# --- requests ------------------------------------------------------------------------------------


class TextPart(EngineRequest):
    """One part of a message's content; only ``{"type": "text", "text": ...}`` parts are read."""

    type: Annotated[str, Field(max_length=64)]
    text: Text | None = None


class ChatMessage(EngineRequest):
    """One chat message. Any role is accepted; only the last ``user`` message is the question."""

    role: Annotated[str, Field(min_length=1, max_length=64)]
    content: Text | Annotated[list[TextPart], Field(max_length=MAX_CONTENT_PARTS)] | None = None


class StreamOptions(EngineRequest):
    """``stream_options``: ``include_usage`` adds a last chunk with ``usage`` and no choices."""

    include_usage: bool | None = None


class _Sampling(EngineRequest):
    """What both endpoints take. ``temperature`` absent or 0 is greedy decoding (the default:
    exact and reproducible); above 0 (to 2) tokens are sampled, kept to the ``top_p`` nucleus,
    reproducibly from ``seed`` (the server draws one when none is sent, and reports it).
    ``n``: choices, each its own decoding (choice ``i`` with ``seed + i``)."""

    model: Annotated[str, Field(min_length=1, max_length=MAX_MODEL_NAME_CHARS)]
    max_tokens: TokenBudget | None = None
    temperature: Annotated[float, Field(ge=0.0, le=MAX_TEMPERATURE)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    seed: Annotated[int, Field(ge=0, le=MAX_SEED)] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_CHOICES)] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    stop: Stop | None = None
    # Read only to be refused (the server's ``UNSERVED_FIELDS``): each would change the answer's shape or
    # content, so ignoring it would answer another request than the one sent.
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    response_format: Any = None
    logprobs: Any = None
    top_logprobs: Any = None
    logit_bias: Any = None
    echo: Any = None
    suffix: Any = None
    best_of: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``. ``max_completion_tokens`` wins over ``max_tokens``."""

    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    max_completion_tokens: TokenBudget | None = None


class CompletionRequest(_Sampling):
    """``POST /v1/completions``: ``prompt`` is a string or a list of one string."""

    prompt: Text | Annotated[list[Text], Field(min_length=1, max_length=1)]


# --- responses -----------------------------------------------------------------------------------


class Provenance(EngineWire):
    """Where an answer came from (the ``kvgraft`` member of every answer and of the last chunk).

    ``entry``: the grafted library entry's artifact digest (``sha256:`` + 64 hex), or None when
    only the instruction prefix or nothing was grafted. ``method``: how the entry was found.
    ``signature``: how the grafted artifacts' signatures were checked (``verified: <signers>``,
    ``skipped (--insecure-skip-verify)``, or ``none (nothing grafted)``). ``score``: the lookup's
    similarity (1.0 for exact, 0 for none). ``prompt_tokens``: tokens run for this request (the
    question, or the recall's short suffix); ``context_tokens``: those plus the grafted ones;
    ``decode_tokens``: tokens decoded. ``seconds``: the model worker's time on the request.
    ``energy_joules`` is ``measured`` (RAPL) or ``estimated`` (from FLOPs).

    ``kind`` (``AnswerKind``) says what ``answer`` is: for ``recalled`` the verified answer of the
    deposited problem; otherwise the model's, unverified, extracted by the library's dataset kind
    only from a finished decode (``finished``: it ended at the model's EOS or the library's own
    end of a solution), else None. ``stopped_by`` says why decoding ended (``eos``, ``stop``,
    ``window``, ``max_new_tokens``): a decode cut off by the budget or the window is not finished
    and has no answer. ``seed``: the sampling seed, None for greedy decoding.
    """

    kind: AnswerKind
    finished: bool
    stopped_by: str
    seed: int | None = None
    entry: Annotated[str, Field(pattern=DIGEST_PATTERN)] | None
    method: AnswerMethod
    signature: str
    score: float
    prompt_tokens: int
    decode_tokens: int
    context_tokens: int
    seconds: float
    energy_joules: float
    energy_method: str
    answer: str | None


class Usage(EngineWire):
    """OpenAI's usage: ``prompt_tokens`` counts the tokens this request ran (grafted ones are
    not recomputed, so not counted: they are ``kvgraft.context_tokens - kvgraft.prompt_tokens``)."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class AssistantMessage(EngineWire):
    """The answer's message."""

    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(EngineWire):
    """One choice of a chat completion (``n`` of them, ``index`` 0 ..)."""

    index: int = 0
    message: AssistantMessage
    finish_reason: FinishReason
    logprobs: None = None


class ChatCompletion(EngineWire):
    """A chat completion (``object: "chat.completion"``)."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    kvgraft: Provenance


class ChatDelta(EngineWire):
    """What one chunk adds: the role (first chunk), then content."""

    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(EngineWire):
    """The one choice of a chat chunk; ``finish_reason`` is set on the last content chunk only."""

    index: int = 0
    delta: ChatDelta
    finish_reason: FinishReason | None = None
    logprobs: None = None


class ChatCompletionChunk(EngineWire):
    """One server-sent event of a streamed chat completion (``object: "chat.completion.chunk"``).
    The chunk with ``finish_reason`` carries ``kvgraft``; with ``include_usage`` a last chunk with
    no choices carries ``usage`` (and ``kvgraft`` again)."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    kvgraft: Provenance | None = None


class CompletionChoice(EngineWire):
    """One choice of a completion (or of a streamed completion's chunk)."""

    index: int = 0
    text: str
    finish_reason: FinishReason | None = None
    logprobs: None = None


class Completion(EngineWire):
    """A completion (``object: "text_completion"``); a streamed one's chunks have the same shape,
    ``usage`` and ``kvgraft`` only on the last."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    kvgraft: Provenance | None = None


class ModelCard(EngineWire):
    """One served model in ``GET /v1/models``."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = OWNED_BY


class ModelList(EngineWire):
    """``GET /v1/models``."""

    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(EngineWire):
    """OpenAI's error object: what happened (``message``, with what to do), its ``type``, the
    request field at fault (``param``) and a machine-readable ``code``."""

    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(EngineWire):
    """Every 4xx and 5xx answer's body (and a failed stream's last event): ``{"error": {...}}``."""

    error: ErrorDetail
