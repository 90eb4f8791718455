"""The log's tree head at start and outside the database: what makes a rolled-back database refused.

After each commit, and before any publish of the batch is answered, the new tree head is written
(fsynced) to ``signed-head.json`` beside the database (``datadir.write_signed_head``). At start
``check_signed_head`` refuses a database whose tree is smaller than that head, or whose root at
that size differs (``LogRollbackError``): a lost WAL or a restored older copy would otherwise make
the registry sign a second, different tree of a size it already signed. A database ahead of the
file (a crash between the commit and the file write) is fine: ``advance_signed_head`` moves the
file to the database's head. ``stored_head`` checks the database against itself (its latest
checkpoint against its entries and the registry key).
"""

from __future__ import annotations

import logging

from kvgraft.verifier import LogProofError, MalformedInputError

from ..datadir import (
    SIGNED_HEAD_FILE,
    DataDir,
    SignedHead,
    read_signed_head,
    remove_stale_head_temps,
    write_signed_head,
)
from ..errors import LogIntegrityError, LogRollbackError, SignedHeadWriteError
from ..storage.db import Database, now_utc
from .tree import LogHead, TransparencyLog, verify_checkpoint

logger = logging.getLogger("kvgraft.registry")

#: The meta key recording that this database has written signed-head.json at least once.
HEAD_FILE_META = "signed_head_file"
#: Seconds after which a temp file of signed-head.json is a crash's leftover, when processes share the data directory.
SHARED_TEMP_AGE = 60.0


def load_leaves(db: Database) -> list[bytes]:
    """Every stored leaf hash in log order; ``LogIntegrityError`` when an index is missing."""
    rows = db.query("SELECT log_index, leaf_hash FROM entries ORDER BY log_index")
    leaves = []
    for expected, (index, leaf) in enumerate(rows):
        if int(index) != expected:
            raise LogIntegrityError(f"the log has no entry {expected} but has entry {index}: entries are missing")
        leaves.append(bytes(leaf))
    return leaves


def sign_empty(db: Database, log: TransparencyLog) -> LogHead:
    """Sign and store checkpoint 0 of a new log."""
    head = log.sign(0)
    with db.transaction() as conn:
        conn.execute("INSERT INTO checkpoints VALUES (?, ?, ?, ?)", [0, head.root_hash, head.note, now_utc()])
    return head


def stored_head(db: Database, log: TransparencyLog) -> LogHead | None:
    """The database's latest checkpoint, checked against its entries and the key; None for a new log."""
    row = db.query_one("SELECT tree_size, root_hash, note FROM checkpoints ORDER BY tree_size DESC LIMIT 1")
    if row is None:
        if log.size:
            raise LogIntegrityError(f"the log has {log.size} entries but no checkpoint")
        return None
    stored_size, stored_root, stored_note = row
    size, root, note = int(stored_size), bytes(stored_root), bytes(stored_note)
    if size != log.size or root != log.root():
        raise LogIntegrityError(
            f"the latest checkpoint is at size {size} with root {root.hex()}, but the stored entries make "
            f"a tree of size {log.size} with root {log.root().hex()}"
        )
    try:
        verify_checkpoint(note, log.origin, log.public_key, origin=log.origin)
    except (LogProofError, MalformedInputError) as e:
        raise LogIntegrityError(f"the latest stored checkpoint does not verify with the registry key: {e.message}") from e
    return LogHead(size=size, root_hash=root, note=note)


def signed_head(origin: str, head: LogHead) -> SignedHead:
    """What ``signed-head.json`` records of ``head``."""
    return SignedHead(origin=origin, tree_size=head.size, root_hash=head.root_hash, checkpoint=head.note)


def restore_hint(db: Database, size: int) -> str:
    """How to recover from a database behind the signed head of ``size``, in the words of its engine."""
    what = (
        "the PostgreSQL database (pg_restore, or your provider's point-in-time recovery)"
        if db.dialect.shared
        else "registry.duckdb (with its .wal)"
    )
    return (
        f"restore {what} from a backup taken at tree size {size} or later; never delete {SIGNED_HEAD_FILE} to get "
        f"past this: clients that saw size {size} would see a fork"
    )


def check_signed_head(data: DataDir, db: Database, log: TransparencyLog, *, adopt: bool) -> SignedHead | None:
    """Refuse a database behind, or different from, the last tree head this registry signed or served.

    Returns the saved head (None when there is none yet: a new data directory, or one made
    before heads were saved). Raises ``LogRollbackError`` (one line: what happened, how to
    recover) when the database's tree is smaller than the saved head, its root at that size
    differs, or the file was removed from a database that had written one.

    A shared (PostgreSQL) database: other processes may be writing the file of a data directory
    they share at this moment (their temp files are left alone while fresh). A data directory
    without the file, on a database whose log has entries, cannot tell a live database from one
    restored from an older copy: it is refused unless ``adopt`` (``kvgraft serve
    --adopt-database-head``), which trusts the database's head once, loudly (docs/registry.md).
    """
    shared = db.dialect.shared
    remove_stale_head_temps(data, min_age=SHARED_TEMP_AGE if shared else 0.0)
    saved = read_signed_head(data)
    if saved is None:
        if shared and log.size > 0:
            if not adopt:
                raise LogRollbackError(
                    f"{data.root} has no {SIGNED_HEAD_FILE}, but the shared database already holds a log of {log.size} "
                    "entries: a data directory new to it cannot tell whether that database was rolled back, and "
                    "serving it would then fork the log",
                    hint=f"copy {SIGNED_HEAD_FILE} from a running server's data directory; or, for a new server "
                    "joining a database you know is current, start it once with --adopt-database-head; if the "
                    f"file was deleted, restore it from a backup instead",
                )
            logger.warning(
                "ADOPTING the shared database's log head as this data directory's (--adopt-database-head): "
                "tree size %d, root %s, saved to %s; from now on this server refuses any database behind it",
                log.size, log.root().hex(), data.root / SIGNED_HEAD_FILE,
            )
        elif not shared and db.get_meta(HEAD_FILE_META) is not None:
            raise LogRollbackError(
                f"{SIGNED_HEAD_FILE} is missing from the data directory, but this database has written one: "
                "without it the registry cannot tell whether the database was rolled back",
                hint=f"restore {SIGNED_HEAD_FILE} from the backup registry.duckdb came from; do not start without it",
            )
        return None
    backup = "the PostgreSQL database" if shared else "registry.duckdb"
    try:
        checkpoint = verify_checkpoint(saved.checkpoint, log.origin, log.public_key, origin=log.origin)
    except (LogProofError, MalformedInputError) as e:
        raise LogRollbackError(
            f"{SIGNED_HEAD_FILE} holds a checkpoint that does not verify as this log's ({log.origin}): {e.message}",
            hint=f"restore {SIGNED_HEAD_FILE} from the same backup as {backup} and the registry key",
        ) from e
    if (checkpoint.size, checkpoint.root_hash) != (saved.tree_size, saved.root_hash) or saved.origin != log.origin:
        raise LogRollbackError(
            f"{SIGNED_HEAD_FILE} names tree size {saved.tree_size} (log {saved.origin!r}), but its signed "
            f"checkpoint is for size {checkpoint.size} of log {log.origin!r}",
            hint=f"restore {SIGNED_HEAD_FILE} from the same backup as {backup}",
        )
    lost = "(an older copy restored)" if shared else "(a deleted or truncated WAL, an older copy restored)"
    if log.size < checkpoint.size:
        raise LogRollbackError(
            f"the database holds {log.size} log entries, but this registry already signed a checkpoint at "
            f"tree size {checkpoint.size} ({SIGNED_HEAD_FILE}): the database was rolled back or lost committed writes "
            f"{lost}; serving it would fork the log",
            hint=restore_hint(db, checkpoint.size),
        )
    if log.root(checkpoint.size) != checkpoint.root_hash:
        raise LogRollbackError(
            f"the database's first {checkpoint.size} log entries have root {log.root(checkpoint.size).hex()}, but this "
            f"registry signed root {checkpoint.root_hash.hex()} at that size ({SIGNED_HEAD_FILE}): the database holds "
            "a different log; serving it would fork the log",
            hint=restore_hint(db, checkpoint.size),
        )
    return saved


def advance_signed_head(
    data: DataDir, db: Database, log: TransparencyLog, head: LogHead, saved: SignedHead | None
) -> None:
    """Save the database's head when it is ahead of (or there is no) ``signed-head.json``."""
    if saved is None or saved.tree_size != head.size:
        try:
            write_signed_head(data, signed_head(log.origin, head), root_at=log.root)
        except OSError as e:
            raise SignedHeadWriteError(
                f"the signed tree head could not be saved to {SIGNED_HEAD_FILE}: {e.strerror}",
                hint="make the data directory writable (and free disk space), then start again",
            ) from e
    if db.get_meta(HEAD_FILE_META) is None:
        # Recorded only after the file exists, and checkpointed into the database file, so a
        # later start can tell "never written" (an upgrade) from "deleted".
        db.set_meta(HEAD_FILE_META, SIGNED_HEAD_FILE)
        db.checkpoint()
