"""The registry database: an embedded DuckDB file, or a PostgreSQL server, behind one API.

``Database`` is what every other module uses: ``transaction()`` (a connection whose
``execute(sql, params)`` returns rows through ``fetchone``/``fetchall``/``fetchmany``),
``query``, ``query_one``, ``get_meta``/``set_meta`` and the numbered migrations that each feature
registers in ``ddl.py`` (``schema_version``). The SQL is written once, in DuckDB's spelling: ``?`` placeholders,
``VARCHAR``/``BIGINT``/``BLOB`` and ``VARCHAR[]`` columns, ``INSERT ... ON CONFLICT`` upserts,
``array_agg``; statements that both engines accept as written are kept that way. What must
differ lives in one place, the ``Dialect`` of each engine, below: the placeholders and type
names PostgreSQL spells otherwise (``?`` -> ``%s``, ``BLOB`` -> ``BYTEA``; translated once per
statement text), how rows are inserted in bulk, what a checkpoint is, which errors mean what,
and the locks.

DuckDB (the default, ``DATA/registry.duckdb``): one process may write the file, and a
connection runs one query at a time, so the registry holds exactly one connection and every use
of it takes ``Database.lock``. Calls are blocking; the app runs them in worker threads, never on
the event loop.

PostgreSQL (``kvgraft serve --database postgresql://...``): several server processes share the
database. Each still holds one connection under ``Database.lock``, in autocommit mode with
explicit transactions, reconnecting after the server drops it; PostgreSQL's errors become
registry errors here (an unreachable server 503 ``DatabaseUnavailableError``, a concurrent
change 503 ``DatabaseConflictError``). Cross-process order comes from advisory locks on one
key class: ``LOG_LOCK`` (held while the log is appended to, and while a process reads the log
to start or to take the lease, so it never reads half of another's batch) and ``LEASE_LOCK``
(the sequencer lease, held for as long as its session lives; cluster.py). Every session a process
opens names it in its ``application_name``: ``kvgraft-registry <pid>.<random>`` (``session_tag``),
so that a process that finds the sequencer stopped can end exactly that process's sessions.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import functools
import logging
import os
import re
import secrets
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import duckdb

from ..errors import (
    DatabaseConflictError,
    DatabaseLockedError,
    DatabaseUnavailableError,
    DataDirError,
    RegistryError,
    SchemaVersionError,
)
from ..settings import POSTGRES_SCHEMES
from . import ddl
from .ddl import Connection, Migration, register

if TYPE_CHECKING:
    import psycopg

logger = logging.getLogger("kvgraft.registry")

DB_FILE = "registry.duckdb"
#: Seconds a connection attempt to PostgreSQL may take.
CONNECT_TIMEOUT = 10
#: Retry-After of a 503 for an unreachable database or a concurrent change.
RETRY_AFTER_SECONDS = 1
#: The advisory lock keys (``pg_advisory_lock(int4, int4)``): kvgraft's class ("kvgr"), then which.
LOCK_CLASS = 0x6B766772
LOG_LOCK = 1
LEASE_LOCK = 2
#: Seconds an append waits for ``LOG_LOCK`` before it gives up (503): another process holds it
#: while it reads the log to start or take over, or while it is paused (SIGSTOP, a VM freeze),
#: which its still-open session does not show. The sequencer waits under ``Database.lock``, so
#: an unbounded wait would stall this process's reads and every queued publish with it.
LOG_LOCK_WAIT_SECONDS = 30.0
#: LISTEN/NOTIFY channels: a new log head was committed; publishers, keys or tokens changed.
LOG_CHANNEL = "kvgraft_log"
ACCOUNTS_CHANNEL = "kvgraft_accounts"




#: Migration 1, the core tables; the features register theirs (ddl.py). Never edit an applied
#: migration (databases in the field have run it).
CORE_TABLES = register(
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
        owner=__name__,
    )
)

_LOCK_PID = re.compile(r"\(PID (\d+)\)")


def now_utc() -> str:
    """The current time as RFC 3339 UTC with seconds, e.g. 2026-11-29T12:00:00Z."""
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def insert_rows(conn: Connection, table: str, columns: Sequence[tuple[str, str]], rows: Sequence[Sequence[Any]]) -> None:
    """Insert ``rows`` into ``table`` in one statement (inside the caller's transaction).

    Each row holds one value per ``columns`` entry, a (name, SQL type) pair. Table and column
    names are the callers' constants, never request values. How is the engine's business
    (``Dialect.insert_rows``): DuckDB unnests one array per column, PostgreSQL pipelines the rows.
    """
    if not rows:
        return
    if any(len(row) != len(columns) for row in rows):
        raise ValueError(f"insert_rows({table}): a row does not hold one value for each of the {len(columns)} columns")
    dialect: Dialect = POSTGRES if isinstance(conn, PostgresConnection) else DUCKDB
    dialect.insert_rows(conn, table, columns, rows)


# --- the dialects ------------------------------------------------------------------------------


class Dialect:
    """What one engine does its own way; this class is DuckDB's, ``PostgresDialect`` PostgreSQL's."""

    #: The engine's name, as logs and problems say it.
    name = "DuckDB"
    #: Whether several server processes may use the database at once (and so need the lease).
    shared = False

    def insert_rows(self, conn: Connection, table: str, columns: Sequence[tuple[str, str]], rows: Sequence[Sequence[Any]]) -> None:
        """Insert ``rows`` in one statement: one array parameter per column, unnested side by side.

        DuckDB's cost per statement (about a millisecond) is paid once, not once per row: 256
        entry rows take about 12 ms so, 60 ms as one ``VALUES`` list and half a second with
        ``executemany``.
        """
        names = ", ".join(name for name, _ in columns)
        arrays = ", ".join(f"unnest(?::{sql_type}[])" for _, sql_type in columns)
        conn.execute(f"INSERT INTO {table} ({names}) SELECT {arrays}", [list(column) for column in zip(*rows, strict=True)])

    def checkpoint(self, conn: Connection) -> None:
        """Make committed writes durable in the main database file (DuckDB: fold the WAL in)."""
        conn.execute("CHECKPOINT")

    def lock_log(self, conn: Connection) -> None:
        """Inside a transaction: wait for, then hold until it ends, the right to append to the log.

        DuckDB: the process already holds the file, and ``Database.lock`` orders its threads.
        """

    def notify(self, conn: Connection, channel: str) -> None:
        """Inside a transaction: wake the other processes listening on ``channel`` once it commits.

        DuckDB: there are no other processes.
        """


class PostgresDialect(Dialect):
    """PostgreSQL: the same SQL with ``%s`` placeholders and ``BYTEA``, rows pipelined, advisory locks."""

    name = "PostgreSQL"
    shared = True

    def insert_rows(self, conn: Connection, table: str, columns: Sequence[tuple[str, str]], rows: Sequence[Sequence[Any]]) -> None:
        """Insert ``rows`` with one prepared ``INSERT`` sent for all of them in a pipeline (one round trip).

        Not DuckDB's unnest: PostgreSQL arrays are rectangular, so ``VARCHAR[]`` values (an
        entry's key ids) cannot travel as an array of arrays.
        """
        if not isinstance(conn, PostgresConnection):
            raise TypeError("PostgresDialect.insert_rows needs a PostgreSQL connection")
        names = ", ".join(name for name, _ in columns)
        marks = ", ".join("?" for _ in columns)
        conn.executemany(f"INSERT INTO {table} ({names}) VALUES ({marks})", rows)

    def checkpoint(self, conn: Connection) -> None:
        """Nothing to do: a commit is durable when PostgreSQL acknowledges it (its WAL is fsynced)."""

    def lock_log(self, conn: Connection) -> None:
        """``pg_advisory_xact_lock(LOG_LOCK)``: released by the commit or rollback, or if the session dies.

        Waits at most ``LOG_LOCK_WAIT_SECONDS`` (``lock_timeout``, for this transaction only), then
        raises ``DatabaseConflictError`` (503 with Retry-After); the transaction rolls back. The
        append's commit is made synchronous whatever the server's default: publishers are answered
        once it returns, so a ``synchronous_commit = off`` tuning must not let an answered entry
        (and its signed checkpoint) vanish in a server crash.
        """
        import psycopg

        conn.execute(
            "SELECT set_config('lock_timeout', ?, true), set_config('synchronous_commit', 'on', true)",
            [f"{int(LOG_LOCK_WAIT_SECONDS * 1000)}ms"],
        ).fetchall()
        try:
            conn.execute("SELECT pg_advisory_xact_lock(?, ?)", [LOCK_CLASS, LOG_LOCK]).fetchall()
        except RegistryError as e:
            if not isinstance(e.__cause__, psycopg.errors.LockNotAvailable):
                raise
            raise log_lock_timeout("nothing was logged") from e

    def notify(self, conn: Connection, channel: str) -> None:
        """``pg_notify(channel)``: delivered to every listening session when the transaction commits."""
        conn.execute("SELECT pg_notify(?, '')", [channel]).fetchall()

    # The sequencer lease (cluster.py): a session-level advisory lock on a connection of its own.

    def try_lease(self, conn: PostgresConnection) -> bool:
        """Take the lease if no session holds it (never waits); True when this session holds it now."""
        row = conn.execute("SELECT pg_try_advisory_lock(?, ?)", [LOCK_CLASS, LEASE_LOCK]).fetchone()
        return bool(row and row[0])

    def release_lease(self, conn: PostgresConnection) -> None:
        """Give the lease back, however many times the session took it (ending the session does too).

        The lease session holds no other advisory lock, so all of its own are released.
        """
        conn.execute("SELECT pg_advisory_unlock_all()").fetchall()

    def lease_held(self, conn: Connection, backend_pid: int) -> bool:
        """Whether the session of server process ``backend_pid`` holds the lease, as the database sees it now."""
        row = conn.execute(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND classid = CAST(? AS oid) "
            "AND objid = CAST(? AS oid) AND objsubid = 2 AND granted AND pid = ?",
            [LOCK_CLASS, LEASE_LOCK, backend_pid],
        ).fetchone()
        return bool(row and int(row[0]))

    def clock(self, conn: Connection) -> float:
        """The database server's clock (Unix seconds): the one clock every process of a cluster shares."""
        row = conn.execute("SELECT CAST(extract(epoch FROM clock_timestamp()) AS DOUBLE PRECISION)").fetchone()
        if row is None:
            raise RegistryError("the PostgreSQL database did not tell its time")
        return float(row[0])

    def end_lease_holder(self, conn: Connection, tag: str) -> int:
        """If the process marked ``tag`` (``session_tag``) holds the lease, end all its sessions; how many.

        Its transactions roll back and its advisory locks, the lease among them, are released. A
        process of that tag that does not hold the lease (it stepped down, and is a follower now)
        is left alone. Needs the same role as that process's, or ``pg_signal_backend``.
        """
        if not re.fullmatch(r"[0-9]{1,10}\.[0-9a-f]{8}", tag):
            raise ValueError(f"{tag[:40]!r} is not a session tag")
        pattern = f"kvgraft-registry% {tag}"
        rows = conn.execute(
            "SELECT pg_terminate_backend(a.pid) FROM pg_stat_activity a WHERE a.application_name LIKE ? "
            "AND a.pid <> pg_backend_pid() AND EXISTS (SELECT 1 FROM pg_locks l JOIN pg_stat_activity h ON h.pid = l.pid "
            "WHERE l.locktype = 'advisory' AND l.classid = CAST(? AS oid) AND l.objid = CAST(? AS oid) "
            "AND l.objsubid = 2 AND l.granted AND h.application_name LIKE ?)",
            [pattern, LOCK_CLASS, LEASE_LOCK, pattern],
        ).fetchall()
        return sum(1 for (ended,) in rows if ended)

    def listen(self, conn: PostgresConnection, channels: Sequence[str]) -> None:
        """Subscribe the session to ``channels`` (the registry's constants)."""
        for channel in channels:
            if not re.fullmatch(r"[a-z_]{1,63}", channel):
                raise ValueError(f"{channel!r} is not a channel name")
            conn.execute(f"LISTEN {channel}").fetchall()

    def notifications(self, conn: PostgresConnection, *, timeout: float) -> Iterator[str]:
        """The channels of the notifications the session receives within ``timeout`` seconds (at most 64)."""
        import psycopg

        try:
            for notify in conn.raw.notifies(timeout=timeout, stop_after=64):
                yield notify.channel
        except psycopg.Error as e:
            raise postgres_error(e, conn.location) from e


DUCKDB = Dialect()
POSTGRES = PostgresDialect()

#: A quoted literal or identifier (left as it is), a placeholder, a percent sign, or the BLOB type.
_SQL_TOKEN = re.compile(r"""('(?:[^']|'')*')|("(?:[^"]|"")*")|(\?)|(%)|\b(BLOB)\b""", re.IGNORECASE)


@functools.lru_cache(maxsize=4096)
def postgres_sql(sql: str) -> str:
    """``sql`` as psycopg sends it to PostgreSQL: ``?`` -> ``%s``, ``%`` -> ``%%``, ``BLOB`` -> ``BYTEA``.

    Quoted literals and identifiers are left untouched. Remembered per statement text (the
    registry's statements are constants, or built from constants and placeholder counts).
    """

    def one(m: re.Match[str]) -> str:
        if m.group(1) or m.group(2):
            return m.group(0)
        if m.group(3):
            return "%s"
        if m.group(4):
            return "%%"
        return "BYTEA"

    return _SQL_TOKEN.sub(one, sql)


def redact(url: str) -> str:
    """``url`` without a password, for messages and logs (``postgresql://user@host:port/db``)."""
    return re.sub(r"^([a-z]+://[^:/@]*):[^@]*@", r"\1:***@", url)


def postgres_error(e: Exception, location: str) -> RegistryError:
    """The registry error a psycopg error stands for (raise it ``from e``)."""
    import psycopg

    if isinstance(e, psycopg.OperationalError | psycopg.InterfaceError) and not isinstance(
        e, psycopg.errors.SerializationFailure | psycopg.errors.DeadlockDetected
    ):
        return DatabaseUnavailableError(
            f"the registry's PostgreSQL database {location} is unreachable: {_first_line(e)}", retry_after=RETRY_AFTER_SECONDS
        )
    if isinstance(e, psycopg.errors.IntegrityError | psycopg.errors.SerializationFailure | psycopg.errors.DeadlockDetected):
        return DatabaseConflictError(
            f"another registry process changed the same rows at the same moment ({_first_line(e)})",
            retry_after=RETRY_AFTER_SECONDS,
        )
    return RegistryError(f"the registry's PostgreSQL database refused a statement: {_first_line(e)}")


_session_tag: tuple[int, str] | None = None


def session_tag() -> str:
    """This process's mark, ``<pid>.<8 hex>``, the last word of each of its sessions' ``application_name``.

    Random as well as the pid, since pids repeat across machines and restarts; made anew in a
    forked child, which is another process.
    """
    global _session_tag
    pid = os.getpid()
    if _session_tag is None or _session_tag[0] != pid:
        _session_tag = (pid, f"{pid}.{secrets.token_hex(4)}")
    return _session_tag[1]


def log_lock_timeout(outcome: str) -> DatabaseConflictError:
    """The 503 for a wait for ``LOG_LOCK`` past ``LOG_LOCK_WAIT_SECONDS`` (``outcome``: what was not done)."""
    return DatabaseConflictError(
        f"another registry process has held the log for more than {LOG_LOCK_WAIT_SECONDS:g} s (it is starting, "
        f"taking over, or paused); {outcome}",
        retry_after=RETRY_AFTER_SECONDS,
        hint="send the same request again (publishing is idempotent); if it persists, find the registry process "
        "holding the log (pg_locks, application_name 'kvgraft-registry <pid>.<tag>') and restart it",
    )


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


class _PostgresRows:
    """A psycopg cursor read like DuckDB's: a statement without rows reads as none."""

    def __init__(self, cursor: psycopg.Cursor[tuple[Any, ...]], location: str) -> None:
        self._cursor = cursor
        self._location = location

    def _fetch(self, how: Callable[[], Any], empty: Any) -> Any:
        import psycopg

        if self._cursor.description is None:
            return empty
        try:
            return how()
        except psycopg.Error as e:
            raise postgres_error(e, self._location) from e

    def fetchone(self) -> tuple[Any, ...] | None:
        row: tuple[Any, ...] | None = self._fetch(self._cursor.fetchone, None)
        return row

    def fetchall(self) -> list[tuple[Any, ...]]:
        rows: list[tuple[Any, ...]] = self._fetch(self._cursor.fetchall, [])
        return rows

    def fetchmany(self, size: int = 1) -> list[tuple[Any, ...]]:
        rows: list[tuple[Any, ...]] = self._fetch(lambda: self._cursor.fetchmany(size), [])
        return rows


class PostgresConnection:
    """A psycopg connection (autocommit; transactions are explicit) that speaks the registry's SQL.

    ``execute`` translates each statement (``postgres_sql``) and turns psycopg's errors into
    registry errors (``postgres_error``). Not thread-safe: ``Database.lock`` orders its users.
    """

    def __init__(self, url: str, *, application_name: str = "kvgraft-registry") -> None:
        self.url = url
        self.location = redact(url)
        self._application_name = application_name
        self.raw: psycopg.Connection[tuple[Any, ...]] = self._connect()

    def _connect(self) -> psycopg.Connection[tuple[Any, ...]]:
        import psycopg

        try:
            return psycopg.connect(
                self.url,
                autocommit=True,
                connect_timeout=CONNECT_TIMEOUT,
                application_name=f"{self._application_name} {session_tag()}",
            )
        except psycopg.Error as e:
            raise DatabaseUnavailableError(
                f"cannot connect to the registry's PostgreSQL database {self.location}: {_first_line(e)}",
                retry_after=RETRY_AFTER_SECONDS,
                hint="check --database (postgresql://USER@HOST:PORT/DBNAME; the password in PGPASSWORD or ~/.pgpass), "
                "that the server runs, and that the database exists (createdb DBNAME)",
            ) from e

    @property
    def usable(self) -> bool:
        """False once the server dropped the connection (or it was closed)."""
        return not (self.raw.closed or self.raw.broken)

    def reconnect(self) -> None:
        """Replace a dropped connection (session state, advisory locks included, died with it)."""
        with contextlib.suppress(Exception):
            self.raw.close()
        self.raw = self._connect()
        logger.warning("reconnected to the registry's PostgreSQL database %s", self.location)

    @property
    def backend_pid(self) -> int:
        """The server process of this session (what ``pg_locks.pid`` names)."""
        return int(self.raw.info.backend_pid)

    def execute(self, query: str, parameters: Any = None, /) -> _PostgresRows:
        import psycopg

        try:
            cursor = self.raw.execute(postgres_sql(query), list(parameters or ()))
        except psycopg.Error as e:
            raise postgres_error(e, self.location) from e
        return _PostgresRows(cursor, self.location)

    def executemany(self, query: str, rows: Sequence[Sequence[Any]]) -> None:
        """Run ``query`` once per row, pipelined (psycopg sends them all before reading the answers)."""
        import psycopg

        try:
            with self.raw.cursor() as cursor:
                cursor.executemany(postgres_sql(query), [list(row) for row in rows])
        except psycopg.Error as e:
            raise postgres_error(e, self.location) from e

    def close(self) -> None:
        self.raw.close()


def _is_lock_conflict(e: duckdb.Error) -> bool:
    return isinstance(e, duckdb.IOException) and "lock" in str(e).lower()


def is_postgres_url(database: str | None) -> bool:
    """Whether ``database`` (``--database``) names a PostgreSQL database."""
    return database is not None and database.startswith(POSTGRES_SCHEMES)


class Database:
    """The registry's connection and its dialect. Use every query under ``lock``."""

    def __init__(self, path: Path | str, connection: Connection, dialect: Dialect = DUCKDB) -> None:
        #: Where the database is, for messages: the DuckDB file, or the PostgreSQL URL without its password.
        self.path = path
        self._conn: Connection | None = connection
        #: How this engine does what engines do differently.
        self.dialect = dialect
        #: Serialises every use of the connection (reentrant: a transaction runs queries).
        self.lock = threading.RLock()
        self._in_transaction = False
        self._holds_log = False

    @classmethod
    def open(cls, data_dir: Path, *, wait_seconds: float = 0.0, create: bool = True, database: str | None = None) -> Database:
        """Open the registry database and apply pending migrations.

        Without ``database``: ``DATA/registry.duckdb`` (created when ``create``); waits up to
        ``wait_seconds`` for another process to release the file and raises
        ``DatabaseLockedError`` (naming the holder's pid) when it does not. With a
        ``postgresql://`` URL: that database, which must exist; the migrations run under
        ``LOG_LOCK``, which stays held (so that a start-up reads the log whole) until
        ``release_log`` or ``close``. Refused before anything is made while a feature module has
        not registered its migration (ddl.py).
        """
        ddl.migrations()
        if database is not None:
            return cls._open_postgres(database)
        path = data_dir / DB_FILE
        if not create and not path.exists():
            raise DataDirError(
                f"{data_dir} holds no registry database ({DB_FILE})",
                hint="check --data, or start the registry once with 'kvgraft serve --data DIR'",
            )
        deadline = time.monotonic() + wait_seconds
        while True:
            try:
                # The file holds token hashes and every publisher's metadata: created 0600 (DuckDB
                # takes no mode, so the process umask decides; the server keeps 077 for its WAL).
                old_umask = os.umask(0o077)
                try:
                    conn = duckdb.connect(str(path))
                finally:
                    os.umask(old_umask)
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

    @classmethod
    def _open_postgres(cls, url: str) -> Database:
        if not is_postgres_url(url):
            raise DataDirError(
                f"--database {redact(url)[:80]!r} is not a PostgreSQL URL",
                hint="pass postgresql://USER@HOST:PORT/DBNAME, or no --database for the DuckDB file in the data directory",
            )
        conn = PostgresConnection(url)
        db = cls(conn.location, conn, POSTGRES)
        try:
            db.hold_log()
            db.migrate()
        except BaseException:
            db.close()
            raise
        return db

    @property
    def conn(self) -> Connection:
        """The live connection (a dropped PostgreSQL one is replaced, outside a transaction); raises once closed."""
        if self._conn is None:
            raise DataDirError("the registry database was used after it was closed", hint="this is a bug in kvgraft")
        if isinstance(self._conn, PostgresConnection) and not self._conn.usable and not self._in_transaction:
            with self.lock:
                self._holds_log = False
                self._conn.reconnect()
        return self._conn

    def close(self, *, checkpoint: bool = True) -> None:
        """Close the connection (idempotent); DuckDB's file is checkpointed first.

        With ``checkpoint=False`` the DuckDB file and its WAL are left as they are (DuckDB's own
        checkpoint on shutdown is turned off too): a database refused at start stays exactly
        as it was found, for the operator to inspect or restore. A PostgreSQL session's
        advisory locks end with it.
        """
        with self.lock:
            conn, self._conn = self._conn, None
            if conn is None:
                return
            if isinstance(conn, PostgresConnection):
                conn.close()
                return
            raw: duckdb.DuckDBPyConnection = conn  # type: ignore[assignment]
            with contextlib.suppress(duckdb.Error):
                raw.execute("CHECKPOINT" if checkpoint else "PRAGMA disable_checkpoint_on_shutdown")
            raw.close()

    @contextlib.contextmanager
    def transaction(self) -> Iterator[Connection]:
        """Run the block in one transaction: committed when it ends, rolled back when it raises."""
        with self.lock:
            conn = self.conn
            conn.execute("BEGIN TRANSACTION")
            self._in_transaction = True
            try:
                yield conn
            except BaseException:
                with contextlib.suppress(duckdb.Error, RegistryError):
                    conn.execute("ROLLBACK")
                raise
            else:
                conn.execute("COMMIT")
            finally:
                self._in_transaction = False

    def query(self, sql: str, params: list[Any] | tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        """Run one statement and fetch every row."""
        with self.lock:
            return self.conn.execute(sql, list(params)).fetchall()

    def query_one(self, sql: str, params: list[Any] | tuple[Any, ...] = ()) -> tuple[Any, ...] | None:
        """Run one statement and fetch the first row (or None)."""
        with self.lock:
            return self.conn.execute(sql, list(params)).fetchone()

    def checkpoint(self) -> None:
        """Make every committed write durable in the database itself (``Dialect.checkpoint``)."""
        with self.lock:
            self.dialect.checkpoint(self.conn)

    # --- holding the log (PostgreSQL: several processes) ------------------------------------

    def hold_log(self) -> None:
        """Hold ``LOG_LOCK`` for this session, waiting for any other process's append to commit.

        While it is held no process appends to the log, so reads see whole batches only. A
        no-op on DuckDB (the process owns the file). Released by ``release_log`` or ``close``.
        """
        if not self.dialect.shared:
            return
        import psycopg

        with self.lock:
            if not self._holds_log:
                # Bounded like an append's wait (``LOG_LOCK_WAIT_SECONDS``): a paused holder must not
                # stall a start or a take-over (which holds ``Database.lock``) for good.
                self.conn.execute("SELECT set_config('lock_timeout', ?, false)", [f"{int(LOG_LOCK_WAIT_SECONDS * 1000)}ms"]).fetchall()
                try:
                    self.conn.execute("SELECT pg_advisory_lock(?, ?)", [LOCK_CLASS, LOG_LOCK]).fetchall()
                except RegistryError as e:
                    if not isinstance(e.__cause__, psycopg.errors.LockNotAvailable):
                        raise
                    raise log_lock_timeout("the log was not read") from e
                finally:
                    with contextlib.suppress(RegistryError):
                        self.conn.execute("RESET lock_timeout").fetchall()
                self._holds_log = True

    def release_log(self) -> None:
        """Let other processes append again (after ``hold_log``)."""
        with self.lock:
            if self._holds_log and self._conn is not None:
                self._holds_log = False
                self.conn.execute("SELECT pg_advisory_unlock(?, ?)", [LOCK_CLASS, LOG_LOCK]).fetchall()

    @contextlib.contextmanager
    def log_held(self) -> Iterator[None]:
        """``hold_log`` for the block (kept if it was already held)."""
        held = self._holds_log
        self.hold_log()
        try:
            yield
        finally:
            if not held:
                self.release_log()

    def dedicated_connection(self, application_name: str) -> PostgresConnection:
        """A second PostgreSQL session to the same database (the lease's, cluster.py); the caller closes it."""
        if not isinstance(self._conn, PostgresConnection):
            raise DataDirError("only a PostgreSQL registry database has more than one session", hint="this is a bug in kvgraft")
        return PostgresConnection(self._conn.url, application_name=application_name)

    # --- schema ----------------------------------------------------------------------------

    def schema_version(self) -> int:
        """The highest migration applied (0 for a new database)."""
        with self.lock:
            self.conn.execute(
                "CREATE TABLE IF NOT EXISTS schema_version (version INTEGER PRIMARY KEY, "
                "description VARCHAR NOT NULL, applied_at VARCHAR NOT NULL)"
            )
            row = self.conn.execute("SELECT max(version) FROM schema_version").fetchone()
        return int(row[0]) if row and row[0] is not None else 0

    def migrate(self, steps: Sequence[Migration] | None = None) -> list[int]:
        """Apply the migrations newer than the database's version, in order; return those applied.
        ``steps`` defaults to every registered one (ddl.py).

        On PostgreSQL, under ``LOG_LOCK``: two processes starting at once migrate one after the other.
        """
        with self.log_held():
            migrations = list(ddl.migrations() if steps is None else steps)
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
                except (duckdb.Error, RegistryError) as e:
                    detail = e.message if isinstance(e, RegistryError) else str(e)
                    raise SchemaVersionError(
                        f"migration {migration.version} ({migration.description}) failed on {self.path}: {detail}",
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
            self.conn.execute(
                "INSERT INTO meta VALUES (?, ?) ON CONFLICT (key) DO UPDATE SET value = excluded.value", [key, value]
            )
