"""The registry's settings: limits, read access, the log's origin, the blob store."""

from __future__ import annotations

from dataclasses import dataclass

from .blobconfig import S3Settings, parse_blob_store_url

#: 1 TiB: well above any KV artifact; operators lower it with --max-blob-bytes.
DEFAULT_MAX_BLOB_BYTES = 1 << 40
#: Envelopes are statements, not tensors; the verifier reads at most 64 MiB, so accept less.
DEFAULT_MAX_ENVELOPE_BYTES = 16 * 1024 * 1024
#: Per-token requests per second, sustained, and at once: well above what one publisher's
#: client does (it sends one request per blob and one per entry), low enough that a leaked
#: token cannot flood the log.
DEFAULT_RATE_LIMIT = 50.0
DEFAULT_RATE_BURST = 200
#: Search: at most this many words per query, and this many characters in the query string.
#: A real search names a few words; each word is one index lookup.
DEFAULT_MAX_SEARCH_TERMS = 8
DEFAULT_MAX_QUERY_LENGTH = 256
#: Signatures per posted envelope: kvgraft signs with one key, thresholds need a few.
DEFAULT_MAX_SIGNATURES = 16
#: Request headers: total bytes and count (nginx's large_client_header_buffers is 4 x 8 KiB).
DEFAULT_MAX_HEADER_BYTES = 32 * 1024
DEFAULT_MAX_HEADER_COUNT = 100
#: The longest parent chain the registry accepts or walks (a real chain is a handful deep).
DEFAULT_MAX_LINEAGE_DEPTH = 256
#: Nesting depth of any JSON document a stranger sends (statements nest about 6 deep).
DEFAULT_MAX_JSON_DEPTH = 64
#: Signature verifications remembered per envelope digest, so a page view never re-verifies.
DEFAULT_VERIFY_CACHE_ENTRIES = 4096
#: Blobs at most this large are re-hashed each time they are served (blob rot is caught at once).
DEFAULT_VERIFY_ON_READ_BYTES = 1024 * 1024
#: Seconds one add-checkpoint request to a witness may take (it answers in milliseconds when up).
DEFAULT_WITNESS_TIMEOUT = 10.0
#: Publishes appended in one batch at most (one transaction, one signed checkpoint): what one
#: level-0 c2sp.org/tlog-tiles tile holds.
DEFAULT_BATCH_MAX_ENTRIES = 256
#: Milliseconds the sequencer waits, after the first publish of a batch, for more on their way to join it.
DEFAULT_BATCH_WAIT_MS = 5.0
#: Verified publishes waiting for the sequencer, at most, by count and by envelope bytes.
DEFAULT_MAX_PUBLISH_QUEUE = 1024
DEFAULT_MAX_PUBLISH_QUEUE_BYTES = 256 * 1024 * 1024
#: URL schemes of a PostgreSQL metadata database (libpq's two spellings; db.py).
POSTGRES_SCHEMES = ("postgresql://", "postgres://")


@dataclass(frozen=True)
class RegistrySettings:
    """How a registry serves its data directory.

    ``origin`` names the log in its checkpoints; it is fixed when the data directory is first
    initialised (default ``kvgraft-registry/<first 16 hex digits of the registry key id>``) and
    a different value later is refused. ``admin_url`` is where admin commands reach this
    server (``kvgraft serve`` sets it); it is written, with a fresh admin secret, to
    ``admin.json`` in the data directory while the server runs.
    """

    origin: str | None = None
    max_blob_bytes: int = DEFAULT_MAX_BLOB_BYTES
    max_envelope_bytes: int = DEFAULT_MAX_ENVELOPE_BYTES
    #: When true, reads need a valid (unrevoked) bearer token too.
    reads_require_token: bool = False
    default_page_limit: int = 50
    max_page_limit: int = 500
    admin_url: str | None = None
    #: How long startup waits for another process (an admin command) to release the database.
    lock_wait_seconds: float = 10.0
    #: Requests per second each token may make on average (0: no limit); see ratelimit.py.
    rate_limit: float = DEFAULT_RATE_LIMIT
    #: Requests each token may make at once before the average applies.
    rate_burst: int = DEFAULT_RATE_BURST
    #: Words per search query, and characters in the whole query string.
    max_search_terms: int = DEFAULT_MAX_SEARCH_TERMS
    max_query_length: int = DEFAULT_MAX_QUERY_LENGTH
    #: Signatures per posted envelope; more is refused with 413 before any is verified.
    max_signatures: int = DEFAULT_MAX_SIGNATURES
    #: Total bytes and number of request headers; more is answered 431.
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES
    max_header_count: int = DEFAULT_MAX_HEADER_COUNT
    #: The deepest parent chain accepted at publish and walked on a lineage view.
    max_lineage_depth: int = DEFAULT_MAX_LINEAGE_DEPTH
    #: Nesting depth of posted JSON.
    max_json_depth: int = DEFAULT_MAX_JSON_DEPTH
    #: Signature verification results cached per envelope digest.
    verify_cache_entries: int = DEFAULT_VERIFY_CACHE_ENTRIES
    #: Blobs up to this size are re-hashed when served; a mismatch quarantines the blob.
    verify_on_read_bytes: int = DEFAULT_VERIFY_ON_READ_BYTES
    #: Seconds between background scrubs of every blob (0: no background scrub).
    scrub_interval: float = 0.0
    #: The registry's own public base URL (e.g. ``https://registry.example``), used in the commands
    #: the pages tell users to paste; never taken from the request's ``Host`` header.
    public_url: str | None = None
    #: Witnesses to collect cosignatures from: (witness vkey, submission prefix URL) pairs
    #: (``kvgraft serve --witness VKEY=URL``; docs/witness.md). Checked when the app starts.
    witnesses: tuple[tuple[str, str], ...] = ()
    #: Seconds one add-checkpoint request to a witness may take.
    witness_timeout: float = DEFAULT_WITNESS_TIMEOUT
    #: Publishes appended per batch at most (sequencer.py): one transaction and one checkpoint each.
    batch_max_entries: int = DEFAULT_BATCH_MAX_ENTRIES
    #: Milliseconds a batch waits, after its first, for publishes being read or verified (0: only
    #: those already queued; with none on its way a batch never waits).
    batch_wait_ms: float = DEFAULT_BATCH_WAIT_MS
    #: Verified publishes queued for the sequencer at most, and their envelopes' bytes; past
    #: either, a publish is answered 503 with Retry-After.
    max_publish_queue: int = DEFAULT_MAX_PUBLISH_QUEUE
    max_publish_queue_bytes: int = DEFAULT_MAX_PUBLISH_QUEUE_BYTES
    #: Where blobs live: None for the data directory's ``blobs/`` (the default), or an
    #: S3-compatible object store, ``s3://BUCKET[/PREFIX]`` (blobconfig.py, s3blobs.py).
    blob_store: str | None = None
    #: The operator copied every blob to ``blob_store`` (or, with None, into the data directory):
    #: record it as the log's blob store instead of refusing a start on another one (datadir.py).
    blob_store_moved: bool = False
    #: How to reach that object store (endpoint, credentials, part size, timeouts, retries).
    s3: S3Settings = S3Settings()
    #: The metadata database: None for DuckDB's ``DATA/registry.duckdb`` (the default), or a
    #: PostgreSQL URL (``postgresql://USER@HOST:PORT/DBNAME``) that several server processes
    #: share, one of them sequencing the log at a time (db.py, cluster.py).
    database: str | None = None
    #: On a shared (PostgreSQL) database: a data directory without ``signed-head.json`` takes the
    #: database's head as its own, once, loudly (a new server joining). Without it such a start is
    #: refused: the directory cannot tell a current database from one restored from an older copy.
    adopt_database_head: bool = False

    def __post_init__(self) -> None:
        for name in (
            "max_blob_bytes",
            "max_envelope_bytes",
            "default_page_limit",
            "max_page_limit",
            "max_search_terms",
            "max_query_length",
            "max_signatures",
            "max_header_bytes",
            "max_header_count",
            "max_lineage_depth",
            "max_json_depth",
            "verify_cache_entries",
            "batch_max_entries",
            "max_publish_queue",
            "max_publish_queue_bytes",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"RegistrySettings.{name} must be a positive int, got {value!r}")
        if isinstance(self.rate_limit, bool) or not isinstance(self.rate_limit, int | float) or not 0 <= self.rate_limit < float("inf"):
            raise ValueError(f"RegistrySettings.rate_limit must be a finite number >= 0, got {self.rate_limit!r}")
        if isinstance(self.rate_burst, bool) or not isinstance(self.rate_burst, int) or self.rate_burst < 1:
            raise ValueError(f"RegistrySettings.rate_burst must be a positive int, got {self.rate_burst!r}")
        if isinstance(self.verify_on_read_bytes, bool) or not isinstance(self.verify_on_read_bytes, int) or self.verify_on_read_bytes < 0:
            raise ValueError(f"RegistrySettings.verify_on_read_bytes must be an int >= 0, got {self.verify_on_read_bytes!r}")
        if isinstance(self.scrub_interval, bool) or not isinstance(self.scrub_interval, int | float) or not 0 <= self.scrub_interval < float("inf"):
            raise ValueError(f"RegistrySettings.scrub_interval must be a finite number >= 0, got {self.scrub_interval!r}")
        if not isinstance(self.witnesses, tuple) or not all(
            isinstance(w, tuple) and len(w) == 2 and all(isinstance(x, str) and x for x in w) for w in self.witnesses
        ):
            raise ValueError("RegistrySettings.witnesses must be a tuple of (vkey, url) string pairs")
        if isinstance(self.witness_timeout, bool) or not isinstance(self.witness_timeout, int | float) or not 0 < self.witness_timeout < float("inf"):
            raise ValueError(f"RegistrySettings.witness_timeout must be a finite number > 0, got {self.witness_timeout!r}")
        if isinstance(self.batch_wait_ms, bool) or not isinstance(self.batch_wait_ms, int | float) or not 0 <= self.batch_wait_ms <= 1000:
            raise ValueError(f"RegistrySettings.batch_wait_ms must be a number from 0 to 1000, got {self.batch_wait_ms!r}")
        if self.default_page_limit > self.max_page_limit:
            raise ValueError("RegistrySettings.default_page_limit must not exceed max_page_limit")
        if self.blob_store is not None:
            parse_blob_store_url(self.blob_store)
        if not isinstance(self.blob_store_moved, bool):
            raise ValueError(f"RegistrySettings.blob_store_moved must be a bool, got {self.blob_store_moved!r}")
        if self.database is not None and not (isinstance(self.database, str) and self.database.startswith(POSTGRES_SCHEMES)):
            raise ValueError("RegistrySettings.database must be a postgresql:// URL or None (the DuckDB file)")
        if not isinstance(self.adopt_database_head, bool):
            raise ValueError(f"RegistrySettings.adopt_database_head must be a bool, got {self.adopt_database_head!r}")
        if not isinstance(self.s3, S3Settings):
            raise ValueError(f"RegistrySettings.s3 must be an S3Settings, got {self.s3!r}")
