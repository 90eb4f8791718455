"""The one error tree of kvgraft, and the data contracts' own branch of it.

Every exception kvgraft defines is a subclass of :class:`KvgraftError`; each package has one base
below it and one subclass per failure. See :class:`KvgraftError` for the whole tree.
"""

from __future__ import annotations


class KvgraftError(Exception):
    """Base class of every error kvgraft raises (re-exported as ``kvgraft.KvgraftError``).

    An error carries a ``message`` (what happened) and a ``hint`` (what to do, in pip's style);
    ``str()`` is one line, ``<message> (hint: <hint>)``, or just the message when there is no
    hint. Subclasses give a ``default_hint``; callers may pass a better one. Catch this one class
    to report any kvgraft failure without a traceback: the ``kvgraft`` and ``kvgraft-verify``
    commands do, and ``--json`` names the real class.

    The tree (one base per package; the leaves are in each package's ``errors`` module)::

        KvgraftError
        ├── SchemaError (also a ValueError)      kvgraft.schemas: data contracts
        │   ├── InvalidDigestError
        │   ├── CanonicalizationError
        │   ├── DocumentError
        │   └── DirectoryExistsError
        ├── VerificationError                     kvgraft.verifier: signatures, digests, proofs, records
        │   ├── MalformedInputError ── KeyFileError
        │   ├── UnsupportedPayloadTypeError, UnknownKeyError, BadSignatureError,
        │   │   ThresholdNotMetError, UntrustedRootError, IdentityMismatchError,
        │   │   LogEntryError, LogProofError, ClaimMismatchError
        │   └── DigestMismatchError ── SubjectMismatchError, TokenDigestMismatchError, ChainKeyMismatchError
        ├── EngineError                           kvgraft.engine: models, artifacts, grafts, library
        │   ├── UnknownModelError, ModelNotInstalledError, ModelFileError, KvFileError,
        │   │   ProfileMismatchError, InputTextError, LibraryError, EvaluationError,
        │   │   NoTrustedKeysError, TrustOptionsError, ScheduleError, KernelError,
        │   │   ContextWindowError (an InputTextError), EngineServerConfigError
        │   ├── ArtifactError ── ArtifactSignatureError, UnsafeTensorError, LineageError
        │   └── EngineServerError                 kvgraft engine serve (HTTP status on the class)
        │       ├── InvalidRequestError ── PromptTooLongError
        │       └── RequestTooLargeError, ModelNotServedError, RouteNotFoundError, MethodNotServedError,
        │           QueueFullError, RequestTimeoutError, ServerStoppingError, ArtifactRefusedError,
        │           ClientClosedRequestError
        ├── RegistryError                         kvgraft.registry service (HTTP status on the class)
        │   ├── BadRequestError, NotFoundError, ... (registry/_internal/errors.py)
        │   └── DataDirError ── LogIntegrityError ── LogRollbackError, ...
        ├── RegistryClientError                   kvgraft.registry client: what a registry answered
        │   ├── RegistryUnavailableError, RegistryResponseError ── RegistryAuthError, ...
        │   └── BlobDigestError, EvidenceError, LogForkError, ListingError, DiskFullError, ...
        └── CliError                              kvgraft commands: bad options and local files
    """

    #: What the user can do about it; ``None`` where the message says it all.
    default_hint: str | None = None

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        self.message = message
        self.hint = hint if hint is not None else self.default_hint
        super().__init__(message)

    def __str__(self) -> str:
        # One line, always: the commands print exactly this.
        text = self.message if not self.hint else f"{self.message} (hint: {self.hint})"
        return " ".join(text.split())


class SchemaError(KvgraftError, ValueError):
    """Base class: a value does not satisfy a kvgraft data contract.

    Also a ``ValueError``, so that pydantic validators that raise it report a validation error.
    """


class InvalidDigestError(SchemaError):
    """A digest string is not ``sha256:`` followed by 64 lowercase hex digits."""


class CanonicalizationError(SchemaError):
    """A value cannot be written as RFC 8785 canonical JSON (NaN, huge integers, bad keys)."""


class DocumentError(SchemaError):
    """A JSON document does not match the model it should be (wrong fields or types)."""


class DirectoryExistsError(SchemaError):
    """A staged directory's target already exists: writers never replace a directory."""

    default_hint = "write into a new directory"
