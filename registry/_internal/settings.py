"""The registry's settings: limits, read access, the log's origin."""

from __future__ import annotations

from dataclasses import dataclass

#: 1 TiB: well above any KV artifact; operators lower it with --max-blob-bytes.
DEFAULT_MAX_BLOB_BYTES = 1 << 40
#: Envelopes are statements, not tensors; the verifier reads at most 64 MiB, so accept less.
DEFAULT_MAX_ENVELOPE_BYTES = 16 * 1024 * 1024
#: Per-token requests per second, sustained, and at once: well above what one publisher's
#: client does (it sends one request per blob and one per entry), low enough that a leaked
#: token cannot flood the log.
DEFAULT_RATE_LIMIT = 50.0
DEFAULT_RATE_BURST = 200


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

    def __post_init__(self) -> None:
        for name in ("max_blob_bytes", "max_envelope_bytes", "default_page_limit", "max_page_limit"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"RegistrySettings.{name} must be a positive int, got {value!r}")
        if isinstance(self.rate_limit, bool) or not isinstance(self.rate_limit, int | float) or not 0 <= self.rate_limit < float("inf"):
            raise ValueError(f"RegistrySettings.rate_limit must be a finite number >= 0, got {self.rate_limit!r}")
        if isinstance(self.rate_burst, bool) or not isinstance(self.rate_burst, int) or self.rate_burst < 1:
            raise ValueError(f"RegistrySettings.rate_burst must be a positive int, got {self.rate_burst!r}")
        if self.default_page_limit > self.max_page_limit:
            raise ValueError("RegistrySettings.default_page_limit must not exceed max_page_limit")
