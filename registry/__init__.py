"""The registry service: Litestar + DuckDB, blob store, transparency log (extra ``registry``).

``create_app(data_dir, settings)`` builds the Litestar app (``kvgraft serve`` runs it under
uvicorn); ``RegistrySettings`` holds its limits and where blobs live (the data directory, or an
S3-compatible object store that ``S3Settings`` says how to reach). Every failure is a
``RegistryError`` whose class fixes the HTTP status and the RFC 9457 problem type. The HTTP API is documented in
docs/registry.md.

``serve`` (uvicorn over a data directory), ``admin_session`` (tokens and keys, through a running
server or the database) and ``fsck`` (check a stopped registry's data) are what the ``kvgraft
serve``, ``token``, ``key`` and ``fsck`` commands run (``kvgraft/cli/serve.py``).
``create_witness_app``/``serve_witness`` (with ``WitnessSettings``) are the c2sp.org/tlog-witness
cosigner ``kvgraft witness serve`` runs (``kvgraft/cli/witness.py``, docs/witness.md).

Importing this package does not import litestar or duckdb: ``create_app``, ``serve``,
``admin_session`` and ``fsck`` load them on first use, so ``kvgraft`` commands that need no
server work without the ``registry`` extra.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._internal.blobconfig import S3Settings
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
    from ._internal.admin import admin_session
    from ._internal.fsck import fsck
    from ._internal.http.app import create_app
    from ._internal.log.cosignatures import parse_witness_option
    from ._internal.server import serve
    from ._internal.tiles import ExportReport, export_tiles
    from ._internal.witness.cosigner import (
        DEFAULT_WITNESS_MAX_BODY_BYTES,
        WitnessSettings,
        create_witness_app,
        serve_witness,
    )

__all__ = [
    "AuthenticationError", "BadDigestError", "BadRequestError", "BlobDigestMismatchError", "InvalidSignatureError",
    "InvalidStatementError", "KeyNotBoundError", "MissingBlobsError", "NotFoundError", "PayloadTooLargeError",
    "RangeNotSatisfiableError", "RegistryError", "RegistrySettings", "S3Settings", "TokenRevokedError", "create_app",
    "admin_session", "fsck", "serve",
    "DEFAULT_WITNESS_MAX_BODY_BYTES", "WitnessSettings", "create_witness_app", "parse_witness_option", "serve_witness",
    "ExportReport", "export_tiles",
]


#: Loaded on first use, each from its ``_internal`` module: the app pulls in litestar, duckdb and
#: anyio; the server uvicorn; the admin commands and fsck open DuckDB.
_LAZY = {"create_app": "http.app", "serve": "server", "admin_session": "admin", "fsck": "fsck"}
#: The witness (``kvgraft witness serve``): its app loads litestar, its server uvicorn, on first use.
_LAZY |= dict.fromkeys(
    ("DEFAULT_WITNESS_MAX_BODY_BYTES", "WitnessSettings", "create_witness_app", "serve_witness"), "witness.cosigner"
) | {"parse_witness_option": "log.cosignatures"}
#: ``kvgraft tiles export``: reads the database read-only (DuckDB) on first use.
_LAZY |= dict.fromkeys(("ExportReport", "export_tiles"), "tiles")


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"._internal.{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
