"""The registry service: database, transparency log, blob store and accounts behind one lock.

``Registry`` is the room that joins the wings, and ``Registry.open`` the one place a registry is
built: the data directory, the database, the blob store, the signing key and the tree, checked
against each other and against ``signed-head.json`` (log/signedhead.py), then, when serving, its
background workers. It holds the log's announced head and serves checkpoints and proofs at it;
on a shared database it catches up with, or takes over from, the process holding the sequencer
lease (log/cluster.py drives that through ``catch_up`` and ``take_over``). Its parts:

- ``Registry.reader`` (reader.py): the reads, through the model the pages share (queries.py);
- ``Registry.publisher`` (publisher.py): the publish pipeline, which moves the head only through
  ``announce`` and appends on a shared database only holding the lease (``guard_append``).

The log cannot fork. After each commit, and before any publish of the batch is answered, the
new tree head is written (fsynced) to ``signed-head.json`` beside the database; at start a
database behind it is refused.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvgraft.verifier import (
    LogProofError,
    MalformedInputError,
    keyid_of,
    open_signing_key,
    public_key_pem,
)

from . import queries
from .accounts import Accounts, TokenInfo
from .blobs.factory import open_blob_store
from .blobs.store import BlobScrubber, BlobStore
from .datadir import (
    SIGNED_HEAD_FILE,
    DataDir,
    check_blob_store,
    check_registry_key,
    ensure_registry_key,
    prepare,
    resolve_origin,
    write_signed_head,
)
from .errors import (
    LogIntegrityError,
    LogRollbackError,
    NotFoundError,
    NotSequencerError,
    SignedHeadWriteError,
)
from .log.cosignatures import CosignatureStore, WitnessCollector, witness_targets
from .log.sequencer import Sequencer
from .log.signedhead import (
    advance_signed_head,
    check_signed_head,
    load_leaves,
    restore_hint,
    sign_empty,
    signed_head,
    stored_head,
)
from .log.tree import LogHead, TransparencyLog, format_vkey, verify_checkpoint
from .publisher import Publisher
from .ratelimit import RateLimiter
from .reader import Reader
from .settings import RegistrySettings
from .storage.db import Connection, Database

if TYPE_CHECKING:
    from .log.cluster import Cluster

logger = logging.getLogger("kvgraft.registry")

#: Leaves one catch-up with another process's appends loads at most (about 2 MiB of hashes).
CATCH_UP_LEAVES = 65536


class Registry:
    """A registry data directory, open: use it through ``Registry.open``."""

    def __init__(
        self, data: DataDir, db: Database, log: TransparencyLog, blobs: BlobStore, settings: RegistrySettings, head: LogHead
    ) -> None:
        self.data = data
        self.db = db
        self.log = log
        self.blobs = blobs
        self.settings = settings
        self.accounts = Accounts(db)
        self.rate_limiter = RateLimiter(settings.rate_limit, settings.rate_burst)
        self._head = head
        #: Witness cosignatures of the checkpoints (cosignatures.py), served on every checkpoint note.
        self.cosignatures = CosignatureStore(db)
        #: On a shared (PostgreSQL) database, when serving: this process's sequencer lease
        #: (cluster.py); without one this process sequences nothing there.
        self.cluster: Cluster | None = None
        #: The background re-hash of every blob (``--scrub-interval``), when serving.
        self.scrubber: BlobScrubber | None = None
        #: The reads (reader.py), at the head this registry announces.
        self.reader = Reader(db, settings, log, self.cosignatures, self.accounts, self)
        #: The publish pipeline (publisher.py), appending at the head this registry announces.
        self.publisher = Publisher(data, db, log, blobs, settings, self.accounts, self.reader, self)

    @classmethod
    @contextlib.contextmanager
    def open(cls, root: Path, settings: RegistrySettings, *, serving: bool = False) -> Iterator[Registry]:
        """Open (initialising on first use) the data directory ``root``; close it when the block ends.

        Creates the registry key and fixes the log's origin on first start; rebuilds the Merkle
        tree from the stored leaves and refuses to serve a log whose latest checkpoint does not
        match it (``LogIntegrityError``). The one place a registry is built: with ``serving``
        (the app's lifespan) its background workers too, started here and stopped before
        anything closes (``_start_workers``); nobody sets them afterwards.
        """
        data = prepare(root)
        # On PostgreSQL this holds LOG_LOCK until released below: no process appends while this
        # one reads the log to start (db.py).
        db = Database.open(root, wait_seconds=settings.lock_wait_seconds, database=settings.database)
        started = False
        try:
            # Under the database lock, so two first starts cannot both create a key.
            public = ensure_registry_key(data)
            check_registry_key(db, public)
            origin = resolve_origin(db, settings.origin, public)
            # The store settings.blob_store names (DATA/blobs by default), closed with the registry.
            with open_blob_store(data.blobs, settings) as blobs, open_signing_key(data.key_path) as key:
                # Only now, holding the database lock, is it safe to empty blobs/tmp: a second
                # process started on a live data directory fails above, before it can delete the
                # running server's uploads in progress.
                blobs.prepare()
                # Once the store answered (one that cannot be used is never recorded as the log's).
                check_blob_store(db, settings.blob_store, moved=settings.blob_store_moved)
                log = TransparencyLog(origin, key, load_leaves(db))
                # The database must agree with itself, then with the head saved outside it, before
                # anything is signed (an empty database gets checkpoint 0 signed here).
                stored = stored_head(db, log)
                saved = check_signed_head(data, db, log, adopt=settings.adopt_database_head)
                head = stored if stored is not None else sign_empty(db, log)
                advance_signed_head(data, db, log, head, saved)
                logger.info("registry %s: log %s at size %d (%s)", root, origin, log.size, db.dialect.name)
                db.release_log()
                started = True
                registry = cls(data, db, log, blobs, settings, head)
                with contextlib.ExitStack() as workers:
                    if serving:
                        registry._start_workers(workers)
                    yield registry
        finally:
            # A refused start leaves the database file and its WAL untouched.
            db.close(checkpoint=started)

    def _start_workers(self, stack: contextlib.ExitStack) -> None:
        """Start what a serving registry runs in the background, each stopped by ``stack`` (last
        started, first stopped): the witness collector, the blob scrubber, on a shared database
        the sequencer lease, and the sequencer. The sequencer stops first, after the server has
        finished the requests in flight, so every queued publish is logged; the lease after it,
        so that the publishes it still holds are logged before the lease is given up."""
        settings = self.settings
        if settings.witnesses:
            # Submits each new checkpoint to the witnesses in background threads; stopped (and
            # joined, each at most one bounded request late) before the registry closes.
            collector = WitnessCollector(self, witness_targets(settings.witnesses), settings.witness_timeout)
            self.publisher.on_new_head = collector.notify
            collector.start()
            stack.callback(collector.stop)
        if settings.scrub_interval > 0:
            # Re-hashes every blob each scrub_interval seconds in a low-priority thread, quarantining rot.
            self.scrubber = BlobScrubber(self.blobs, settings.scrub_interval)
            self.scrubber.start()
            stack.callback(self.scrubber.stop)
        if self.db.dialect.shared:
            # Several processes on one PostgreSQL database: the sequencer lease, and keeping up with
            # the holder's appends (cluster.py; it loads psycopg's listener, so only here).
            from .log.cluster import Cluster

            self.cluster = Cluster(self, url=settings.public_url or settings.admin_url)
            self.cluster.start()
            stack.callback(self.cluster.stop)
        # Appends verified publishes in batches (sequencer.py).
        sequencer = self.publisher.sequencer = Sequencer(
            self.publisher.sequence_batch,
            batch_max_entries=settings.batch_max_entries,
            batch_wait_ms=settings.batch_wait_ms,
            max_queue=settings.max_publish_queue,
            max_queue_bytes=settings.max_publish_queue_bytes,
        )
        sequencer.start()
        stack.callback(sequencer.stop)

    # --- the log ---------------------------------------------------------------------------

    @property
    def head(self) -> LogHead:
        """The latest signed checkpoint."""
        with self.db.lock:
            return self._head

    def checkpoint(self, tree_size: int | None = None, *, witnessed: int | None = None) -> bytes:
        """The signed checkpoint note at ``tree_size`` (default: the latest), with the witness
        cosignature lines stored for it; with ``witnessed``, the newest checkpoint (up to
        ``tree_size`` when given, and then that one) cosigned by at least that many witness keys
        (404 when there is none)."""
        if tree_size is not None:
            self.sees(tree_size)
        head = self.head
        if witnessed is not None:
            newest = head.size if tree_size is None else min(tree_size, head.size)
            size = newest if witnessed == 0 else self.cosignatures.newest_witnessed(witnessed, newest)
            if tree_size is not None and size != tree_size:
                raise NotFoundError(
                    f"the checkpoint at tree size {tree_size} is not cosigned by {witnessed} witness(es)",
                    hint="ask without tree_size for the newest checkpoint that is",
                )
            if size is None:
                raise NotFoundError(
                    f"no checkpoint of this log is cosigned by {witnessed} witness(es) yet",
                    hint="retry in a moment: witnesses cosign in the background; ask for fewer, or ask the operator "
                    "which witnesses the registry submits to (kvgraft serve --witness)",
                )
            tree_size = size
        if tree_size is None or tree_size == head.size:
            return head.note + self.cosignatures.lines(head.size)
        # Checked before the query: DuckDB refuses integers past 128 bits with an error of its own.
        note = queries.checkpoint_note(self.db, tree_size) if 0 <= tree_size <= head.size else None
        if note is None:
            # One checkpoint is signed per batch of publishes, at the size the batch ends at.
            raise NotFoundError(
                f"no checkpoint was signed at tree size {tree_size} (the log has {head.size} entries; "
                "a checkpoint is signed for each batch of publishes, at the tree size the batch ends at)",
                hint="ask for the size of a checkpoint the registry handed out (beside an entry, or the latest); "
                "inclusion and consistency proofs are served for any size up to the latest",
            )
        return note + self.cosignatures.lines(tree_size)

    def log_key(self) -> dict[str, Any]:
        """The registry's public key and origin."""
        key = self.log.public_key
        return {
            "origin": self.log.origin,
            "public_key_pem": public_key_pem(key).decode("ascii"),
            "keyid": keyid_of(key),
            "vkey": format_vkey(self.log.origin, key),
            "tree_size": self.head.size,
        }

    def inclusion_proof(self, index: int, tree_size: int | None) -> dict[str, Any]:
        """The inclusion proof document of entry ``index`` (tree size default: the latest).

        Sizes and indices outside the announced log are a 404, however large the number.
        """
        with self.db.lock:
            return self.log.inclusion(index, self._announced(tree_size))

    def consistency_proof(self, old: int, new: int | None) -> dict[str, Any]:
        """The consistency proof document between two tree sizes (new default: the latest)."""
        with self.db.lock:
            return self.log.consistency(old, self._announced(new))

    def _announced(self, tree_size: int | None) -> int:
        # Proofs are for tree sizes a checkpoint was handed out for: never past the saved head.
        if tree_size is not None:
            self.sees(tree_size)
        head = self._head.size
        if tree_size is None:
            return head
        if not 0 <= tree_size <= head:
            raise NotFoundError(
                f"tree size {tree_size} is outside the log, which has {head} entries",
                hint="ask for a tree size no larger than the latest checkpoint's",
            )
        return tree_size

    # --- several processes on one database (PostgreSQL; cluster.py) -----------------------

    @property
    def sequences(self) -> bool:
        """Whether this process appends to the log: always on DuckDB; on a shared database while it holds the lease."""
        return not self.db.dialect.shared or (self.cluster is not None and self.cluster.holds_lease)

    def sees(self, tree_size: int) -> None:
        """Catch up first when a read asks past this process's head (another may have appended)."""
        if tree_size > self._head.size and self.db.dialect.shared:
            self.catch_up()

    def catch_up(self, *, max_leaves: int = CATCH_UP_LEAVES) -> bool:
        """Load what other processes appended: up to the newest checkpoint at most ``max_leaves`` ahead.

        A process that does not sequence only (else a no-op). Reads the newest checkpoint within reach, then
        the leaf hashes up to its size (committed with it, so all there), appends them to the
        tree, and announces that checkpoint once its root matches the tree, its note
        verifies with the registry key and it is saved to ``signed-head.json`` (fsynced: a
        follower refuses, at its next start too, a database behind what it served). Returns
        whether the head moved. Raises
        ``LogRollbackError`` when the database no longer holds this process's head (it was
        rolled back: serving it would fork the log), ``LogIntegrityError`` when its entries
        do not make the checkpoint's root.
        """
        if self.sequences:
            # The sequencer's head moves with its own batches (announced once saved outside the database).
            return False
        with self.db.lock:
            head, log = self._head, self.log
            if log.size != head.size:
                # Leaves past the head (a batch this process appended as sequencer, which failed or was
                # refused): the database decides which exist, so the tree restarts from its head, as the
                # database has it (which also checks that the database still holds that tree).
                log.reset(load_leaves(self.db)[: head.size])
                if log.size != head.size or log.root(head.size) != head.root_hash:
                    raise LogRollbackError(
                        f"the database no longer holds the tree of size {head.size} this server handed out: "
                        "it was rolled back or replaced; serving it would fork the log",
                        hint=restore_hint(self.db, head.size),
                    )
            newest = queries.newest_checkpoint(self.db, log.size + max_leaves)
            size = -1 if newest is None else newest.tree_size
            if size < head.size:
                raise LogRollbackError(
                    f"the database's newest checkpoint is at tree size {size}, but this server already handed out "
                    f"size {head.size}: the database was rolled back; serving it would fork the log",
                    hint=restore_hint(self.db, head.size),
                )
            if newest is None or size == head.size:
                return False
            root, note = newest.root_hash, newest.note
            known = log.size
            for expected, (index, leaf) in enumerate(queries.leaf_hashes(self.db, known, size), start=known):
                if index != expected:
                    self.log.truncate(known)
                    raise LogIntegrityError(f"the log has no entry {expected} but has entry {index}: entries are missing")
                log.append(leaf)
            if log.size != size or log.root(size) != root:
                self.log.truncate(known)
                raise LogIntegrityError(f"the entries up to tree size {size} do not make the root of its checkpoint")
            try:
                verify_checkpoint(note, log.origin, log.public_key, origin=log.origin)
            except (LogProofError, MalformedInputError) as e:
                self.log.truncate(known)
                raise LogIntegrityError(f"the checkpoint at tree size {size} does not verify with the registry key: {e.message}") from e
            new = LogHead(size=size, root_hash=root, note=note)
            # Saved outside the database before it is served, as the sequencer saves what it signs: a
            # database restored from an older copy is then refused by this process too, after a restart.
            try:
                write_signed_head(self.data, signed_head(log.origin, new), root_at=log.root)
            except OSError as e:
                self.log.truncate(known)
                raise SignedHeadWriteError(
                    f"the tree head at size {size} could not be saved to {SIGNED_HEAD_FILE} ({e.strerror}); it is not "
                    "served until it is",
                    hint="make the data directory writable (and free disk space)",
                ) from e
            except LogRollbackError:
                self.log.truncate(known)
                raise
            self._head = new
        # ``on_new_head`` is not called: witnesses are the sequencer's to submit to (its own batches call it).
        logger.debug("caught up with the log to tree size %d", size)
        return True

    def take_over(self) -> int:
        """Make this process the sequencer (it just took the lease): the whole log, checked; its tree size.

        Under ``LOG_LOCK``, so an append of the previous holder still committing is waited for
        and seen. Then the head saved outside the database is checked as at start (a database
        behind it is refused, ``LogRollbackError``) and advanced.
        """
        with self.db.lock, self.db.log_held():
            while self.catch_up():
                pass
            saved = check_signed_head(self.data, self.db, self.log, adopt=False)
            advance_signed_head(self.data, self.db, self.log, self._head, saved)
            return self._head.size

    def check_lease(self) -> Cluster | None:
        """On a shared database: this process's lease, or a 503 naming the sequencer when it holds none."""
        if not self.db.dialect.shared:
            return None
        if self.cluster is None:
            raise NotSequencerError(
                "this registry was opened without the sequencer lease: only 'kvgraft serve' sequences a shared database",
                retry_after=1,
            )
        if not self.cluster.holds_lease:
            raise self.cluster.refusal()
        return self.cluster

    def guard_append(self, conn: Connection, tree_size: int) -> None:
        """Inside an append transaction on a shared database: commit only holding the lease, at the newest head."""
        cluster = self.check_lease()
        if cluster is not None:
            cluster.guard(conn, tree_size)

    def announce(self, head: LogHead) -> None:
        """Serve ``head`` from now on: committed, and saved to ``signed-head.json`` (the publisher's
        batches; under the database lock)."""
        with self.db.lock:
            self._head = head

    # --- publishing (publisher.py) -----------------------------------------------------------

    def authenticate(self, authorization: str | None) -> TokenInfo:
        """The token of an Authorization header (401/403 otherwise), counted against its rate limit (429)."""
        info = self.accounts.authenticate(authorization)
        self.rate_limiter.acquire(info.token_id)
        return info
