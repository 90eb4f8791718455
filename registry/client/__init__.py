"""The registry client: publish, pull and mirror over the HTTP API, built on httpx.

Every answer the registry gives is checked here, never trusted: a published entry's leaf is
recomputed from the envelope bytes and its inclusion proof is verified against a checkpoint
signed by the registry key; a pulled artifact's blobs are hashed while they stream, its
statement's subjects must be exactly the downloaded files, and its envelope is proved to be in
the log before the directory appears; a mirror ends with the target's signed tree at the copied
size equal to the source's, and a consistency proof from there to the target's current size.
Every JSON answer is parsed into the shared wire models of ``kvgraft.schemas`` (the types the
service answers with), strictly: an answer of the wrong shape is one ``RegistryResponseError``.

Blobs stream both ways in 1 MiB chunks, so memory stays flat in the blob size. The registry key
is either pinned (a PEM file) or fetched from ``/v1/log/key`` and reported as trust on first use.
With a witness policy (``RegistryClient(witness_policy=...)``, ``witness_policy_from``:
``--witness-policy`` or ``$KVGRAFT_WITNESS_POLICY``, docs/witness.md) every checkpoint must also
carry the witness cosignatures its quorum needs (``UnwitnessedCheckpointError`` otherwise).

Nor are the registry's sizes and pace trusted (``ClientLimits``): every request has one total
deadline, JSON answers, blobs and listings are bounded, and every checkpoint verified is
compared with the newest one this machine verified before for the same log
(``CheckpointMemory``, under ``$KVGRAFT_HOME``).

One module per job:

- ``transport``: the bounded HTTP layer (``ClientLimits``, one total deadline per request,
  bounded bodies, JSON read into wire models, error documents mapped to errors);
- ``http``: ``RegistryClient``, one typed method per endpoint of the API, over ``transport``;
- ``progress``: the progress bars (or plain lines) of the long steps;
- ``evidence``: the registry key, checkpoints, inclusion and consistency proofs, the
  remembered checkpoint per log;
- ``store``: local artifact and record directories, the local index, staged writes;
- ``publish``, ``pull``, ``mirror``: the three operations and their results;
- ``errors``: the ``RegistryClientError`` tree.

This package needs httpx (the ``registry`` extra) but not litestar, duckdb, uvicorn or the
server's modules; the ``kvgraft`` commands import it only when a command runs.
"""

from __future__ import annotations

from kvgraft.schemas import KV_FILE, RECORD_FILE, STATEMENT_FILE, kvgraft_home

from .errors import (
    AmbiguousDigestError,
    BlobDigestError,
    CheckpointMemoryError,
    DiskFullError,
    EnvelopeSignatureError,
    EvidenceError,
    ListingError,
    LocalFilesError,
    LogForkError,
    MirrorDivergedError,
    ParentNotPublishedError,
    RegistryAuthError,
    RegistryClientError,
    RegistryNotFoundError,
    RegistryResponseError,
    RegistryUnavailableError,
    ResponseTooLargeError,
    UnwitnessedCheckpointError,
)
from .evidence import (
    NO_MEMORY,
    WITNESS_POLICY_ENV,
    CheckpointMemory,
    RegistryKey,
    RememberedHead,
    registry_key,
    witness_policy_from,
)
from .http import CHUNK, DEFAULT_WITNESS_WAIT, PAGE_LIMIT, RegistryClient
from .mirror import MirrorResult, mirror
from .progress import Progress
from .publish import MAX_CHAIN, PublishResult, publish
from .pull import PullResult, pull
from .records import RecordPullResult, pull_record
from .store import (
    MAX_ENVELOPE_BYTES,
    LocalEntry,
    commit,
    envelope_file,
    find_local_artifact,
    local_write_error,
    read_local,
    safe_path,
    stage,
    statement_of,
)
from .transport import (
    DEFAULT_MAX_BLOB_BYTES,
    DEFAULT_MAX_ITEMS,
    DEFAULT_MAX_JSON_BYTES,
    DEFAULT_MAX_JSON_DEPTH,
    DEFAULT_MAX_NOTE_BYTES,
    DEFAULT_MAX_PAGES,
    DEFAULT_MAX_PROBLEM_BYTES,
    DEFAULT_MIN_RATE,
    DEFAULT_TIMEOUT,
    ClientLimits,
    parse_json_answer,
)

__all__ = [
    "BlobDigestError", "CHUNK", "CheckpointMemory", "CheckpointMemoryError", "ClientLimits", "DEFAULT_MAX_BLOB_BYTES",
    "DEFAULT_MAX_ITEMS", "DEFAULT_MAX_JSON_BYTES", "DEFAULT_MAX_JSON_DEPTH", "DEFAULT_MAX_NOTE_BYTES",
    "DEFAULT_MAX_PAGES", "DEFAULT_MAX_PROBLEM_BYTES", "DEFAULT_MIN_RATE", "DEFAULT_TIMEOUT", "DiskFullError",
    "EnvelopeSignatureError", "EvidenceError", "KV_FILE", "ListingError", "LocalEntry", "LocalFilesError",
    "LogForkError", "MAX_CHAIN", "MAX_ENVELOPE_BYTES", "MirrorDivergedError", "MirrorResult", "NO_MEMORY",
    "PAGE_LIMIT", "ParentNotPublishedError", "Progress", "PublishResult", "PullResult", "RECORD_FILE",
    "AmbiguousDigestError", "RegistryAuthError", "RegistryClient", "RegistryClientError", "RegistryKey", "RegistryNotFoundError",
    "RegistryResponseError", "RegistryUnavailableError", "RememberedHead", "ResponseTooLargeError", "STATEMENT_FILE",
    "commit", "envelope_file", "find_local_artifact", "kvgraft_home", "local_write_error", "mirror", "parse_json_answer",
    "publish", "pull", "pull_record", "RecordPullResult", "read_local", "registry_key", "safe_path", "stage", "statement_of",
    "DEFAULT_WITNESS_WAIT", "UnwitnessedCheckpointError", "WITNESS_POLICY_ENV", "witness_policy_from",
]
