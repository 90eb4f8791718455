"""The registry service: database, transparency log, blob store and accounts behind one lock.

This module holds the write path (publish, append, the signed head) and the log's head and
proofs; the reads are ``Registry.reader`` (reader.py, through the model the pages share too,
``queries.py``), the documents both build are documents.py, and the start-up checks of the
log against ``signed-head.json`` are signedhead.py.

Every method is blocking and thread-safe; the app calls them from worker threads. A publish is
two steps (what Trillian's sequencer and Tessera do). ``prepare_publish`` checks everything
that does not depend on the log's order, without the database lock and concurrently with any
number of others: the envelope's shape and limits, its signatures against the token's keys
(remembered lookups, accounts.py), the statement, the blobs it needs, and a parent or
pre-registration that is already logged. The sequencer (sequencer.py, a thread of the app)
then hands queued publishes to ``sequence_batch`` in batches, which holds the lock from a
fresh token check to the commit, in arrival order: a revocation, a duplicate, a parent
published in the same batch, or a crash can never interleave with it. A batch's entry rows,
their log leaves and one new signed checkpoint are committed together or not at all.

The log cannot fork. After each commit, and before any publish of the batch is answered, the
new tree head is written (fsynced) to ``signed-head.json`` beside the database; at start a
database behind it is refused (signedhead.py).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any

import duckdb

from kvgraft.verifier import (
    KeyId,
    LogProofError,
    MalformedInputError,
    keyid_of,
    open_signing_key,
    public_key_pem,
)

from . import queries, search
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
from .documents import entry_meta
from .entries import (
    ArtifactFields,
    IndexedStatement,
    decode_envelope,
    index_statement,
    verify_for_token,
)
from .errors import (
    InvalidLineageError,
    KeyNotBoundError,
    LogIntegrityError,
    LogRollbackError,
    MissingBlobsError,
    NotFoundError,
    NotSequencerError,
    RegistryError,
    SignedHeadWriteError,
    TokenRevokedError,
    storage_error,
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
from .publishing import (
    ENTRY_TYPES,
    REF_TYPES,
    SUBJECT_TYPES,
    NewEntry,
    PreparedPublish,
    Published,
    check_join,
    check_pre_registration,
    check_walk,
    copy_error,
    digest_of,
    stops_unlogged,
)
from .queries import Ancestry, EntryRow
from .ratelimit import RateLimiter
from .reader import Reader
from .settings import RegistrySettings
from .storage.db import Connection, Database, insert_rows, now_utc

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
        #: Called each time a new checkpoint is durable and announced, with the database lock
        #: held (the publish's own): the witness collector's wake-up when serving. Must not block.
        self.on_new_head: Callable[[], None] | None = None
        #: The sequencer (sequencer.py) that ``submit`` queues publishes for, when serving; None
        #: otherwise, where each publish is sequenced at once as a batch of one.
        self.sequencer: Sequencer[PreparedPublish, Published] | None = None
        #: On a shared (PostgreSQL) database, when serving: this process's sequencer lease
        #: (cluster.py); without one this process sequences nothing there.
        self.cluster: Cluster | None = None
        #: The background re-hash of every blob (``--scrub-interval``), when serving.
        self.scrubber: BlobScrubber | None = None
        #: The reads (reader.py), at the head this registry announces.
        self.reader = Reader(db, settings, log, self.cosignatures, self.accounts, self)

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
            self.on_new_head = collector.notify
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
        self.sequencer = Sequencer(
            self.sequence_batch,
            batch_max_entries=settings.batch_max_entries,
            batch_wait_ms=settings.batch_wait_ms,
            max_queue=settings.max_publish_queue,
            max_queue_bytes=settings.max_publish_queue_bytes,
        )
        self.sequencer.start()
        stack.callback(self.sequencer.stop)

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

    def _check_lease(self) -> Cluster | None:
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

    def _guard_append(self, conn: Connection, tree_size: int) -> None:
        """Inside an append transaction on a shared database: commit only holding the lease, at the newest head."""
        cluster = self._check_lease()
        if cluster is not None:
            cluster.guard(conn, tree_size)

    # --- publishing ------------------------------------------------------------------------

    def authenticate(self, authorization: str | None) -> TokenInfo:
        """The token of an Authorization header (401/403 otherwise), counted against its rate limit (429)."""
        info = self.accounts.authenticate(authorization)
        self.rate_limiter.acquire(info.token_id)
        return info

    def publish(self, body: bytes, token: TokenInfo) -> Published:
        """Verify, check and log the envelope ``body`` posted with ``token``; blocks until it is durable.

        Idempotent: the same bytes again return the existing entry with ``created`` False.
        ``prepare_publish``, then ``submit``: the app runs the two apart, so that no worker
        thread waits for a batch.
        """
        prepared = self.prepare_publish(body, token)
        if isinstance(prepared, Published):
            return prepared
        return self.submit(prepared).result()

    def prepare_publish(self, body: bytes, token: TokenInfo) -> PreparedPublish | Published:
        """Every check of a publish that does not depend on the log's order, without the database lock.

        Runs concurrently for any number of publishes. In order: the envelope's size, depth
        and signature count (before a single signature is verified), its signatures against the
        keys ``token`` is bound to, the statement, that every blob it needs is stored, and what
        can be read from committed entries only: a child's parent entry, where the child
        starts, and its lineage walk (cycle, depth); a replay's pre-registration entry. A parent
        or pre-registration not logged yet is left to the sequencer, which also sees the
        entries of the same batch. A refusal of an envelope that is already logged answers
        that entry instead (``Published``, created False), as the sequencer would.
        """
        settings = self.settings
        # Size, depth and signature count are refused before a single signature is verified.
        envelope = decode_envelope(body, max_signatures=settings.max_signatures, max_json_depth=settings.max_json_depth)
        digest = digest_of(body)
        # Remembered lookups (accounts.py): no database statement, so no wait for a batch's commit.
        bound, registered = self.accounts.bound_keys(token), self.accounts.registered_keys()
        verified, statement = verify_for_token(envelope, bound, registered)
        indexed = index_statement(statement)
        try:
            missing = self.blobs.missing(indexed.required_blobs)
            if missing:
                shown = ", ".join("sha256:" + h for h in missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
                raise MissingBlobsError(
                    f"the statement names {len(missing)} blob(s) this registry does not hold: {shown}",
                    extra={"missing": ["sha256:" + h for h in missing]},
                )
            lineage = self._lineage_from_log(indexed.artifact) if indexed.artifact is not None else None
            ref = indexed.pre_registration
            pre_registered = False
            if ref is not None:
                found = queries.entry_by_digest(self.db, ref[0])
                if found is not None:
                    check_pre_registration(ref, found)
                    pre_registered = True
        except RegistryError:
            # Bytes already logged get their entry before any of these refusals (a quarantined
            # blob, or a lowered depth limit, refuses only what is new).
            existing = queries.index_of(self.db, digest)
            if existing is not None:
                return Published(self.reader.entry_document(existing), created=False)
            raise
        return PreparedPublish(
            body=body,
            digest=digest,
            payload_type=envelope.payload_type,
            indexed=indexed,
            token=token,
            signers=tuple(k.keyid for k in verified.signers),
            lineage=lineage,
            pre_registered=pre_registered,
        )

    def submit(self, prepared: PreparedPublish) -> Future[Published]:
        """Queue a prepared publish for the sequencer; the future resolves once its batch is durable.

        Never blocks while the app's sequencer runs (``PublishQueueFullError`` when its queue is
        full). Without a sequencer (a registry opened outside the app) the publish is sequenced
        at once, as a batch of one, in the calling thread.
        """
        self._check_lease()
        if self.sequencer is not None:
            return self.sequencer.submit(prepared)
        future: Future[Published] = Future()
        (outcome,) = self.sequence_batch([prepared])
        if isinstance(outcome, RegistryError):
            future.set_exception(outcome)
        else:
            future.set_result(outcome)
        return future

    def sequence_batch(self, batch: Sequence[PreparedPublish]) -> list[Published | RegistryError]:
        """Check ``batch`` in order against the log and append what passes: one transaction, one checkpoint.

        Holds the database lock throughout. For each publish, in arrival order: its token is
        read again (a revocation committed before the batch refuses it, 403; one after comes
        after the entry in every sense) and must still be bound to every key that signed; bytes
        already logged, before or earlier in this batch, get that entry (created False); a
        parent or pre-registration not found when the publish was prepared is looked up in the
        log and among the batch's earlier entries, and a lineage walk that stopped at an
        unlogged ancestor is walked again the same way. One publish's refusal is its own
        answer; the others go on. The accepted entries are then appended together
        (``_append_entries``): if that fails, each of them (and each duplicate of one) fails
        with the same error and nothing of the batch is in the tree, the database or the head.
        Returns one outcome per publish, in order.
        """
        outcomes: list[Published | RegistryError | None] = [None] * len(batch)
        accepted: list[tuple[int, NewEntry]] = []
        # Duplicates of an entry of this batch: (position in batch, position in accepted).
        repeats: list[tuple[int, int]] = []
        # Duplicates of a committed entry: (position in batch, log index), answered once it is announced.
        earlier: list[tuple[int, int]] = []
        with self.db.lock:
            self.accounts.sync()  # a shared database: see changes other processes made to tokens and keys
            logged = queries.indices_of(self.db, [p.digest for p in batch])
            integrated_at = now_utc()
            batch_digests: dict[str, int] = {}
            batch_artifacts: dict[str, EntryRow] = {}
            for i, p in enumerate(batch):
                try:
                    current = self._token_now(p)
                    if p.digest in logged:
                        earlier.append((i, logged[p.digest]))
                        continue
                    if p.digest in batch_digests:
                        repeats.append((i, batch_digests[p.digest]))
                        continue
                    self._check_lineage_in_batch(p, batch_artifacts)
                    if p.indexed.pre_registration is not None and not p.pre_registered:
                        ref = p.indexed.pre_registration
                        found = queries.entry_by_digest(self.db, ref[0])
                        if found is None:
                            found = next((e.row for _, e in accepted if e.row.digest == ref[0]), None)
                        check_pre_registration(ref, found)
                except RegistryError as e:
                    outcomes[i] = e
                    continue
                entry = NewEntry(p, current, self.log.size + len(accepted), integrated_at)
                batch_digests[p.digest] = len(accepted)
                a = entry.row.artifact
                if a is not None:
                    batch_artifacts.setdefault(a.digest, entry.row)
                accepted.append((i, entry))
            if accepted:
                try:
                    head = self._append_entries([e for _, e in accepted])
                except RegistryError as e:
                    for i, _ in accepted:
                        outcomes[i] = copy_error(e)
                    for i, _ in repeats:
                        outcomes[i] = copy_error(e)
                else:
                    documents = [self._new_entry_document(e, head) for _, e in accepted]
                    for (i, _), document in zip(accepted, documents, strict=True):
                        outcomes[i] = Published(document, created=True)
                    for i, j in repeats:
                        outcomes[i] = Published(documents[j], created=False)
            if earlier:
                self._answer_earlier(earlier, outcomes)
        done = [o for o in outcomes if o is not None]
        if len(done) != len(batch):
            raise RegistryError(f"the sequencer left {len(batch) - len(done)} publish(es) of a batch unanswered")
        return done

    def _answer_earlier(self, earlier: list[tuple[int, int]], outcomes: list[Published | RegistryError | None]) -> None:
        """Answer the publishes of bytes already logged with their entries (created False).

        An entry committed by a batch whose head could not be saved is not announced yet: it
        is announced now (the latest stored checkpoint covers it), which is how posting the
        same envelope again recovers from ``SignedHeadWriteError``, as its hint says.
        """
        try:
            if max(index for _, index in earlier) >= self._head.size:
                self._announce_committed()
        except RegistryError as e:
            for i, _ in earlier:
                outcomes[i] = copy_error(e)
            return
        for i, index in earlier:
            try:
                outcomes[i] = Published(self.reader.entry_document(index), created=False)
            except RegistryError as e:
                outcomes[i] = e

    def _announce_committed(self) -> None:
        """Save and announce the latest stored checkpoint, which covers entries committed but not announced."""
        with self.db.lock:
            head = stored_head(self.db, self.log)
            if head is None or head.size <= self._head.size:
                return
            try:
                write_signed_head(self.data, signed_head(self.log.origin, head), root_at=self.log.root)
            except OSError as e:
                what = "the entry was recorded but its signed tree head could not be saved"
                raise storage_error(e, what) or SignedHeadWriteError(f"{what} ({e.strerror})") from e
            self._head = head
        if self.on_new_head is not None:
            self.on_new_head()

    def _token_now(self, p: PreparedPublish) -> TokenInfo:
        """The publish's token as it stands now, still bound to every key that signed (403 otherwise)."""
        current = self.accounts.authenticate_id(p.token.token_id)
        if current is None:
            raise TokenRevokedError(f"token {p.token.token_id} was revoked")
        still_bound = {k.keyid for k in self.accounts.bound_keys(current)}
        unbound = [k for k in p.signers if k not in still_bound]
        if unbound:
            raise KeyNotBoundError(f"key {unbound[0][:16]}... signed the envelope, but this token is no longer bound to it")
        return current

    def _lineage_from_log(self, artifact: ArtifactFields) -> Ancestry | None:
        """The lineage checks committed entries decide; None for a root, or when the parent has no entry yet.

        Refuses (``InvalidLineageError``) a child that does not start where its parent's first
        entry ends, or whose walk up from it cycles or runs past ``max_lineage_depth``. The
        parent's first entry never changes once logged (later entries have larger indices),
        nor do its ancestors', so this holds when the publish is sequenced, unless the walk
        stopped at an ancestor without an entry (``_check_lineage_in_batch`` walks on then).
        """
        if artifact.parent is None:
            return None
        with self.db.lock:  # the parent and the walk from it read one state of the log
            parent = queries.first_artifact_entry(self.db, artifact.parent)
            if parent is None or parent.artifact is None:
                return None
            check_join(artifact, parent)
            walk = queries.ancestors(self.db, artifact.digest, artifact.parent, self.settings.max_lineage_depth)
        check_walk(walk, self.settings.max_lineage_depth)
        return walk

    def _check_lineage_in_batch(self, p: PreparedPublish, batch_artifacts: dict[str, EntryRow]) -> None:
        """Refuse a child that does not join its parent, seeing the log and the batch's earlier entries.

        Needed only when the parent had no entry when the publish was prepared (it may be in an
        earlier batch since, or earlier in this one), or the walk from it stopped at an ancestor
        without one. Each artifact is described by its first entry, logged before any of the
        batch's; the walk is ``queries.ancestors``, bounded and cycle-safe as at prepare.
        """
        artifact = p.indexed.artifact
        if artifact is None or artifact.parent is None:
            return
        walk = p.lineage
        if walk is not None and not stops_unlogged(walk):
            return

        def first_entry(digest: str) -> EntryRow | None:
            return queries.first_artifact_entry(self.db, digest) or batch_artifacts.get(digest)

        parent = first_entry(artifact.parent)
        if parent is None or parent.artifact is None:
            raise InvalidLineageError(
                f"the artifact's parent {artifact.parent} has no entry in this log",
                hint="publish the parent artifact's statement first, then its children",
            )
        check_join(artifact, parent)
        limit = self.settings.max_lineage_depth
        check_walk(queries.ancestors(self.db, artifact.digest, artifact.parent, limit, first_entry=first_entry), limit)

    def _append(
        self, body: bytes, digest: str, payload_type: str, indexed: IndexedStatement, token: TokenInfo, keyids: list[KeyId]
    ) -> int:
        """Append one entry without any check (what the sequencer does for a batch of one); its index."""
        prepared = PreparedPublish(body, digest, payload_type, indexed, token, tuple(keyids), None, False)
        with self.db.lock:
            entry = NewEntry(prepared, token, self.log.size, now_utc())
            self._append_entries([entry])
        return entry.row.log_index

    def _append_entries(self, entries: Sequence[NewEntry]) -> LogHead:
        """Append ``entries`` (numbered from the tree's size on) and sign, commit and announce one checkpoint.

        Under the database lock. The leaves join the in-memory tree, the checkpoint of the new
        size is signed, and the entry rows, their subjects, references and search words and the
        checkpoint are one transaction: all or nothing. If it fails the tree forgets the leaves
        (rebuilt from the database, the record). Once committed, the head is written (fsynced) to
        ``signed-head.json``, and only then announced (``head``, ``on_new_head``) and answered.
        """
        with self.db.lock:
            first = self.log.size
            for n, entry in enumerate(entries):
                if entry.row.log_index != first + n:
                    raise RegistryError(f"entry {entry.row.log_index} was numbered out of turn (the log has {first + n})")
                self.log.append(entry.row.leaf_hash)
            try:
                head = self.log.sign()
                with self.db.transaction() as conn:
                    self._guard_append(conn, first)
                    insert_rows(conn, "entries", ENTRY_TYPES, [e.entries_row() for e in entries])
                    insert_rows(conn, "entry_subjects", SUBJECT_TYPES,
                                [(e.row.log_index, name, d) for e in entries for name, d in e.prepared.indexed.subjects])
                    insert_rows(conn, "entry_refs", REF_TYPES,
                                [(e.row.log_index, ref, role) for e in entries for ref, role in e.prepared.indexed.refs])
                    search.index_texts(
                        conn, [(e.row.log_index, e.row.artifact.source_text) for e in entries if e.row.artifact is not None]
                    )
                    conn.execute(
                        "INSERT INTO checkpoints VALUES (?, ?, ?, ?)", [head.size, head.root_hash, head.note, now_utc()]
                    )
            except BaseException as e:
                # The commit failed: the database has neither the entries nor the checkpoint, so the
                # in-memory tree forgets the leaves too. In memory, so it cannot fail as a reload from
                # a database that just failed could (and leave leaves no checkpoint may ever cover).
                self.log.truncate(first)
                what = "the entry could not be recorded" if len(entries) == 1 else f"the {len(entries)} entries of this batch could not be recorded"
                if isinstance(e, duckdb.Error):
                    raise storage_error(e, what) or RegistryError(f"{what}: the database refused them") from e
                raise
            # Committed. The head is announced (to readers, and to these publishers) only once it is
            # durable outside the database too; if that write fails the entries stay recorded but
            # unannounced, and the next batch (or restart) announces them with its successor.
            try:
                write_signed_head(self.data, signed_head(self.log.origin, head), root_at=self.log.root)
            except OSError as e:
                logger.error("entries %d to %d committed, but %s could not be written: %s", first, head.size - 1, SIGNED_HEAD_FILE, e)
                what = "the entry was recorded but its signed tree head could not be saved"
                raise storage_error(e, what) or SignedHeadWriteError(f"{what} ({e.strerror})") from e
            self._head = head
        for entry in entries:
            logger.info("entry %d: %s %s by %s", entry.row.log_index, entry.row.kind, entry.row.digest, entry.row.publisher)
        logger.debug("batch of %d entries: tree size %d", len(entries), head.size)
        if self.on_new_head is not None:
            self.on_new_head()
        return head

    def _new_entry_document(self, entry: NewEntry, head: LogHead) -> dict[str, Any]:
        """The answer to a publish just appended: what ``_entry_document`` reads back, from memory.

        A checkpoint announced a moment ago has no witness cosignature yet (they are stored under
        the lock this batch still holds), so its note is served bare.
        """
        subjects = [{"name": n, "digest": d} for n, d in sorted(entry.prepared.indexed.subjects)]
        return {
            "entry": entry_meta(entry.row, subjects),
            "inclusion_proof": self.log.inclusion(entry.row.log_index, head.size),
            "checkpoint": head.note.decode("utf-8"),
        }
