"""The registry client's branch of the error tree: ``RegistryClientError`` and its subclasses.

Every failure of the client is one of these (each a ``kvgraft.KvgraftError``: one line,
``<what happened> (hint: <what to do>)``)::

    RegistryClientError
    ├── RegistryUnavailableError       unreachable, broke mid-transfer, or past its deadline
    ├── RegistryResponseError          an RFC 9457 problem, or a malformed answer
    │   ├── RegistryAuthError          401/403
    │   ├── RegistryNotFoundError      404
    │   ├── ResponseTooLargeError      larger, deeper or slower to parse than the limits allow
    │   └── ListingError               a paged listing that does not advance
    ├── LocalFilesError                a local directory or file cannot be read or written
    │   ├── DiskFullError              ENOSPC, or not enough free space to start
    │   └── CheckpointMemoryError      the remembered-checkpoint file is unreadable or damaged
    ├── ParentNotPublishedError
    ├── BlobDigestError                bytes that hash to another digest than asked for
    ├── EvidenceError                  a signature, proof, leaf hash or statement that does not hold
    │   ├── LogForkError               a checkpoint that does not extend the remembered one
    │   └── UnwitnessedCheckpointError a checkpoint without the cosignatures a witness policy needs
    ├── EnvelopeSignatureError         a pulled envelope not signed by the trusted keys
    └── MirrorDivergedError            the target's log is not a prefix of the source's
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from kvgraft.schemas import KvgraftError


class RegistryClientError(KvgraftError):
    """Base class of every failure of the registry client (a ``kvgraft.KvgraftError``)."""

    default_hint: str | None = "check the registry URL and the inputs named in the message"


class RegistryUnavailableError(RegistryClientError):
    """The registry could not be reached, or the connection broke mid-transfer."""

    default_hint = "check that the registry URL is right and the server is running, then retry"


class RegistryResponseError(RegistryClientError):
    """The registry answered with an error (an RFC 9457 problem) or with a malformed document."""

    default_hint = "see the registry's message; the API is described in docs/registry.md"

    def __init__(
        self, message: str, *, hint: str | None = None, status: int | None = None, problem: dict[str, Any] | None = None
    ) -> None:
        super().__init__(message, hint=hint)
        self.status = status
        #: The problem document as served (empty when the body was not one).
        self.problem: dict[str, Any] = dict(problem or {})

    @property
    def problem_type(self) -> str:
        """The problem's ``type`` URI ("" when there was none)."""
        value = self.problem.get("type")
        return value if isinstance(value, str) else ""


class RegistryAuthError(RegistryResponseError):
    """401 or 403: no token, an unknown or revoked token, or a key the token is not bound to."""

    default_hint = "pass a valid --token bound to the key that signed the envelope"


class RegistryNotFoundError(RegistryResponseError):
    """404: the registry holds no such artifact, entry or blob."""

    default_hint = "check the digest; list what the registry holds with GET /v1/artifacts"


class AmbiguousDigestError(RegistryClientError):
    """A short digest is the start of several digests in the registry (as git refuses an ambiguous abbreviation)."""

    default_hint = "pass more of the digest: one of the candidates the message lists"


class LocalFilesError(RegistryClientError):
    """A local directory or file cannot be published or written (missing, unsafe, already there)."""

    default_hint = "pass an artifact directory (kv.safetensors + statement.dsse.json) or a record directory"


class ParentNotPublishedError(RegistryClientError):
    """An artifact's parent tensors are neither on the registry nor found locally."""

    default_hint = "publish the parent artifact first: kvgraft publish --registry URL PARENT_DIR"


class BlobDigestError(RegistryClientError):
    """Bytes that arrived (or were sent) hash to another digest than the one they were asked for."""

    default_hint = "the registry served altered bytes; nothing was kept. Report it to the registry's operator"


class EvidenceError(RegistryClientError):
    """The registry's evidence does not hold: a checkpoint signature, an inclusion or consistency
    proof, a leaf hash, or a statement that does not describe what was downloaded."""

    default_hint = "do not use what this registry served; report it to the registry's operator"


class EnvelopeSignatureError(RegistryClientError):
    """A pulled envelope's signatures do not satisfy the trusted keys."""

    default_hint = "check --trusted-keys: it must hold the publisher's public key (kvgraft keys trust)"


class MirrorDivergedError(RegistryClientError):
    """The target's log is not a prefix of the source's (or does not extend it): it is not a mirror."""

    default_hint = "mirror into an empty registry, or into one that only ever received this source's entries"


class ResponseTooLargeError(RegistryResponseError):
    """An answer is larger, deeper or slower to parse than the client's limits allow."""

    default_hint = (
        "the registry sent more than any kvgraft registry does: report it to its operator "
        "(raise --max-json-bytes only if you trust it)"
    )


class ListingError(RegistryResponseError):
    """A paged listing does not advance: its cursor repeats, its log indexes do not increase, or it
    runs past ``max_pages`` / ``max_items``."""

    default_hint = "the registry's listing does not end; report it to the registry's operator"


class DiskFullError(LocalFilesError):
    """A pulled file does not fit on the local disk (checked first; ENOSPC while writing)."""

    default_hint = "free space on that filesystem, or pull into a directory on another one"


class LogForkError(EvidenceError):
    """A checkpoint does not provably extend the newest one this machine verified for the same log:
    a possible split view (two trees for one log) or rollback (the log lost entries)."""

    default_hint = (
        "do not use this registry's answers: report both checkpoints to its operator. Only if the "
        "operator confirms the log was deliberately reset, remove the remembered checkpoint file named here"
    )


class UnwitnessedCheckpointError(EvidenceError):
    """No checkpoint the registry serves carries the witness cosignatures the client's policy
    requires (``--witness-policy``), within the time the client waits for witnesses to catch up."""

    default_hint = (
        "the witnesses have not cosigned this registry's tree: they are behind (retry later, or raise --witness-wait), "
        "or they refused it because it does not extend the tree they saw (a fork or a rollback): do not trust it"
    )


class CheckpointMemoryError(LocalFilesError):
    """The file that remembers a log's newest verified checkpoint cannot be read, verified or written."""

    default_hint = "check $KVGRAFT_HOME/checkpoints; remove the named file only if you know why it is damaged"


def malformed(url: str, what: str) -> RegistryResponseError:
    """The one error for an answer of the wrong shape: ``<url> sent a malformed answer: <what>``."""
    return RegistryResponseError(
        f"{url} sent a malformed answer: {what}",
        hint="is this a kvgraft registry of the same version? report it to the registry's operator",
    )


def malformed_document(url: str, e: ValidationError, what: str) -> RegistryResponseError:
    """``malformed`` for a document the wire model refused: the first problems, on one line.

    Only the field paths and pydantic's messages are quoted, never the values the registry sent.
    """
    problems = [
        f"{'.'.join(map(str, err['loc'])) or what}: {err['msg']}".replace("\n", " ") for err in e.errors()[:3]
    ]
    more = f" (and {e.error_count() - 3} more)" if e.error_count() > 3 else ""
    return malformed(url, f"{what} does not have the registry's shape: {'; '.join(problems)}{more}")
