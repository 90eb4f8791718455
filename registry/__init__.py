"""The registry service: Litestar + DuckDB, blob store, transparency log (extra ``registry``).

``create_app(data_dir, settings)`` builds the Litestar app (``kvgraft serve`` runs it under
uvicorn); ``RegistrySettings`` holds its limits. Every failure is a ``RegistryError`` whose
class fixes the HTTP status and the RFC 9457 problem type. The HTTP API is documented in
docs/registry.md.

Importing this package does not import litestar or duckdb: ``create_app`` loads them on first
use, so ``kvgraft`` commands that need no server work without the ``registry`` extra.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._internal.errors import (
    AuthenticationError,
    BadDigestError,
    BadRequestError,
    BlobDigestMismatchError,
    InvalidSignatureError,
    InvalidStatementError,
    KeyNotBoundError,
    MissingBlobsError,
    NotFoundError,
    PayloadTooLargeError,
    RangeNotSatisfiableError,
    RegistryError,
    TokenRevokedError,
)
from ._internal.settings import RegistrySettings

if TYPE_CHECKING:
    from ._internal.app import create_app

__all__ = [
    "AuthenticationError", "BadDigestError", "BadRequestError", "BlobDigestMismatchError", "InvalidSignatureError",
    "InvalidStatementError", "KeyNotBoundError", "MissingBlobsError", "NotFoundError", "PayloadTooLargeError",
    "RangeNotSatisfiableError", "RegistryError", "RegistrySettings", "TokenRevokedError", "create_app",
]


def __getattr__(name: str) -> Any:
    # Lazy: the app pulls in litestar, duckdb and anyio.
    if name == "create_app":
        from ._internal.app import create_app

        return create_app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
