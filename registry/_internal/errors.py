"""The registry's exceptions: one base class, one subclass per failure.

Each class fixes the HTTP status, the RFC 9457 problem ``type`` and ``title`` of the failure,
so the app maps an exception to its response by class alone. Every error carries a
``message`` (what happened) and a ``hint`` (what to do), like the verifier's errors.
"""

from __future__ import annotations

import errno as errno_names
from typing import Any

from kvgraft.schemas import KvgraftError

#: Problem ``type`` URIs are this prefix plus the class's slug (RFC 9457 section 3.1.1).
PROBLEM_BASE = "https://kvgraft.dev/problems/"


class RegistryError(KvgraftError):
    """Base class of every failure the registry reports (a ``kvgraft.KvgraftError``)."""

    status_code: int = 500
    slug: str = "registry-error"
    title: str = "Registry error"
    default_hint: str | None = "retry; if it persists, report it to the registry's operator"

    def __init__(self, message: str, *, hint: str | None = None, extra: dict[str, Any] | None = None) -> None:
        super().__init__(message, hint=hint)
        #: Extension members added to the problem document (RFC 9457 section 3.2).
        self.extra: dict[str, Any] = dict(extra or {})

    @property
    def problem_type(self) -> str:
        """The RFC 9457 ``type`` URI of this failure."""
        return PROBLEM_BASE + self.slug

    def headers(self) -> dict[str, str]:
        """Extra response headers this failure needs (e.g. ``WWW-Authenticate``)."""
        return {}


# --- 400 ---------------------------------------------------------------------------------------


class BadRequestError(RegistryError):
    """A request parameter is malformed (a digest, an index, a cursor, a size)."""

    status_code = 400
    slug = "bad-request"
    title = "Bad request"
    default_hint = "check the request against the API in docs/registry.md"


class BadDigestError(BadRequestError):
    """A digest in a path or query is not ``sha256:`` and 64 lowercase hex digits."""

    slug = "bad-digest"
    title = "Malformed digest"
    default_hint = "name content as sha256:<64 lowercase hex digits>"


class BlobDigestMismatchError(RegistryError):
    """Uploaded bytes do not hash to the digest they were uploaded under."""

    status_code = 400
    slug = "digest-mismatch"
    title = "Blob digest mismatch"
    default_hint = "upload the file whose sha256 is the digest in the URL; nothing was stored"


class MalformedEnvelopeError(RegistryError):
    """A posted entry is not a DSSE envelope (not JSON, wrong shape, bad base64)."""

    status_code = 400
    slug = "malformed-envelope"
    title = "Malformed envelope"
    default_hint = "post the .dsse.json file exactly as the signer wrote it"


class InvalidNameError(BadRequestError):
    """A publisher name is not acceptable."""

    slug = "invalid-name"
    title = "Invalid name"
    default_hint = "use 1 to 64 characters: lowercase letters, digits, '.', '_' and '-', starting with a letter or digit"


class QueryTooLargeError(BadRequestError):
    """A search query is longer, or names more words, than the registry's limits."""

    slug = "query-too-large"
    title = "Search query too large"
    default_hint = "search for a few words of the source text"


class DocumentTooDeepError(BadRequestError):
    """Posted JSON (an envelope, or the statement inside it) nests deeper than the registry's limit."""

    slug = "too-deep"
    title = "JSON nests too deep"
    default_hint = "post the envelope kvgraft wrote; kvgraft statements nest a few levels deep"


# --- 401 / 403 ---------------------------------------------------------------------------------


class AuthenticationError(RegistryError):
    """No bearer token, or one the registry does not know."""

    status_code = 401
    slug = "unauthenticated"
    title = "Authentication required"
    default_hint = "send 'Authorization: Bearer <token>' with a token from 'kvgraft token create'"

    def headers(self) -> dict[str, str]:
        return {"WWW-Authenticate": 'Bearer realm="kvgraft-registry"'}


class TokenRevokedError(RegistryError):
    """The bearer token was revoked."""

    status_code = 403
    slug = "token-revoked"
    title = "Token revoked"
    default_hint = "ask the registry's operator for a new token"


class KeyNotBoundError(RegistryError):
    """The envelope is signed only by keys the token may not publish under."""

    status_code = 403
    slug = "key-not-bound"
    title = "Signing key not allowed for this token"
    default_hint = "sign with a key the token is bound to, or ask the operator to bind the key ('kvgraft token create --key')"


class AdminAuthError(RegistryError):
    """An admin request lacks the registry's current admin secret."""

    status_code = 401
    slug = "admin-unauthenticated"
    title = "Admin authentication required"
    default_hint = "run 'kvgraft token/key ...' on the registry's host; it reads the admin secret from the data directory"

    def headers(self) -> dict[str, str]:
        return {"WWW-Authenticate": 'Bearer realm="kvgraft-registry-admin"'}


# --- 404 ---------------------------------------------------------------------------------------


class NotFoundError(RegistryError):
    """Base of the 404s."""

    status_code = 404
    slug = "not-found"
    title = "Not found"
    default_hint = "check the digest or index; list what exists with GET /v1/artifacts or /v1/log/checkpoint"


class BlobNotFoundError(NotFoundError):
    """No blob has that digest."""

    slug = "blob-not-found"
    title = "Blob not found"
    default_hint = "upload it with PUT /v1/blobs/sha256:<hex>, or check the digest"


class BlobQuarantinedError(BlobNotFoundError):
    """The stored blob no longer hashed to its digest (rot on disk) and was moved aside; not served."""

    slug = "blob-quarantined"
    title = "Blob quarantined"
    default_hint = "upload the right bytes again with PUT /v1/blobs/sha256:<hex>: that repairs it"


class EntryNotFoundError(NotFoundError):
    """No log entry has that index or digest."""

    slug = "entry-not-found"
    title = "Entry not found"


class ArtifactNotFoundError(NotFoundError):
    """No KV artifact entry has that tensors digest."""

    slug = "artifact-not-found"
    title = "Artifact not found"


class TokenNotFoundError(NotFoundError):
    """No token has that id."""

    slug = "token-not-found"
    title = "Token not found"
    default_hint = "list the tokens with 'kvgraft token list --data DIR'"


class TileNotFoundError(NotFoundError):
    """A c2sp.org/tlog-tiles path under /tlog/ is malformed, or names a tile the log does not have yet."""

    slug = "tile-not-found"
    title = "Tile not found"
    default_hint = (
        "fetch /tlog/checkpoint first and ask only for the tiles its tree size has: tile/<L>/<N>[.p/<W>] and "
        "tile/entries/<N>[.p/<W>] (c2sp.org/tlog-tiles)"
    )


class EntryTooLargeForTilesError(TileNotFoundError):
    """An entry bundle would hold an entry over 65,535 bytes, which tlog-tiles cannot encode.

    The bundle does not exist (as in a static export of the log); the entries are served by the
    API instead, and the level-0 tile still proves each one's leaf hash.
    """

    slug = "entry-too-large-for-tiles"
    title = "Entry too large for a tlog-tiles entry bundle"
    default_hint = "read the entry at /v1/entries/<index>/envelope and check its leaf hash against the level-0 tile"


# --- 409 / 413 / 416 / 422 ---------------------------------------------------------------------


class MissingBlobsError(RegistryError):
    """An entry names blobs (subjects, a parent's tensors) the registry does not hold."""

    status_code = 409
    slug = "missing-blobs"
    title = "Referenced blobs missing"
    default_hint = "upload every blob the statement names (PUT /v1/blobs/sha256:<hex>) and post the envelope again"


class MissingReferenceError(RegistryError):
    """An entry refers to another log entry that does not exist (a replay's pre-registration)."""

    status_code = 409
    slug = "missing-reference"
    title = "Referenced entry missing"
    default_hint = "publish the pre-registration first, then the replay that points at it"


class ConflictError(RegistryError):
    """The request conflicts with what the registry holds (a key registered to someone else)."""

    status_code = 409
    slug = "conflict"
    title = "Conflict"


class PayloadTooLargeError(RegistryError):
    """A request body is larger than the registry accepts."""

    status_code = 413
    slug = "too-large"
    title = "Payload too large"
    default_hint = "the limits are the registry's settings; ask its operator"


class TooManySignaturesError(PayloadTooLargeError):
    """A posted envelope carries more signatures than the registry verifies."""

    slug = "too-many-signatures"
    title = "Too many signatures"
    default_hint = "sign with the few keys a threshold needs; the limit is the registry's --max-signatures"


class RangeNotSatisfiableError(RegistryError):
    """No requested byte range overlaps the blob."""

    status_code = 416
    slug = "range-not-satisfiable"
    title = "Range not satisfiable"
    default_hint = "ask for byte ranges inside the blob; HEAD gives its Content-Length"

    def __init__(self, message: str, *, size: int, hint: str | None = None) -> None:
        super().__init__(message, hint=hint, extra={"size": size})
        self.size = size

    def headers(self) -> dict[str, str]:
        return {"Content-Range": f"bytes */{self.size}"}


class RateLimitedError(RegistryError):
    """A token made more requests than the registry's per-token rate limit allows."""

    status_code = 429
    slug = "rate-limited"
    title = "Too many requests"
    default_hint = "wait for the number of seconds in Retry-After, then retry; ask the operator for a higher limit if you need one"

    def __init__(self, message: str, *, retry_after: int, hint: str | None = None) -> None:
        super().__init__(message, hint=hint, extra={"retry_after": retry_after})
        self.retry_after = retry_after

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after)}


class InvalidSignatureError(RegistryError):
    """No signature on the envelope verifies: it was altered, or signed by an unknown key."""

    status_code = 422
    slug = "invalid-signature"
    title = "Signature does not verify"
    default_hint = "the envelope was altered after signing; post the file exactly as the signer wrote it"


class InvalidStatementError(RegistryError):
    """The signed payload is not a statement the registry accepts."""

    status_code = 422
    slug = "invalid-statement"
    title = "Unacceptable statement"
    default_hint = (
        "post an in-toto statement of a kvgraft predicate type (kv-artifact, exactness, evaluation, "
        "pre-registration, replay), made by kvgraft"
    )


class InvalidLineageError(InvalidStatementError):
    """A KV artifact's lineage does not join up: no parent entry, a gap, a cycle, no tokens, too deep."""

    slug = "invalid-lineage"
    title = "Artifact lineage does not join up"
    default_hint = (
        "publish the parent first, and capture the child from it ('kvgraft capture --parent'): a child starts at its "
        "parent's end and covers at least one token"
    )


# --- operational (no HTTP request involved, or the server's own state) -------------------------


class DataDirError(RegistryError):
    """The data directory cannot be used (missing, unreadable, wrong permissions)."""

    slug = "data-dir"
    title = "Data directory unusable"
    default_hint = "pass --data DIR pointing at the registry's data directory"


class DatabaseLockedError(DataDirError):
    """Another process holds the DuckDB file (a running server, or another admin command)."""

    status_code = 503
    slug = "database-locked"
    title = "Database locked"
    default_hint = "stop the other process, or run admin commands while the server runs (they go through it)"


class SchemaVersionError(DataDirError):
    """The database was written by a newer kvgraft, or a migration failed."""

    slug = "schema-version"
    title = "Database schema version"
    default_hint = "upgrade kvgraft to a version that knows this database's schema"


class LogIntegrityError(DataDirError):
    """The stored log does not match its latest signed checkpoint, or its signing key."""

    slug = "log-integrity"
    title = "Log integrity failure"
    default_hint = "restore the data directory from a backup; do not serve a log that disagrees with its checkpoints"


class LogRollbackError(LogIntegrityError):
    """The database's log is behind, or differs from, the last tree head this registry signed (signed-head.json)."""

    slug = "log-rollback"
    title = "Log rolled back"
    default_hint = (
        "restore registry.duckdb (with its .wal) from a backup taken at or after that tree size; never delete "
        "signed-head.json to get past this: clients that saw the newer checkpoint would see a forked log"
    )


class SignedHeadWriteError(RegistryError):
    """The signed tree head could not be saved beside the database; the entry is recorded but not yet announced."""

    slug = "signed-head-write"
    title = "Signed tree head not saved"
    default_hint = "free disk space or fix the data directory's permissions, then post the envelope again (idempotent)"


class ConfigError(DataDirError):
    """A setting conflicts with the data directory (e.g. a different origin)."""

    slug = "config"
    title = "Configuration error"
    default_hint = "check the settings passed to 'kvgraft serve'"


class AdminUnavailableError(DataDirError):
    """An admin command could reach neither the database nor the running server."""

    status_code = 503
    slug = "admin-unavailable"
    title = "Admin interface unavailable"
    default_hint = "check that the server is running and that admin.json in the data directory is current"


# --- a database shared by several server processes (PostgreSQL; db.py, cluster.py) --------------


class RetryLaterError(RegistryError):
    """A 503 whose ``Retry-After`` says when the same request may succeed (nothing was changed)."""

    status_code = 503

    def __init__(self, message: str, *, retry_after: int, hint: str | None = None, extra: dict[str, Any] | None = None) -> None:
        super().__init__(message, hint=hint, extra={**(extra or {}), "retry_after": retry_after})
        self.retry_after = retry_after

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after)}


class UploadsBusyError(RetryLaterError):
    """The blob store's memory budget for uploads in flight is spent: this upload was not read."""

    slug = "uploads-busy"
    title = "Too many uploads in flight"
    default_hint = "wait for the number of seconds in Retry-After, then upload the blob again (nothing of it was kept)"


class PublishQueueFullError(RetryLaterError):
    """The sequencer's queue of verified publishes is full (or it is shutting down): nothing was logged."""

    slug = "publish-queue-full"
    title = "Publish queue full"
    default_hint = "wait for the number of seconds in Retry-After, then post the envelope again (publishing is idempotent)"


class DatabaseUnavailableError(RetryLaterError):
    """The PostgreSQL server cannot be reached (down, restarting, or the connection dropped)."""

    slug = "database-unavailable"
    title = "Database unavailable"
    default_hint = "retry after the number of seconds in Retry-After; the operator must check the registry's PostgreSQL server"


class DatabaseConflictError(RetryLaterError):
    """Another server process changed the same rows at the same moment; nothing of this request was kept."""

    slug = "database-conflict"
    title = "Concurrent change"
    default_hint = "send the same request again (publishing is idempotent)"


class NotSequencerError(RetryLaterError):
    """This server process does not hold the sequencer lease now: it serves reads, and refuses publishes."""

    slug = "not-sequencer"
    title = "Not the sequencer"
    default_hint = (
        "post the envelope to the sequencing server named in this problem, or again after Retry-After "
        "(publishing is idempotent; a proxy in front can retry the next server on 503)"
    )


# --- request size and storage (the HTTP edge) ----------------------------------------------------


class HeadersTooLargeError(RegistryError):
    """The request's headers are larger, or more numerous, than the registry accepts."""

    status_code = 431
    slug = "headers-too-large"
    title = "Request header fields too large"
    default_hint = "send fewer and shorter headers; the limits are the registry's max_header_bytes and max_header_count"


class InsufficientStorageError(RegistryError):
    """The registry's disk (or quota) is full: nothing was stored."""

    status_code = 507
    slug = "insufficient-storage"
    title = "Insufficient storage"
    default_hint = "retry later; the registry's operator must free disk space (nothing of this request was kept)"


class StorageUnavailableError(RegistryError):
    """The registry's data directory cannot be written (read-only file system, permissions)."""

    status_code = 503
    slug = "storage-unavailable"
    title = "Storage unavailable"
    default_hint = "retry later; the registry's operator must make its data directory writable again"


#: errno values (by name, as the ``errno`` module spells them) meaning the disk or quota is full.
_FULL_ERRNOS = ("ENOSPC", "EDQUOT", "EFBIG")
#: errno values meaning the data directory cannot be written at all.
_UNWRITABLE_ERRNOS = ("EROFS", "EACCES", "EPERM")
#: How DuckDB and other libraries word the same failures in their own exceptions' messages.
_FULL_WORDS = ("no space left on device", "disk quota exceeded", "file too large")
_UNWRITABLE_WORDS = ("read-only file system", "permission denied", "operation not permitted")


def storage_error(exc: BaseException, what: str) -> RegistryError | None:
    """The 507/503 error that ``exc`` (an ``OSError``, or a library error wrapping one) stands for.

    ``what`` says what failed ("the blob could not be stored"). None when ``exc`` is not a
    storage failure. The message names no file: paths stay in the server log.
    """
    code = exc.errno if isinstance(exc, OSError) else None
    text = str(exc).lower()
    if code in {getattr(errno_names, n, -1) for n in _FULL_ERRNOS} or (code is None and any(w in text for w in _FULL_WORDS)):
        return InsufficientStorageError(f"{what}: the registry's disk is full")
    if code in {getattr(errno_names, n, -1) for n in _UNWRITABLE_ERRNOS} or (
        code is None and any(w in text for w in _UNWRITABLE_WORDS)
    ):
        return StorageUnavailableError(f"{what}: the registry's data directory is not writable")
    return None


# --- the witness (c2sp.org/tlog-witness add-checkpoint; registry/_internal/witness.py) ---------


class AddCheckpointRequestError(BadRequestError):
    """An add-checkpoint body is malformed: the old size line, a proof line, the blank line, the note."""

    slug = "malformed-add-checkpoint"
    title = "Malformed add-checkpoint request"
    default_hint = (
        "send 'old <size>', up to 63 base64 consistency proof lines, an empty line, then the signed checkpoint "
        "(c2sp.org/tlog-witness)"
    )


class UnknownLogError(NotFoundError):
    """The witness is not configured for the checkpoint's origin (or has cosigned nothing for it)."""

    slug = "unknown-log"
    title = "Unknown log"
    default_hint = "ask the witness's operator to add the log's vkey (kvgraft witness serve --log VKEY)"


class CheckpointSignatureError(RegistryError):
    """The checkpoint carries no valid signature by a key the witness trusts for its origin."""

    status_code = 403
    slug = "checkpoint-signature"
    title = "Checkpoint not signed by the log"
    default_hint = "sign the checkpoint with the log key the witness was configured with"


class OldSizeConflictError(RegistryError):
    """The old size is not the size of the last checkpoint the witness cosigned for the log.

    Answered 409 with ``Content-Type: text/x.tlog.size`` and that size (decimal, newline) as the
    body, as c2sp.org/tlog-witness requires, not as a problem document.
    """

    status_code = 409
    slug = "old-size-mismatch"
    title = "Old size does not match"
    default_hint = "send the consistency proof from the size in this answer"

    def __init__(self, message: str, *, size: int, hint: str | None = None) -> None:
        super().__init__(message, hint=hint, extra={"size": size})
        self.size = size


class InconsistentCheckpointError(RegistryError):
    """The checkpoint is not proved to extend the one the witness last cosigned (a fork, a bad proof)."""

    status_code = 422
    slug = "inconsistent-checkpoint"
    title = "Checkpoint does not extend the witnessed one"
    default_hint = (
        "send a consistency proof from the witness's size to this checkpoint's; if the log cannot produce one, "
        "it forked or was rolled back"
    )


class WitnessStateError(DataDirError):
    """The witness's state directory cannot be used: locked by another witness, unreadable, or damaged."""

    slug = "witness-state"
    title = "Witness state unusable"
    default_hint = "check the witness's --state directory; restore a damaged file from a backup, never edit it"


class WitnessSubmissionError(RegistryError):
    """A witness did not cosign the registry's checkpoint (unreachable, refused, or a bad answer).

    Raised and logged by the background collector only (registry/_internal/cosignatures.py): it
    never reaches an HTTP answer, and publishing never waits for it.
    """

    status_code = 502
    slug = "witness-submission"
    title = "Witness did not cosign"
    default_hint = "check that the witness runs and watches this log (kvgraft witness serve --log VKEY); it is retried"
