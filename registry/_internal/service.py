"""The registry service: database, transparency log, blob store and accounts behind one lock.

This module holds the write path (publish, append, the signed head) and builds the API's
documents; its read methods read through the model the pages share too, ``queries.py`` (only
the start-up checks of the log read their tables directly).

Every method is blocking and thread-safe; the app calls them from worker threads. Publishing
verifies the envelope's signatures first, without the database lock (that is the costly
part, and a stranger's envelope must not stall other requests), then holds the lock from a
fresh token check to the commit, so a revocation, a concurrent publish or a crash can never
interleave with it: the entry row, its log leaf and the new signed checkpoint are committed
together or not at all.

The log cannot fork. After each commit, and before the publish is answered, the new tree
head is written (fsynced) to ``signed-head.json`` beside the database. At start the registry
refuses a database whose tree is smaller than that head, or whose root at that size differs
(``LogRollbackError``): a lost WAL or a restored older copy would otherwise make it sign a
second, different tree of a size it already signed. A database ahead of the file (a crash
between the commit and the file write) is fine: the file is advanced to the database's head.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import duckdb

from kvgraft.schemas import DocumentError, parse_json, payload_unverified
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
from .blobs import BlobStore, open_blob_store, parse_digest_ref
from .cosignatures import CosignatureStore
from .datadir import (
    SIGNED_HEAD_FILE,
    DataDir,
    SignedHead,
    check_registry_key,
    ensure_registry_key,
    prepare,
    read_signed_head,
    remove_stale_head_temps,
    resolve_origin,
    write_signed_head,
)
from .db import Database, now_utc
from .entries import (
    ArtifactFields,
    IndexedStatement,
    decode_envelope,
    index_statement,
    verify_for_token,
)
from .errors import (
    ArtifactNotFoundError,
    BadRequestError,
    EntryNotFoundError,
    InvalidLineageError,
    InvalidStatementError,
    KeyNotBoundError,
    LogIntegrityError,
    LogRollbackError,
    MissingBlobsError,
    MissingReferenceError,
    NotFoundError,
    RegistryError,
    SignedHeadWriteError,
    TokenRevokedError,
    storage_error,
)
from .log import LogHead, TransparencyLog, format_vkey, hash_leaf, verify_checkpoint
from .queries import ArtifactFilter, EntryRow, Listing, RecordFilter, Seek
from .ratelimit import RateLimiter
from .settings import RegistrySettings

logger = logging.getLogger("kvgraft.registry")

#: A log index in a path: ASCII digits only (str.isdigit() also takes '³' and '٣'), at most 19 (BIGINT).
_INDEX_REF = re.compile(r"[0-9]{1,19}", re.ASCII)
#: The meta key recording that this database has written signed-head.json at least once.
_HEAD_FILE_META = "signed_head_file"
_TEXT_PREVIEW = 200


@dataclass(frozen=True)
class Page:
    """One page of a listing, and the cursor of the next (None at the end)."""

    items: list[dict[str, Any]]
    next_cursor: str | None


@dataclass(frozen=True)
class Published:
    """The outcome of a publish: the entry document and whether it is new."""

    document: dict[str, Any]
    created: bool


#: A cursor is the decimal log index the next page continues after: any such number is a valid
#: cursor (the page after it may be empty), so the API's schema can say exactly what it accepts.
_CURSOR = re.compile(r"(?:0|[1-9][0-9]{0,18})", re.ASCII)


def encode_cursor(log_index: int) -> str:
    """The cursor meaning "after entry ``log_index``" (stable: the log only grows): its decimal."""
    return str(log_index)


def decode_cursor(cursor: str | None) -> int:
    """The log index a cursor continues after (-1 for the first page, no cursor or an empty one)."""
    if cursor is None or cursor == "":
        return -1
    if _CURSOR.fullmatch(cursor) is None:
        raise BadRequestError(
            f"cursor {cursor[:40]!r} is not one this registry issued",
            hint="pass next_cursor from the previous page unchanged, or no cursor for the first page",
        )
    return int(cursor)


def _digest_of(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


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
        #: Called (without the lock) each time a new checkpoint is durable and announced: the app
        #: wakes its witness collector with it. Must not block.
        self.on_new_head: Callable[[], None] | None = None

    @classmethod
    @contextlib.contextmanager
    def open(cls, root: Path, settings: RegistrySettings) -> Iterator[Registry]:
        """Open (initialising on first use) the data directory ``root``; close it when the block ends.

        Creates the registry key and fixes the log's origin on first start; rebuilds the Merkle
        tree from the stored leaves and refuses to serve a log whose latest checkpoint does not
        match it (``LogIntegrityError``).
        """
        data = prepare(root)
        db = Database.open(root, wait_seconds=settings.lock_wait_seconds)
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
                log = TransparencyLog(origin, key, _load_leaves(db))
                # The database must agree with itself, then with the head saved outside it, before
                # anything is signed (an empty database gets checkpoint 0 signed here).
                stored = _stored_head(db, log)
                saved = _check_signed_head(data, db, log)
                head = stored if stored is not None else _sign_empty(db, log)
                _advance_signed_head(data, db, log, head, saved)
                logger.info("registry %s: log %s at size %d", root, origin, log.size)
                started = True
                yield cls(data, db, log, blobs, settings, head)
        finally:
            # A refused start leaves the database file and its WAL untouched.
            db.close(checkpoint=started)

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
            raise NotFoundError(
                f"no checkpoint was signed at tree size {tree_size} (the log has {head.size} entries)",
                hint="ask for a size between 0 and the latest checkpoint's",
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
        head = self._head.size
        if tree_size is None:
            return head
        if not 0 <= tree_size <= head:
            raise NotFoundError(
                f"tree size {tree_size} is outside the log, which has {head} entries",
                hint="ask for a tree size no larger than the latest checkpoint's",
            )
        return tree_size

    # --- publishing ------------------------------------------------------------------------

    def authenticate(self, authorization: str | None) -> TokenInfo:
        """The token of an Authorization header (401/403 otherwise), counted against its rate limit (429)."""
        info = self.accounts.authenticate(authorization)
        self.rate_limiter.acquire(info.token_id)
        return info

    def publish(self, body: bytes, token: TokenInfo) -> Published:
        """Verify, check and log the envelope ``body`` posted with ``token``.

        Idempotent: the same bytes again return the existing entry with ``created`` False.
        """
        settings = self.settings
        # Size, depth and signature count are refused before a single signature is verified.
        envelope = decode_envelope(body, max_signatures=settings.max_signatures, max_json_depth=settings.max_json_depth)
        digest = _digest_of(body)
        # The verification runs without the database lock: each key query below takes it only
        # for its own statement, so a slow envelope stalls no other request.
        bound, registered = self.accounts.bound_keys(token), self.accounts.registered_keys()
        verified, statement = verify_for_token(envelope, bound, registered)
        indexed = index_statement(statement)
        signers = [k.keyid for k in verified.signers]
        with self.db.lock:
            # Re-read the token under the lock: a revocation that committed before this point
            # refuses the publish, one after it comes after the entry in every sense.
            current = self.accounts.authenticate_id(token.token_id)
            if current is None:
                raise TokenRevokedError(f"token {token.token_id} was revoked")
            still_bound = {k.keyid for k in self.accounts.bound_keys(current)}
            unbound = [k for k in signers if k not in still_bound]
            if unbound:
                raise KeyNotBoundError(
                    f"key {unbound[0][:16]}... signed the envelope, but this token is no longer bound to it"
                )
            existing = queries.index_of(self.db, digest)
            if existing is not None:
                return Published(self._entry_document(existing), created=False)
            missing = self.blobs.missing(indexed.required_blobs)
            if missing:
                shown = ", ".join("sha256:" + h for h in missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
                raise MissingBlobsError(
                    f"the statement names {len(missing)} blob(s) this registry does not hold: {shown}",
                    extra={"missing": ["sha256:" + h for h in missing]},
                )
            if indexed.artifact is not None:
                self._check_lineage(indexed.artifact)
            if indexed.pre_registration is not None:
                self._check_pre_registration(*indexed.pre_registration)
            index = self._append(body, digest, envelope.payload_type, indexed, current, signers)
            logger.info("entry %d: %s %s by %s", index, indexed.kind, digest, current.publisher)
            return Published(self._entry_document(index), created=True)

    def _check_lineage(self, artifact: ArtifactFields) -> None:
        """Refuse a child that does not join its parent: no parent entry, a gap, a cycle, too deep.

        The parent is described by its first entry (as every lineage view describes it); the
        walk up from it is ``queries.ancestors``, bounded by ``max_lineage_depth`` and cycle-safe,
        so even a cycle in old data ends it.
        """
        if artifact.parent is None:
            return
        limit = self.settings.max_lineage_depth
        parent = queries.first_artifact_entry(self.db, artifact.parent)
        if parent is None or parent.artifact is None:
            raise InvalidLineageError(
                f"the artifact's parent {artifact.parent} has no entry in this log",
                hint="publish the parent artifact's statement first, then its children",
            )
        parent_end = parent.artifact.position_end
        if artifact.position_start != parent_end:
            raise InvalidLineageError(
                f"the artifact starts at position {artifact.position_start}, but its parent {artifact.parent} "
                f"ends at position {parent_end}: a child must start where its parent ends"
            )
        walk = queries.ancestors(self.db, artifact.digest, artifact.parent, limit)
        if walk.cut == "cycle":
            raise InvalidLineageError(
                f"the artifact's parent chain reaches {walk.cut_at} twice: publishing it would make a lineage cycle"
            )
        if walk.cut == "depth":
            raise InvalidLineageError(
                f"the artifact's parent chain is more than {limit} artifacts deep",
                hint=f"start a new root artifact; lineages here are at most {limit} deep (max_lineage_depth)",
                extra={"limit": limit},
            )

    def _check_pre_registration(self, digest: str, log_index: int) -> None:
        found = queries.entry_by_digest(self.db, digest)
        if found is None:
            raise MissingReferenceError(f"the replay answers to pre-registration {digest}, which is not in this log")
        if found.log_index != log_index or found.kind != "pre-registration":
            raise InvalidStatementError(
                f"the replay says its pre-registration {digest} is entry {log_index}, but that digest is "
                f"entry {found.log_index} ({found.kind})",
                hint="point the replay at the pre-registration's real log index",
            )

    def _append(
        self, body: bytes, digest: str, payload_type: str, indexed: IndexedStatement, token: TokenInfo, keyids: list[KeyId]
    ) -> int:
        leaf = hash_leaf(body)
        index = self.log.append(leaf)
        try:
            head = self.log.sign()
            a = indexed.artifact
            with self.db.transaction() as conn:
                conn.execute(
                    "INSERT INTO entries VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    [
                        index, digest, leaf, body, payload_type, indexed.predicate_type, indexed.kind,
                        token.publisher, keyids, token.token_id, now_utc(),
                        a.digest if a else None, a.model_name if a else None, a.model_weights_digest if a else None,
                        a.model_config_digest if a else None, a.profile_name if a else None, a.parent if a else None,
                        a.chain_key if a else None, a.position_start if a else None, a.position_end if a else None,
                        a.source_text if a else None, a.source_text_digest if a else None,
                    ],
                )
                for name, subject_digest in indexed.subjects:
                    conn.execute("INSERT INTO entry_subjects VALUES (?, ?, ?)", [index, name, subject_digest])
                for ref, role in indexed.refs:
                    conn.execute("INSERT INTO entry_refs VALUES (?, ?, ?)", [index, ref, role])
                if a is not None:
                    search.index_terms(conn, index, a.source_text)
                conn.execute(
                    "INSERT INTO checkpoints VALUES (?, ?, ?, ?)", [head.size, head.root_hash, head.note, now_utc()]
                )
        except BaseException as e:
            # The commit failed: the database has neither the entry nor the checkpoint, so the
            # in-memory tree must forget the leaf too.
            self.log.reset(_load_leaves(self.db))
            if isinstance(e, duckdb.Error):
                raise storage_error(e, "the entry could not be recorded") or RegistryError(
                    "the entry could not be recorded: the database refused it"
                ) from e
            raise
        # Committed. The head is announced (to readers, and to this publisher) only once it is
        # durable outside the database too; if that write fails the entry stays recorded but
        # unannounced, and the next publish (or restart) announces it with its successor.
        try:
            write_signed_head(self.data, _signed(self.log.origin, head))
        except OSError as e:
            logger.error("entry %d committed, but %s could not be written: %s", index, SIGNED_HEAD_FILE, e)
            what = "the entry was recorded but its signed tree head could not be saved"
            raise storage_error(e, what) or SignedHeadWriteError(f"{what} ({e.strerror})") from e
        self._head = head
        if self.on_new_head is not None:
            self.on_new_head()
        return index

    # --- reading entries -------------------------------------------------------------------

    def _render(self, rows: list[EntryRow]) -> list[dict[str, Any]]:
        subjects = queries.subjects(self.db, [r.log_index for r in rows])
        return [_entry_meta(r, [s._asdict() for s in subjects.get(r.log_index, [])]) for r in rows]

    def resolve_entry(self, ref: str) -> int:
        """The log index named by ``ref``: a decimal index or ``sha256:<hex>`` of the envelope."""
        with self.db.lock:
            if _INDEX_REF.fullmatch(ref):
                index = int(ref)
                size = self._head.size
                if index >= size:
                    raise EntryNotFoundError(f"the log has {size} entries; there is no entry {index}")
                return index
            if ref.startswith("sha256:"):
                parse_digest_ref(ref, what="entry digest")
                found = queries.index_of(self.db, ref)
                if found is None:
                    raise EntryNotFoundError(f"no entry has digest {ref}")
                return found
        raise BadRequestError(
            f"{ref[:80]!r} names no entry",
            hint="use a log index (ASCII digits: 0, 1, ...) or the envelope's digest sha256:<64 lowercase hex>",
        )

    def _entry_document(self, index: int) -> dict[str, Any]:
        with self.db.lock:
            row = queries.entry_at(self.db, index)
            if row is None:
                raise EntryNotFoundError(f"there is no entry {index}")
            head = self._head
            return {
                "entry": self._render([row])[0],
                "inclusion_proof": self.log.inclusion(index, head.size),
                "checkpoint": (head.note + self.cosignatures.lines(head.size)).decode("utf-8"),
            }

    def entry(self, ref: str) -> dict[str, Any]:
        """An entry's metadata with its inclusion proof at the latest checkpoint, and that checkpoint."""
        with self.db.lock:
            return self._entry_document(self.resolve_entry(ref))

    def envelope(self, ref: str) -> tuple[bytes, str]:
        """The exact stored envelope bytes of an entry, and its digest."""
        with self.db.lock:
            index = self.resolve_entry(ref)
            stored = queries.stored_envelope(self.db, index)
        if stored is None:
            raise EntryNotFoundError(f"there is no entry {index}")
        return stored.envelope, stored.digest

    def list_entries(self, cursor: str | None, limit: int) -> Page:
        """Entries in log order (for mirrors and auditors)."""
        seek = Seek(limit, after=decode_cursor(cursor))
        with self.db.lock:
            listing = queries.entries(self.db, queries.ALL, seek)
            return _page(self._render(listing.rows), listing)

    # --- artifacts and records -------------------------------------------------------------

    def list_artifacts(
        self,
        *,
        model: str | None = None,
        profile: str | None = None,
        parent: str | None = None,
        publisher: str | None = None,
        q: str | None = None,
        cursor: str | None = None,
        limit: int,
    ) -> Page:
        """Artifact entries in log order, filtered (``queries.ArtifactFilter``); ``parent="none"`` lists roots."""
        seek = Seek(limit, after=decode_cursor(cursor))
        # Checked and bounded before the lock: a refused query never reaches the database.
        where = ArtifactFilter(model=model, profile=profile, parent=parent, publisher=publisher, q=q).where(self.settings)
        with self.db.lock:
            listing = queries.entries(self.db, where, seek)
        return _page([_artifact_summary(r) for r in listing.rows], listing)

    def artifact(self, digest: str) -> dict[str, Any]:
        """An artifact by its tensors digest: statement, envelope, entry, lineage, proof, checkpoint."""
        with self.db.lock:
            rows = queries.artifact_entries(self.db, digest)
            if not rows:
                raise ArtifactNotFoundError(f"no KV artifact with tensors {digest} is in this registry")
            first = rows[0]
            stored = queries.stored_envelope(self.db, first.log_index)
            envelope_bytes = b"" if stored is None else stored.envelope
            head = self._head
            document = {
                "artifact": _artifact_summary(first, full_text=True),
                "entry": self._render([first])[0],
                "other_entries": [{"log_index": r.log_index, "digest": r.digest, "publisher": r.publisher} for r in rows[1:]],
                "statement": _statement_json(envelope_bytes),
                "envelope": parse_json(envelope_bytes, what="stored envelope"),
                "lineage": self._lineage(first),
                "inclusion_proof": self.log.inclusion(first.log_index, head.size),
                "checkpoint": (head.note + self.cosignatures.lines(head.size)).decode("utf-8"),
            }
        return document

    def _lineage(self, row: EntryRow) -> dict[str, Any]:
        assert row.artifact is not None
        walk = queries.ancestors(self.db, row.artifact.digest, row.artifact.parent, self.settings.max_lineage_depth)
        if walk.cut == "cycle":
            logger.error("artifact lineage of %s has a cycle at %s", row.artifact.digest, walk.cut_at)
        parents = [
            {"digest": a.digest, "log_index": None} if a.entry is None else _artifact_summary(a.entry)
            for a in walk.ancestors
        ]
        children = queries.children(self.db, row.artifact.digest)
        return {"parents": parents, "children": [_artifact_summary(r) for r in children]}

    def list_records(
        self,
        *,
        artifact: str | None = None,
        kind: str | None = None,
        publisher: str | None = None,
        cursor: str | None = None,
        limit: int,
    ) -> Page:
        """Record entries (exactness, evaluation, pre-registration, replay) in log order, filtered."""
        seek = Seek(limit, after=decode_cursor(cursor))
        where = RecordFilter(kind=kind, publisher=publisher, artifact=artifact).where(
            artifacts_hint="list artifacts with GET /v1/artifacts"
        )
        with self.db.lock:
            listing = queries.entries(self.db, where, seek)
            return _page(self._render(listing.rows), listing)

    def publishers(self) -> list[dict[str, Any]]:
        """Publishers and their keys."""
        return self.accounts.publishers()


# --- helpers -----------------------------------------------------------------------------------


def _load_leaves(db: Database) -> list[bytes]:
    rows = db.query("SELECT log_index, leaf_hash FROM entries ORDER BY log_index")
    leaves = []
    for expected, (index, leaf) in enumerate(rows):
        if int(index) != expected:
            raise LogIntegrityError(f"the log has no entry {expected} but has entry {index}: entries are missing")
        leaves.append(bytes(leaf))
    return leaves


def _sign_empty(db: Database, log: TransparencyLog) -> LogHead:
    head = log.sign(0)
    with db.transaction() as conn:
        conn.execute("INSERT INTO checkpoints VALUES (?, ?, ?, ?)", [0, head.root_hash, head.note, now_utc()])
    return head


def _stored_head(db: Database, log: TransparencyLog) -> LogHead | None:
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


def _signed(origin: str, head: LogHead) -> SignedHead:
    return SignedHead(origin=origin, tree_size=head.size, root_hash=head.root_hash, checkpoint=head.note)


def _check_signed_head(data: DataDir, db: Database, log: TransparencyLog) -> SignedHead | None:
    """Refuse a database behind, or different from, the last tree head this registry signed.

    Returns the saved head (None when there is none yet: a new data directory, or one made
    before heads were saved). Raises ``LogRollbackError`` (one line: what happened, how to
    recover) when the database's tree is smaller than the saved head, its root at that size
    differs, or the file was removed from a database that had written one.
    """
    remove_stale_head_temps(data)
    saved = read_signed_head(data)
    if saved is None:
        if db.get_meta(_HEAD_FILE_META) is not None:
            raise LogRollbackError(
                f"{SIGNED_HEAD_FILE} is missing from the data directory, but this database has written one: "
                "without it the registry cannot tell whether the database was rolled back",
                hint=f"restore {SIGNED_HEAD_FILE} from the backup registry.duckdb came from; do not start without it",
            )
        return None
    try:
        checkpoint = verify_checkpoint(saved.checkpoint, log.origin, log.public_key, origin=log.origin)
    except (LogProofError, MalformedInputError) as e:
        raise LogRollbackError(
            f"{SIGNED_HEAD_FILE} holds a checkpoint that does not verify as this log's ({log.origin}): {e.message}",
            hint=f"restore {SIGNED_HEAD_FILE} from the same backup as registry.duckdb and the registry key",
        ) from e
    if (checkpoint.size, checkpoint.root_hash) != (saved.tree_size, saved.root_hash) or saved.origin != log.origin:
        raise LogRollbackError(
            f"{SIGNED_HEAD_FILE} names tree size {saved.tree_size} (log {saved.origin!r}), but its signed "
            f"checkpoint is for size {checkpoint.size} of log {log.origin!r}",
            hint=f"restore {SIGNED_HEAD_FILE} from the same backup as registry.duckdb",
        )
    if log.size < checkpoint.size:
        raise LogRollbackError(
            f"the database holds {log.size} log entries, but this registry already signed a checkpoint at tree size "
            f"{checkpoint.size} ({SIGNED_HEAD_FILE}): the database was rolled back or lost committed writes "
            "(a deleted or truncated WAL, an older copy restored); serving it would fork the log",
            hint=f"restore registry.duckdb (with its .wal) from a backup taken at tree size {checkpoint.size} or "
            f"later; never delete {SIGNED_HEAD_FILE} to get past this: clients that saw size {checkpoint.size} "
            "would see a fork",
        )
    if log.root(checkpoint.size) != checkpoint.root_hash:
        raise LogRollbackError(
            f"the database's first {checkpoint.size} log entries have root {log.root(checkpoint.size).hex()}, but this "
            f"registry signed root {checkpoint.root_hash.hex()} at that size ({SIGNED_HEAD_FILE}): the database holds "
            "a different log; serving it would fork the log"
        )
    return saved


def _advance_signed_head(
    data: DataDir, db: Database, log: TransparencyLog, head: LogHead, saved: SignedHead | None
) -> None:
    """Save the database's head when it is ahead of (or there is no) ``signed-head.json``."""
    if saved is None or saved.tree_size != head.size:
        try:
            write_signed_head(data, _signed(log.origin, head))
        except OSError as e:
            raise SignedHeadWriteError(
                f"the signed tree head could not be saved to {SIGNED_HEAD_FILE}: {e.strerror}",
                hint="make the data directory writable (and free disk space), then start again",
            ) from e
    if db.get_meta(_HEAD_FILE_META) is None:
        # Recorded only after the file exists, and checkpointed into the database file, so a
        # later start can tell "never written" (an upgrade) from "deleted".
        db.set_meta(_HEAD_FILE_META, SIGNED_HEAD_FILE)
        db.query("CHECKPOINT")


def _statement_json(envelope_bytes: bytes) -> Any:
    try:
        # Verified when it was stored; decoded here for the listing's fields only.
        return parse_json(payload_unverified(envelope_bytes, what="stored envelope"), what="stored statement")
    except (DocumentError, MalformedInputError, KeyError, TypeError) as e:
        raise RegistryError(f"a stored envelope cannot be decoded: {e}") from e


def _text_preview(text: str | None) -> str | None:
    if text is None or len(text) <= _TEXT_PREVIEW:
        return text
    return text[: _TEXT_PREVIEW - 1] + "\u2026"


def _artifact_block(r: EntryRow, *, full_text: bool = False) -> dict[str, Any] | None:
    a = r.artifact
    if a is None:
        return None
    block: dict[str, Any] = {
        "digest": a.digest,
        "model": {"name": a.model_name, "weights_digest": a.model_weights_digest, "config_digest": a.model_config_digest},
        "profile": a.profile_name,
        "parent": a.parent,
        "chain_key": a.chain_key,
        "positions": [a.position_start, a.position_end],
        "tokens": a.position_end - a.position_start,
        "text_digest": a.source_text_digest,
    }
    if full_text:
        block["text"] = a.source_text
    else:
        block["text_preview"] = _text_preview(a.source_text)
    return block


def _entry_meta(r: EntryRow, subjects: list[dict[str, str]]) -> dict[str, Any]:
    return {
        "log_index": r.log_index,
        "digest": r.digest,
        "leaf_hash": r.leaf_hash.hex(),
        "payload_type": r.payload_type,
        "predicate_type": r.predicate_type,
        "kind": r.kind,
        "publisher": r.publisher,
        "keyids": list(r.keyids),
        "integrated_at": r.integrated_at,
        "size": r.size,
        "subjects": subjects,
        "envelope_url": f"/v1/entries/{r.digest}/envelope",
        "artifact": _artifact_block(r),
    }


def _artifact_summary(r: EntryRow, *, full_text: bool = False) -> dict[str, Any]:
    block = _artifact_block(r, full_text=full_text) or {}
    return {
        **block,
        "log_index": r.log_index,
        "entry_digest": r.digest,
        "publisher": r.publisher,
        "keyids": list(r.keyids),
        "integrated_at": r.integrated_at,
    }


def _page(items: list[dict[str, Any]], listing: Listing[EntryRow]) -> Page:
    """A page of documents, with the cursor after its last entry when more follow."""
    return Page(items, encode_cursor(listing.rows[-1].log_index) if listing.more else None)
