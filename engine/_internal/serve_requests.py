"""Reading an OpenAI-style request for ``engine serve`` (serve_app.py): the body within its
limit, parsed into the wire models with every refusal naming its field, the fields kvgraft does
not serve refused rather than ignored, the sampling asked for, and the question it asks."""

from __future__ import annotations

import re
import secrets
from typing import Any, TypeVar

from litestar import Request
from pydantic import BaseModel, ValidationError

from kvgraft.schemas import MAX_SEED, ChatCompletionRequest, CompletionRequest

from .errors import InvalidRequestError, ModelNotServedError, RequestTooLargeError
from .ops import GREEDY, Sampling

_Model = TypeVar("_Model", bound=BaseModel)


async def read_body(request: Request[Any, Any, Any], limit: int) -> bytes:
    """The request body, refused (413) past ``limit`` bytes, declared or streamed."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isascii() and declared.isdigit() and int(declared) > limit:
        raise RequestTooLargeError(f"the request body is {int(declared)} bytes; this server accepts at most {limit}")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise RequestTooLargeError(f"the request body is larger than this server's limit of {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


#: Union members in a validation error's location (``str``, ``list[TextPart]``): not field names.
_TYPE_TAG = re.compile(r"^(?:[A-Z]\w*|str|int|float|bool|none|list\[.*\]|function-\w+\[.*\])$")


def _where(loc: tuple[int | str, ...]) -> str:
    return ".".join(str(part) for part in loc if not (isinstance(part, str) and _TYPE_TAG.match(part)))


def parse_request(model: type[_Model], body: bytes) -> _Model:
    """``body`` as ``model``, or an ``InvalidRequestError`` naming the fields at fault (at most 3)."""
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        errors = e.errors(include_url=False, include_input=False, include_context=False)
        first = errors[0]
        if first["type"] == "json_invalid":
            raise InvalidRequestError(f"the request body is not JSON: {first['msg']}",
                                      hint="send one JSON object, UTF-8 encoded") from e
        if first["type"] == "model_type" and not first["loc"]:
            raise InvalidRequestError("the request body must be a JSON object", hint="send one JSON object") from e
        # A union (a string or a list of parts) fails once per member: name each field once.
        seen: dict[str, str] = {}
        for error in errors:
            seen.setdefault(_where(error["loc"]) or "body", error["msg"])
        named = list(seen.items())[:3]
        raise InvalidRequestError("invalid request: " + "; ".join(f"{where}: {msg}" for where, msg in named),
                                  param=named[0][0]) from e


#: The request fields kvgraft reads only to refuse (400, ``unsupported_parameter``), what each asks
#: for, and the values that ask for nothing (what a client sends by default), which pass.
UNSERVED_FIELDS: dict[str, tuple[str, tuple[object, ...]]] = {
    "tools": ("tool calls", ([],)),
    "tool_choice": ("tool calls", ("none",)),
    "functions": ("function calls", ([],)),
    "function_call": ("function calls", ("none",)),
    "response_format": ("a structured response format", ({"type": "text"},)),
    "logprobs": ("log probabilities", (False,)),
    "top_logprobs": ("log probabilities", (0,)),
    "logit_bias": ("biased logits", ({},)),
    "echo": ("the prompt echoed back", (False,)),
    "suffix": ("text inserted before a suffix", ("",)),
    "best_of": ("several candidates ranked", (1,)),
    "presence_penalty": ("penalties on tokens already present", (0, 0.0)),
    "frequency_penalty": ("penalties on frequent tokens", (0, 0.0)),
}


def _asks_for_nothing(value: object, defaults: tuple[object, ...]) -> bool:
    # Compared with their types: 0 is not False, so "logprobs": 0 still asks for log probabilities.
    return value is None or any(type(value) is type(ok) and value == ok for ok in defaults)


def check_request(served_name: str, req: ChatCompletionRequest | CompletionRequest) -> None:
    """Refuse what the request asks for that is not served: a field of ``UNSERVED_FIELDS`` set to
    anything but its default, another model than ``served_name``, several choices streamed."""
    for name, (what, defaults) in UNSERVED_FIELDS.items():
        if not _asks_for_nothing(getattr(req, name), defaults):
            raise InvalidRequestError(
                f"{name} is not served: kvgraft answers with plain text only, without {what}; "
                "it refuses the field rather than answer a different request than the one sent",
                hint=f"leave {name} out", param=name, code="unsupported_parameter",
            )
    if req.model != served_name:
        raise ModelNotServedError(f"the model {req.model[:80]!r} is not served here; this server serves {served_name!r}",
                                  param="model")
    if (req.n or 1) > 1 and req.stream:
        raise InvalidRequestError(f"n {req.n} is served only without streaming: a stream carries one choice",
                                  hint="leave n out (or send 1) to stream, or leave stream out", param="n",
                                  code="unsupported_value")


def sampling_of(req: ChatCompletionRequest | CompletionRequest) -> Sampling:
    """The request's sampling: greedy for temperature absent or 0 (``top_p`` and ``seed`` play no
    part then); otherwise sampled with ``seed``, or a seed drawn here when none was sent, which
    the answer reports (``kvgraft.seed``) so that it can be drawn again."""
    if not req.temperature:
        return GREEDY
    seed = req.seed if req.seed is not None else secrets.randbelow(MAX_SEED + 1)
    return Sampling(req.temperature, req.top_p if req.top_p is not None else 1.0, seed)


def chat_question(req: ChatCompletionRequest) -> tuple[str, str]:
    """The question, the last ``user`` message's content (a string, or its text parts joined by
    newlines), and the field it came from."""
    for n in range(len(req.messages) - 1, -1, -1):
        message = req.messages[n]
        if message.role != "user":
            continue
        content = message.content
        if content is None:
            raise InvalidRequestError(f"messages.{n}: the last user message has no content", param=f"messages.{n}.content")
        if isinstance(content, str):
            return question_of(content, f"messages.{n}.content")
        texts = []
        for i, part in enumerate(content):
            if part.type != "text" or part.text is None:
                raise InvalidRequestError(
                    f"messages.{n}.content.{i}: a {part.type[:40]!r} part; only text parts ({{\"type\": \"text\", \"text\": ...}}) are served",
                    param=f"messages.{n}.content.{i}",
                )
            texts.append(part.text)
        return question_of("\n".join(texts), f"messages.{n}.content")
    raise InvalidRequestError("messages holds no user message: the question is the last user message's content",
                              hint='add {"role": "user", "content": "..."}', param="messages")


def question_of(text: str, param: str) -> tuple[str, str]:
    """``text`` and the field it came from, refused when blank."""
    if not text.strip():
        raise InvalidRequestError(f"{param}: the question is empty", hint="ask a question with some text", param=param)
    return text, param
