"""Several server processes on one PostgreSQL database: the sequencer lease, and keeping up with it.

Every ``kvgraft serve --database postgresql://...`` process serves reads; exactly one at a time
sequences the log, the holder of the *lease*: a session-level advisory lock
(``pg_try_advisory_lock(LOCK_CLASS, LEASE_LOCK)``) on a connection of its own, held for as long
as that session lives. When the holder dies (``kill -9``, a crash, a lost machine) PostgreSQL
ends its session and the lock with it; the others try for it every ``poll_seconds``, so the
lease changes hands within that, plus the time PostgreSQL takes to notice the session is gone
(at once for a dead process, whose kernel closes the socket; the lease session's TCP
keepalives, set below, bound it for a lost machine).

A holder that is alive but stopped (``SIGSTOP``, a frozen VM, a hung thread) keeps its session
and so the lock. Its lease thread therefore renews a heartbeat in ``meta`` every ``poll_seconds``
(the time by the database's clock, with the process's ``session_tag``); a follower that finds it
older than ``expiry_seconds`` ends every session of that process (``PostgresDialect.end_lease_holder``:
its open append rolls back, its lease is released) and takes the lease on its next try. When the
stopped process runs again it finds its sessions gone, and steps down before it can commit: the
guard below checks the lease in the same transaction as the append.

A process that takes the lease first reads the log whole under ``LOG_LOCK`` (so that it waits
for any append still committing), checks it against ``signed-head.json`` as a start does, and
only then sequences (``Registry.take_over``); one that cannot (the database is behind the head
it holds: a rollback) gives the lease back and keeps serving reads. Each append transaction of
the holder takes ``LOG_LOCK``, checks in the database that its lease session still holds the
lease and that the log's newest checkpoint is the one it extends, and notifies the others
(``Publisher._append_entries``, ``Cluster.guard``); so a holder that lost its lease without
noticing cannot commit, two processes can never append at one tree size, and no checkpoint is
handed out before it is committed: the log never forks.

The others refuse publishes (503 ``NotSequencerError`` with Retry-After, naming the sequencer
by host, pid and URL, read from ``meta``), and keep their tree and head up to date: the same
connection LISTENs for the holder's notification of each new head and for account changes
(``Accounts.sync``), and on each one, or every ``poll_seconds`` without one, the process loads
the new entries (``Registry.catch_up``, bounded per call). A read that asks for an entry or a
tree size past the process's head also catches up first, so an entry published through the
sequencer can be read through any process as soon as its publisher has the answer.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
from typing import Any, Protocol

from ..accounts import Accounts
from ..errors import NotSequencerError, RegistryError
from ..storage.db import (
    ACCOUNTS_CHANNEL,
    LOG_CHANNEL,
    Connection,
    Database,
    PostgresConnection,
    PostgresDialect,
    now_utc,
    session_tag,
)


class LogFollower(Protocol):
    """What the lease drives of the registry (``service.Registry``): load what other processes
    appended, take over as the sequencer, see account changes. A protocol, so that this module does
    not import the service that builds it."""

    @property
    def db(self) -> Database: ...

    @property
    def accounts(self) -> Accounts: ...

    def catch_up(self) -> bool: ...

    def take_over(self) -> int: ...

logger = logging.getLogger("kvgraft.registry")

#: Seconds between a follower's tries for the lease (and the holder's checks that it still holds it).
LEASE_POLL_SECONDS = 0.5
#: Seconds without a heartbeat (by the database's clock) after which a holder is taken to be stopped.
LEASE_EXPIRY_SECONDS = 10.0
#: Retry-After of a follower's refusal: about when a lease left by a dead holder is taken.
RETRY_AFTER_SECONDS = 2
#: The ``meta`` key naming the process that holds the lease (JSON: host, pid, url, since).
SEQUENCER_META = "sequencer"
#: The lease session's TCP keepalives, as PostgreSQL applies them to its side of the connection:
#: the server ends the session of a holder it cannot reach within about 10 s, releasing the lease.
_KEEPALIVE_SETTINGS = (
    ("tcp_keepalives_idle", "4"),
    ("tcp_keepalives_interval", "2"),
    ("tcp_keepalives_count", "3"),
    ("tcp_user_timeout", "10000"),
)
#: The longest identity value kept from the database for a refusal (it names a host and a URL).
_MAX_NAME = 200


class Cluster:
    """The lease and listener of one server process over a shared database (one daemon thread).

    ``start`` connects and tries for the lease once before it returns (so a lone process
    sequences as soon as it serves); ``stop`` ends the thread and the lease session. The
    sequencer's thread calls ``guard`` inside each append transaction; request threads read
    ``holds_lease`` and ``refusal``.
    """

    def __init__(
        self,
        registry: LogFollower,
        *,
        url: str | None,
        poll_seconds: float = LEASE_POLL_SECONDS,
        expiry_seconds: float = LEASE_EXPIRY_SECONDS,
    ) -> None:
        if not isinstance(registry.db.dialect, PostgresDialect):
            raise TypeError("a Cluster needs a registry on a shared (PostgreSQL) database")
        self.registry = registry
        self.dialect: PostgresDialect = registry.db.dialect
        self.poll_seconds = poll_seconds
        self.expiry_seconds = expiry_seconds
        self.identity = {"host": socket.gethostname()[:_MAX_NAME], "pid": os.getpid(), "url": url}
        self._conn: PostgresConnection | None = None
        #: The lease session's server pid while this process holds the lease (pg_locks names it).
        self._lease_pid: int | None = None
        self._holder: dict[str, Any] | None = None
        #: When this process took the lease (UTC, as ``now_utc`` writes it).
        self._since: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvgraft-lease", daemon=True)

    @property
    def holds_lease(self) -> bool:
        """Whether this process sequences the log now."""
        return self._lease_pid is not None

    def refusal(self) -> NotSequencerError:
        """The 503 a publish gets from a process that does not hold the lease, naming the one that does."""
        holder = self._holder
        if holder is None:
            who = "no server holds the sequencer lease right now (it is being handed over)"
        else:
            url = f" at {holder['url']}" if holder.get("url") else ""
            who = f"the sequencer is process {holder.get('pid')} on {holder.get('host')}{url}"
        return NotSequencerError(
            f"this registry server (process {os.getpid()} on {self.identity['host']}) does not sequence the log; {who}",
            retry_after=RETRY_AFTER_SECONDS,
            extra={"sequencer": holder},
        )

    # --- life --------------------------------------------------------------------------------

    def start(self) -> None:
        """Connect, try for the lease once, and start the thread."""
        try:
            self._connect()
            self._step()
        except RegistryError as e:
            logger.warning("the sequencer lease: %s (retrying every %g s)", e.message, self.poll_seconds)
            self._drop()
        self._thread.start()

    def stop(self) -> None:
        """End the thread, then the lease session (which releases the lease at once)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        if self.holds_lease:
            logger.info("giving up the sequencer lease (shutting down)")
        self._drop()

    def _connect(self) -> None:
        conn = self.registry.db.dedicated_connection("kvgraft-registry-lease")
        try:
            for name, value in _KEEPALIVE_SETTINGS:
                conn.execute("SELECT set_config(?, ?, false)", [name, value]).fetchall()
            self.dialect.listen(conn, (LOG_CHANNEL, ACCOUNTS_CHANNEL))
        except BaseException:
            conn.close()
            raise
        self._conn = conn

    def _step_down(self) -> None:
        """Stop sequencing (the lease is gone, or about to be): refusals name no holder until it is known."""
        if self._lease_pid is not None:
            self._lease_pid = None
            self._holder = None
            logger.warning("process %d no longer sequences the log", os.getpid())

    def _drop(self) -> None:
        """Close the lease session; a lease it held is released with it."""
        self._step_down()
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()

    # --- the thread -------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                if self._conn is None or not self._conn.usable:
                    self._drop()
                    self._connect()
                self._step()
                self._wait()
            except RegistryError as e:
                logger.warning("the sequencer lease: %s (retrying in %g s)", e.message, self.poll_seconds)
                self._drop()
                self._stop.wait(self.poll_seconds)
            except Exception:  # a bug: logged, and the thread goes on without the lease
                logger.exception("the sequencer lease thread failed")
                self._drop()
                self._stop.wait(self.poll_seconds)

    def _step(self) -> None:
        """One round: keep or try for the lease, learn who holds it, catch up when following."""
        conn = self._conn
        if conn is None:
            return
        if self.holds_lease:
            if self.dialect.lease_held(conn, conn.backend_pid):
                self._beat(conn)
            else:
                logger.error("process %d lost the sequencer lease", os.getpid())
                self._step_down()
        else:
            if self.dialect.lease_held(conn, conn.backend_pid):
                # Stepped down by ``guard`` with the lock still held: give it back, then try afresh.
                self.dialect.release_lease(conn)
            if self.dialect.try_lease(conn):
                self._take_over(conn)
        if not self.holds_lease:
            record = _record(self.registry.db.get_meta(SEQUENCER_META))
            self._holder = _holder(record)
            self._end_stopped_holder(conn, record)
            self.registry.catch_up()

    def _beat(self, conn: PostgresConnection) -> None:
        """Write who sequences, with a heartbeat by the database's clock (``meta``, on the lease session)."""
        me = {**self.identity, "since": self._since, "tag": session_tag(), "beat": self.dialect.clock(conn)}
        conn.execute(
            "INSERT INTO meta VALUES (?, ?) ON CONFLICT (key) DO UPDATE SET value = excluded.value",
            [SEQUENCER_META, json.dumps(me)],
        ).fetchall()

    def _end_stopped_holder(self, conn: PostgresConnection, record: dict[str, Any] | None) -> None:
        """End the sessions of a holder whose heartbeat is older than ``expiry_seconds``: it is stopped or hung."""
        if record is None:
            return
        tag, beat = record.get("tag"), record.get("beat")
        if not isinstance(tag, str) or not isinstance(beat, int | float) or tag == session_tag():
            return
        age = self.dialect.clock(conn) - float(beat)
        if age <= self.expiry_seconds:
            return
        try:
            ended = self.dialect.end_lease_holder(conn, tag)
        except ValueError:
            return  # not a tag this code writes: nothing to end by it
        if ended:
            logger.warning(
                "the sequencer (process %s on %s) has not renewed its lease for %.1f s: ended its %d database "
                "session(s), so that the lease can be taken",
                record.get("pid"), record.get("host"), age, ended,
            )

    def _take_over(self, conn: PostgresConnection) -> None:
        try:
            size = self.registry.take_over()
        except RegistryError as e:
            logger.error("process %d got the sequencer lease but gives it back: %s", os.getpid(), e.message)
            self.dialect.release_lease(conn)
            return
        self._since = now_utc()
        self._beat(conn)
        self._holder = {**self.identity, "since": self._since}
        self._lease_pid = conn.backend_pid
        logger.warning("process %d now sequences the log (tree size %d)", os.getpid(), size)

    def _wait(self) -> None:
        """Sleep up to ``poll_seconds``, waking for a notification: a new head, or an account change."""
        conn = self._conn
        if conn is None:
            return
        for channel in self.dialect.notifications(conn, timeout=self.poll_seconds):
            if channel == ACCOUNTS_CHANNEL:
                self.registry.accounts.sync()
            elif channel == LOG_CHANNEL and not self.holds_lease:
                self.registry.catch_up()
            if self._stop.is_set():
                return

    # --- the append transaction ----------------------------------------------------------------

    def guard(self, conn: Connection, tree_size: int) -> None:
        """Inside an append transaction that extends the log at ``tree_size``: may it commit?

        Takes ``LOG_LOCK`` (waiting for another process's append to commit), then checks in the
        database that this process's lease session still holds the lease and that the newest
        checkpoint is at ``tree_size``, and queues the notification of the new head. Raises
        ``NotSequencerError`` (the transaction then rolls back) and steps down otherwise.
        """
        pid = self._lease_pid
        if pid is None:
            raise self.refusal()
        self.dialect.lock_log(conn)
        if not self.dialect.lease_held(conn, pid):
            self._step_down()
            logger.error("process %d lost the sequencer lease: the batch is refused", os.getpid())
            raise NotSequencerError(
                "this registry server lost the sequencer lease before its batch was committed; nothing was logged",
                retry_after=RETRY_AFTER_SECONDS,
            )
        row = conn.execute("SELECT max(tree_size) FROM checkpoints").fetchone()
        newest = None if row is None or row[0] is None else int(row[0])
        if newest != tree_size:
            self._step_down()
            logger.error("the log is at tree size %s in the database but %d in process %d: stepping down", newest, tree_size, os.getpid())
            raise NotSequencerError(
                f"another registry process appended to the log (the database is at tree size {newest}, this server "
                f"at {tree_size}); nothing was logged",
                retry_after=RETRY_AFTER_SECONDS,
            )
        self.dialect.notify(conn, LOG_CHANNEL)


def _record(raw: str | None) -> dict[str, Any] | None:
    """The lease holder's record as ``meta`` holds it: host, pid, url, since, tag, beat (None when unreadable)."""
    if raw is None or len(raw) > 5 * _MAX_NAME:
        return None
    try:
        doc = json.loads(raw)
    except ValueError:
        return None
    return doc if isinstance(doc, dict) else None


def _holder(record: dict[str, Any] | None) -> dict[str, Any] | None:
    """The holder's identity as a refusal names it."""
    if record is None:
        return None
    return {k: record.get(k) for k in ("host", "pid", "url", "since")}

