"""The publish pipeline: check a publish, sequence it in a batch, append, sign, commit, announce.

Every method is blocking and thread-safe; the app calls them from worker threads. A publish is
two steps (what Trillian's sequencer and Tessera do). ``prepare_publish`` checks everything
that does not depend on the log's order, without the database lock and concurrently with any
number of others: the envelope's shape and limits, its signatures against the token's keys
(remembered lookups, accounts.py), the statement, the blobs it needs, and a parent or
pre-registration that is already logged. The sequencer (log/sequencer.py, a thread of a serving
registry) then hands queued publishes to ``sequence_batch`` in batches, which holds the lock
from a fresh token check to the commit, in arrival order: a revocation, a duplicate, a parent
published in the same batch, or a crash can never interleave with it. A batch's entry rows,
their log leaves and one new signed checkpoint are committed together or not at all; the new
head is saved to ``signed-head.json`` before it is announced (``LogWriter.announce``) or any
publish of the batch is answered.

The publisher shares the tree (``TransparencyLog``) with the registry and moves the head only
through its ``LogWriter`` (the ``Registry``), which also guards an append on a shared database
with the sequencer lease.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, Protocol

import duckdb

from kvgraft.verifier import KeyId

from . import queries, search
from .accounts import Accounts, TokenInfo
from .blobs.store import BlobStore
from .datadir import SIGNED_HEAD_FILE, DataDir, write_signed_head
from .documents import entry_meta
from .entries import ArtifactFields, IndexedStatement, decode_envelope, index_statement, verify_for_token
from .errors import (
    InvalidLineageError,
    KeyNotBoundError,
    MissingBlobsError,
    RegistryError,
    SignedHeadWriteError,
    TokenRevokedError,
    storage_error,
)
from .log.sequencer import Sequencer
from .log.signedhead import signed_head, stored_head
from .log.tree import LogHead, TransparencyLog
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
from .reader import Reader
from .settings import RegistrySettings
from .storage.db import Connection, Database, insert_rows, now_utc

logger = logging.getLogger("kvgraft.registry")


class LogWriter(Protocol):
    """What the publisher needs of the registry (``service.Registry``): the announced head, to
    announce a new one, and on a shared database the sequencer lease (503 without it). A
    protocol, so that this module does not import the service that builds it."""

    @property
    def head(self) -> LogHead: ...

    def announce(self, head: LogHead) -> None: ...

    def check_lease(self) -> object: ...

    def guard_append(self, conn: Connection, tree_size: int) -> None: ...


class Publisher:
    """The registry's writes (``Registry.publisher``)."""

    def __init__(
        self,
        data: DataDir,
        db: Database,
        log: TransparencyLog,
        blobs: BlobStore,
        settings: RegistrySettings,
        accounts: Accounts,
        reader: Reader,
        state: LogWriter,
    ) -> None:
        self.data = data
        self.db = db
        self.log = log
        self.blobs = blobs
        self.settings = settings
        self.accounts = accounts
        self.reader = reader
        self.state = state
        #: Called each time a new checkpoint is durable and announced, with the database lock
        #: held (the publish's own): the witness collector's wake-up when serving. Must not block.
        self.on_new_head: Callable[[], None] | None = None
        #: The sequencer that ``submit`` queues publishes for, when serving (set by
        #: ``Registry.open``); None otherwise, where each publish is sequenced at once as a batch of one.
        self.sequencer: Sequencer[PreparedPublish, Published] | None = None

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
        self.state.check_lease()
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
            if max(index for _, index in earlier) >= self.state.head.size:
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
            if head is None or head.size <= self.state.head.size:
                return
            try:
                write_signed_head(self.data, signed_head(self.log.origin, head), root_at=self.log.root)
            except OSError as e:
                what = "the entry was recorded but its signed tree head could not be saved"
                raise storage_error(e, what) or SignedHeadWriteError(f"{what} ({e.strerror})") from e
            self.state.announce(head)
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
                    self.state.guard_append(conn, first)
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
            self.state.announce(head)
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
