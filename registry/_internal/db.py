"""The DuckDB file: one connection, serialised by a lock, with versioned migrations.

DuckDB lets one process write a database file, and a connection runs one query at a time, so
the registry holds exactly one connection and every use of it takes ``Database.lock``. Calls
are blocking; the app runs them in worker threads, never on the event loop.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import duckdb

from . import cosignatures, search
from .errors import DatabaseLockedError, DataDirError, SchemaVersionError

logger = logging.getLogger("kvgraft.registry")

DB_FILE = "registry.duckdb"


@dataclass(frozen=True)
class Migration:
    """One schema step: applied once, in order, inside a transaction.

    ``backfill``, when set, runs after the statements in the same transaction: it fills new
    tables from existing rows with the same code that fills them for new entries.
    """

    version: int
    description: str
    statements: tuple[str, ...]
    backfill: Callable[[duckdb.DuckDBPyConnection], None] | None = None


# Append new migrations; never edit an applied one (databases in the field have run it).
MIGRATIONS: tuple[Migration, ...] = (
    Migration(
        1,
        "publishers, keys, tokens, log entries and checkpoints",
        (
            "CREATE TABLE meta (key VARCHAR PRIMARY KEY, value VARCHAR NOT NULL)",
            "CREATE TABLE publishers (name VARCHAR PRIMARY KEY, created_at VARCHAR NOT NULL)",
            """CREATE TABLE publisher_keys (
                keyid VARCHAR PRIMARY KEY,
                publisher VARCHAR NOT NULL,
                public_key_pem VARCHAR NOT NULL,
                created_at VARCHAR NOT NULL)""",
            """CREATE TABLE tokens (
                token_id VARCHAR PRIMARY KEY,
                token_hash VARCHAR NOT NULL UNIQUE,
                publisher VARCHAR NOT NULL,
                created_at VARCHAR NOT NULL,
                revoked_at VARCHAR)""",
            """CREATE TABLE token_keys (
                token_id VARCHAR NOT NULL,
                keyid VARCHAR NOT NULL,
                PRIMARY KEY (token_id, keyid))""",
            # One row per log leaf: log_index is the leaf's position, digest the sha256 of the
            # envelope bytes, which are the leaf data.
            """CREATE TABLE entries (
                log_index BIGINT PRIMARY KEY,
                digest VARCHAR NOT NULL UNIQUE,
                leaf_hash BLOB NOT NULL,
                envelope BLOB NOT NULL,
                payload_type VARCHAR NOT NULL,
                predicate_type VARCHAR NOT NULL,
                kind VARCHAR NOT NULL,
                publisher VARCHAR NOT NULL,
                keyids VARCHAR[] NOT NULL,
                token_id VARCHAR,
                integrated_at VARCHAR NOT NULL,
                artifact_digest VARCHAR,
                model_name VARCHAR,
                model_weights_digest VARCHAR,
                model_config_digest VARCHAR,
                profile_name VARCHAR,
                parent VARCHAR,
                chain_key VARCHAR,
                position_start BIGINT,
                position_end BIGINT,
                source_text VARCHAR,
                source_text_digest VARCHAR)""",
            """CREATE TABLE entry_subjects (
                log_index BIGINT NOT NULL,
                name VARCHAR NOT NULL,
                digest VARCHAR NOT NULL,
                PRIMARY KEY (log_index, name))""",
            # What an entry points at besides its subjects: a parent artifact, the artifacts a
            # record measured, a replay's pre-registration.
            """CREATE TABLE entry_refs (
                log_index BIGINT NOT NULL,
                ref VARCHAR NOT NULL,
                role VARCHAR NOT NULL,
                PRIMARY KEY (log_index, ref, role))""",
            """CREATE TABLE checkpoints (
                tree_size BIGINT PRIMARY KEY,
                root_hash BLOB NOT NULL,
                note BLOB NOT NULL,
                created_at VARCHAR NOT NULL)""",
            "CREATE INDEX entries_artifact ON entries (artifact_digest)",
            "CREATE INDEX entries_parent ON entries (parent)",
            "CREATE INDEX entry_refs_ref ON entry_refs (ref)",
            "CREATE INDEX entry_subjects_digest ON entry_subjects (digest)",
        ),
    ),
    # Search by an index of words, not one substring scan of every text per query word.
    Migration(2, "search index of artifacts' source text words", search.SEARCH_TABLE_DDL, backfill=search.backfill),
    # Witness cosignatures of the checkpoints (cosignatures.py); none exist before a witness is configured.
    Migration(3, "witness cosignatures of checkpoints", cosignatures.COSIGNATURES_TABLE_DDL),
)

_LOCK_PID = re.compile(r"\(PID (\d+)\)")


def now_utc() -> str:
    """The current time as RFC 3339 UTC with seconds, e.g. 2026-11-29T12:00:00Z."""
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _is_lock_conflict(e: duckdb.Error) -> bool:
    return isinstance(e, duckdb.IOException) and "lock" in str(e).lower()


class Database:
    """The registry's DuckDB connection. Use every query under ``lock``."""

    def __init__(self, path: Path, connection: duckdb.DuckDBPyConnection) -> None:
        self.path = path
        self._conn: duckdb.DuckDBPyConnection | None = connection
        #: Serialises every use of the connection (reentrant: a transaction runs queries).
        self.lock = threading.RLock()

    @classmethod
    def open(cls, data_dir: Path, *, wait_seconds: float = 0.0, create: bool = True) -> Database:
        """Open (creating when ``create``) ``DATA/registry.duckdb`` and apply pending migrations.

        Waits up to ``wait_seconds`` for another process to release the file; raises
        ``DatabaseLockedError`` (naming the holder's pid) when it does not.
        """
        path = data_dir / DB_FILE
        if not create and not path.exists():
            raise DataDirError(
                f"{data_dir} holds no registry database ({DB_FILE})",
                hint="check --data, or start the registry once with 'kvgraft serve --data DIR'",
            )
        deadline = time.monotonic() + wait_seconds
        while True:
            try:
                conn = duckdb.connect(str(path))
                break
            except duckdb.Error as e:
                if not _is_lock_conflict(e):
                    raise DataDirError(f"cannot open the registry database {path}: {e}") from e
                if time.monotonic() >= deadline:
                    pid = _LOCK_PID.search(str(e))
                    holder = f"process {pid.group(1)}" if pid else "another process"
                    raise DatabaseLockedError(
                        f"the registry database {path} is in use by {holder}", extra={"pid": int(pid.group(1)) if pid else None}
                    ) from e
                time.sleep(0.1)
        db = cls(path, conn)
        try:
            db.migrate()
        except BaseException:
            db.close()
            raise
        return db

    @property
    def conn(self) -> duckdb.DuckDBPyConnection:
        """The live connection; raises once closed."""
        if self._conn is None:
            raise DataDirError("the registry database was used after it was closed", hint="this is a bug in kvgraft")
        return self._conn

    def close(self, *, checkpoint: bool = True) -> None:
        """Checkpoint and close the connection (idempotent).

        With ``checkpoint=False`` the file and its WAL are left as they are (DuckDB's own
        checkpoint on shutdown is turned off too): a database refused at start stays exactly
        as it was found, for the operator to inspect or restore.
        """
        with self.lock:
            if self._conn is not None:
                with contextlib.suppress(duckdb.Error):
                    self._conn.execute("CHECKPOINT" if checkpoint else "PRAGMA disable_checkpoint_on_shutdown")
                self._conn.close()
                self._conn = None

    @contextlib.contextmanager
    def transaction(self) -> Iterator[duckdb.DuckDBPyConnection]:
        """Run the block in one transaction: committed when it ends, rolled back when it raises."""
        with self.lock:
            conn = self.conn
            conn.execute("BEGIN TRANSACTION")
            try:
                yield conn
            except BaseException:
                with contextlib.suppress(duckdb.Error):
                    conn.execute("ROLLBACK")
                raise
            conn.execute("COMMIT")

    def query(self, sql: str, params: list[Any] | tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        """Run one statement and fetch every row."""
        with self.lock:
            return self.conn.execute(sql, list(params)).fetchall()

    def query_one(self, sql: str, params: list[Any] | tuple[Any, ...] = ()) -> tuple[Any, ...] | None:
        """Run one statement and fetch the first row (or None)."""
        with self.lock:
            return self.conn.execute(sql, list(params)).fetchone()

    def schema_version(self) -> int:
        """The highest migration applied (0 for a new file)."""
        with self.lock:
            self.conn.execute(
                "CREATE TABLE IF NOT EXISTS schema_version (version INTEGER PRIMARY KEY, "
                "description VARCHAR NOT NULL, applied_at VARCHAR NOT NULL)"
            )
            row = self.conn.execute("SELECT max(version) FROM schema_version").fetchone()
        return int(row[0]) if row and row[0] is not None else 0

    def migrate(self, migrations: tuple[Migration, ...] = MIGRATIONS) -> list[int]:
        """Apply the migrations newer than the file's version, in order; return those applied."""
        current = self.schema_version()
        known = max((m.version for m in migrations), default=0)
        if current > known:
            raise SchemaVersionError(
                f"the registry database {self.path} has schema version {current}, newer than this kvgraft knows ({known})"
            )
        applied = []
        for migration in sorted(migrations, key=lambda m: m.version):
            if migration.version <= current:
                continue
            try:
                with self.transaction() as conn:
                    for statement in migration.statements:
                        conn.execute(statement)
                    if migration.backfill is not None:
                        migration.backfill(conn)
                    conn.execute(
                        "INSERT INTO schema_version VALUES (?, ?, ?)", [migration.version, migration.description, now_utc()]
                    )
            except duckdb.Error as e:
                raise SchemaVersionError(
                    f"migration {migration.version} ({migration.description}) failed on {self.path}: {e}",
                    hint="the database is unchanged by the failed step; restore a backup or report the error",
                ) from e
            logger.info("registry database %s: applied migration %d (%s)", self.path, migration.version, migration.description)
            applied.append(migration.version)
        return applied

    def get_meta(self, key: str) -> str | None:
        """A value of the ``meta`` table."""
        row = self.query_one("SELECT value FROM meta WHERE key = ?", [key])
        return None if row is None else str(row[0])

    def set_meta(self, key: str, value: str) -> None:
        """Set a value of the ``meta`` table."""
        with self.lock:
            self.conn.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", [key, value])
