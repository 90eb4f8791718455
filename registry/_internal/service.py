"""The registry service: database, transparency log, blob store and accounts behind one lock.

Every method is blocking and thread-safe; the app calls them from worker threads. Publishing
holds the database lock from the token check to the commit, so a revocation, a concurrent
publish or a crash can never interleave with it: the entry row, its log leaf and the new
signed checkpoint are committed together or not at all.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import hashlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import duckdb

from kvgraft.schemas import DocumentError, parse_json
from kvgraft.verifier import (
    LogProofError,
    MalformedInputError,
    b64decode_any,
    keyid_of,
    open_signing_key,
    public_key_pem,
)

from .accounts import Accounts, TokenInfo
from .blobs import BlobStore, parse_digest_ref
from .datadir import DataDir, check_registry_key, ensure_registry_key, prepare, resolve_origin
from .db import Database, now_utc
from .entries import RECORD_KINDS, IndexedStatement, decode_envelope, index_statement, kind_of_filter, verify_for_token
from .errors import (
    ArtifactNotFoundError,
    BadRequestError,
    EntryNotFoundError,
    InvalidStatementError,
    LogIntegrityError,
    MissingBlobsError,
    MissingReferenceError,
    NotFoundError,
    RegistryError,
    TokenRevokedError,
)
from .log import LogHead, TransparencyLog, format_vkey, hash_leaf, verify_checkpoint
from .ratelimit import RateLimiter
from .settings import RegistrySettings

logger = logging.getLogger("kvgraft.registry")

_ENTRY_COLUMNS = (
    "log_index, digest, leaf_hash, payload_type, predicate_type, kind, publisher, keyids, integrated_at, "
    "octet_length(envelope), artifact_digest, model_name, model_weights_digest, model_config_digest, profile_name, "
    "parent, chain_key, position_start, position_end, source_text, source_text_digest"
)
#: Lineage walks stop here: no real chain is this long, and a cycle cannot hang a request.
_MAX_LINEAGE = 10_000
_MAX_CHILDREN = 1_000
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


def encode_cursor(log_index: int) -> str:
    """An opaque cursor meaning "after entry ``log_index``" (stable: the log only grows)."""
    return base64.urlsafe_b64encode(f"after:{log_index}".encode("ascii")).decode("ascii").rstrip("=")


def decode_cursor(cursor: str | None) -> int:
    """The log index a cursor continues after (-1 for the first page)."""
    if cursor is None or cursor == "":
        return -1
    try:
        text = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode("ascii")
        kind, _, value = text.partition(":")
        if kind != "after" or not value.isdigit():
            raise ValueError(text)
        return int(value)
    except (ValueError, binascii.Error, UnicodeDecodeError) as e:
        raise BadRequestError(
            f"cursor {cursor[:40]!r} is not one this registry issued",
            hint="pass next_cursor from the previous page unchanged, or no cursor for the first page",
        ) from e


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
        try:
            # Under the database lock, so two first starts cannot both create a key.
            public = ensure_registry_key(data)
            check_registry_key(db, public)
            origin = resolve_origin(db, settings.origin, public)
            blobs = BlobStore(data.blobs)
            # Only now, holding the database lock, is it safe to empty blobs/tmp: a second
            # process started on a live data directory fails above, before it can delete the
            # running server's uploads in progress.
            blobs.prepare()
            with open_signing_key(data.key_path) as key:
                log = TransparencyLog(origin, key, _load_leaves(db))
                head = _check_head(db, log)
                logger.info("registry %s: log %s at size %d", root, origin, log.size)
                yield cls(data, db, log, blobs, settings, head)
        finally:
            db.close()

    # --- the log ---------------------------------------------------------------------------

    @property
    def head(self) -> LogHead:
        """The latest signed checkpoint."""
        with self.db.lock:
            return self._head

    def checkpoint(self, tree_size: int | None = None) -> bytes:
        """The signed checkpoint note at ``tree_size`` (default: the latest)."""
        if tree_size is None:
            return self.head.note
        # Checked before the query: DuckDB refuses integers past 128 bits with an error of its own.
        row = (
            self.db.query_one("SELECT note FROM checkpoints WHERE tree_size = ?", [tree_size])
            if 0 <= tree_size <= self.log.size
            else None
        )
        if row is None:
            raise NotFoundError(
                f"no checkpoint was signed at tree size {tree_size} (the log has {self.log.size} entries)",
                hint="ask for a size between 0 and the latest checkpoint's",
            )
        return bytes(row[0])

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
        """The inclusion proof document of entry ``index`` (tree size default: the latest)."""
        with self.db.lock:
            return self.log.inclusion(index, tree_size)

    def consistency_proof(self, old: int, new: int | None) -> dict[str, Any]:
        """The consistency proof document between two tree sizes (new default: the latest)."""
        with self.db.lock:
            return self.log.consistency(old, new)

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
        envelope = decode_envelope(body)
        digest = _digest_of(body)
        with self.db.lock:
            # Re-read the token under the lock: a revocation that committed before this point
            # refuses the publish, one after it comes after the entry in every sense.
            current = self.accounts.authenticate_id(token.token_id)
            if current is None:
                raise TokenRevokedError(f"token {token.token_id} was revoked")
            registered = self.accounts.registered_keys()
            bound = self.accounts.bound_keys(current)
            verified, statement = verify_for_token(envelope, bound, registered)
            indexed = index_statement(statement)
            existing = self.db.query_one("SELECT log_index FROM entries WHERE digest = ?", [digest])
            if existing is not None:
                return Published(self._entry_document(int(existing[0])), created=False)
            missing = self.blobs.missing(indexed.required_blobs)
            if missing:
                shown = ", ".join("sha256:" + h for h in missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
                raise MissingBlobsError(
                    f"the statement names {len(missing)} blob(s) this registry does not hold: {shown}",
                    extra={"missing": ["sha256:" + h for h in missing]},
                )
            if indexed.pre_registration is not None:
                self._check_pre_registration(*indexed.pre_registration)
            index = self._append(body, digest, envelope.payload_type, indexed, current, [k.keyid for k in verified.signers])
            logger.info("entry %d: %s %s by %s", index, indexed.kind, digest, current.publisher)
            return Published(self._entry_document(index), created=True)

    def _check_pre_registration(self, digest: str, log_index: int) -> None:
        row = self.db.query_one("SELECT log_index, kind FROM entries WHERE digest = ?", [digest])
        if row is None:
            raise MissingReferenceError(f"the replay answers to pre-registration {digest}, which is not in this log")
        if int(row[0]) != log_index or row[1] != "pre-registration":
            raise InvalidStatementError(
                f"the replay says its pre-registration {digest} is entry {log_index}, but that digest is "
                f"entry {row[0]} ({row[1]})",
                hint="point the replay at the pre-registration's real log index",
            )

    def _append(
        self, body: bytes, digest: str, payload_type: str, indexed: IndexedStatement, token: TokenInfo, keyids: list[str]
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
                conn.execute(
                    "INSERT INTO checkpoints VALUES (?, ?, ?, ?)", [head.size, head.root_hash, head.note, now_utc()]
                )
        except BaseException as e:
            # The commit failed: the database has neither the entry nor the checkpoint, so the
            # in-memory tree must forget the leaf too.
            self.log.reset(_load_leaves(self.db))
            if isinstance(e, duckdb.Error):
                raise RegistryError(f"the entry could not be recorded: {e}") from e
            raise
        self._head = head
        return index

    # --- reading entries -------------------------------------------------------------------

    def _entry_rows(self, where: str, params: list[Any], limit: int | None = None) -> list[tuple[Any, ...]]:
        sql = f"SELECT {_ENTRY_COLUMNS} FROM entries WHERE {where} ORDER BY log_index"
        if limit is not None:
            sql += f" LIMIT {int(limit)}"
        return self.db.query(sql, params)

    def _subjects(self, indices: list[int]) -> dict[int, list[dict[str, str]]]:
        if not indices:
            return {}
        placeholders = ", ".join("?" for _ in indices)
        rows = self.db.query(
            f"SELECT log_index, name, digest FROM entry_subjects WHERE log_index IN ({placeholders}) ORDER BY log_index, name",
            indices,
        )
        out: dict[int, list[dict[str, str]]] = {}
        for i, name, d in rows:
            out.setdefault(int(i), []).append({"name": name, "digest": d})
        return out

    def _render(self, rows: list[tuple[Any, ...]]) -> list[dict[str, Any]]:
        subjects = self._subjects([int(r[0]) for r in rows])
        return [_entry_meta(r, subjects.get(int(r[0]), [])) for r in rows]

    def resolve_entry(self, ref: str) -> int:
        """The log index named by ``ref``: a decimal index or ``sha256:<hex>`` of the envelope."""
        with self.db.lock:
            if ref.isdigit() and len(ref) <= 20:
                index = int(ref)
                if index >= self.log.size:
                    raise EntryNotFoundError(f"the log has {self.log.size} entries; there is no entry {index}")
                return index
            if ref.startswith("sha256:"):
                parse_digest_ref(ref, what="entry digest")
                row = self.db.query_one("SELECT log_index FROM entries WHERE digest = ?", [ref])
                if row is None:
                    raise EntryNotFoundError(f"no entry has digest {ref}")
                return int(row[0])
        raise BadRequestError(
            f"{ref[:80]!r} names no entry",
            hint="use a log index (0, 1, ...) or the envelope's digest sha256:<64 lowercase hex>",
        )

    def _entry_document(self, index: int) -> dict[str, Any]:
        with self.db.lock:
            rows = self._entry_rows("log_index = ?", [index])
            if not rows:
                raise EntryNotFoundError(f"there is no entry {index}")
            head = self._head
            return {
                "entry": self._render(rows)[0],
                "inclusion_proof": self.log.inclusion(index, head.size),
                "checkpoint": head.note.decode("utf-8"),
            }

    def entry(self, ref: str) -> dict[str, Any]:
        """An entry's metadata with its inclusion proof at the latest checkpoint, and that checkpoint."""
        with self.db.lock:
            return self._entry_document(self.resolve_entry(ref))

    def envelope(self, ref: str) -> tuple[bytes, str]:
        """The exact stored envelope bytes of an entry, and its digest."""
        with self.db.lock:
            index = self.resolve_entry(ref)
            row = self.db.query_one("SELECT envelope, digest FROM entries WHERE log_index = ?", [index])
        if row is None:
            raise EntryNotFoundError(f"there is no entry {index}")
        return bytes(row[0]), str(row[1])

    def list_entries(self, cursor: str | None, limit: int) -> Page:
        """Entries in log order (for mirrors and auditors)."""
        after = decode_cursor(cursor)
        with self.db.lock:
            rows = self._entry_rows("log_index > ?", [after], limit + 1)
            return self._page(self._render(rows[:limit]), rows, limit)

    @staticmethod
    def _page(items: list[dict[str, Any]], rows: list[tuple[Any, ...]], limit: int) -> Page:
        more = len(rows) > limit
        return Page(items, encode_cursor(int(rows[limit - 1][0])) if more else None)

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
        """Artifact entries in log order, filtered; ``parent="none"`` lists roots."""
        after = decode_cursor(cursor)
        where = ["kind = 'artifact'", "log_index > ?"]
        params: list[Any] = [after]
        for column, value in (("model_name", model), ("profile_name", profile), ("publisher", publisher)):
            if value:
                where.append(f"{column} = ?")
                params.append(value)
        if parent:
            if parent == "none":
                where.append("parent IS NULL")
            else:
                parse_digest_ref(parent, what="parent")
                where.append("parent = ?")
                params.append(parent)
        for term in (q or "").split():
            # contains() takes the term literally (no LIKE wildcards to escape).
            where.append("contains(lower(source_text), ?)")
            params.append(term.lower())
        with self.db.lock:
            rows = self._entry_rows(" AND ".join(where), params, limit + 1)
            return self._page([_artifact_summary(r) for r in rows[:limit]], rows, limit)

    def artifact(self, digest: str) -> dict[str, Any]:
        """An artifact by its tensors digest: statement, envelope, entry, lineage, proof, checkpoint."""
        with self.db.lock:
            rows = self._entry_rows("artifact_digest = ?", [digest])
            if not rows:
                raise ArtifactNotFoundError(f"no KV artifact with tensors {digest} is in this registry")
            first = rows[0]
            index = int(first[0])
            envelope_bytes = bytes(self.db.query_one("SELECT envelope FROM entries WHERE log_index = ?", [index])[0])
            head = self._head
            document = {
                "artifact": _artifact_summary(first, full_text=True),
                "entry": self._render([first])[0],
                "other_entries": [{"log_index": int(r[0]), "digest": r[1], "publisher": r[6]} for r in rows[1:]],
                "statement": _statement_json(envelope_bytes),
                "envelope": parse_json(envelope_bytes, what="stored envelope"),
                "lineage": self._lineage(first),
                "inclusion_proof": self.log.inclusion(index, head.size),
                "checkpoint": head.note.decode("utf-8"),
            }
        return document

    def _first_artifact_row(self, digest: str) -> tuple[Any, ...] | None:
        rows = self._entry_rows("artifact_digest = ?", [digest], 1)
        return rows[0] if rows else None

    def _lineage(self, row: tuple[Any, ...]) -> dict[str, Any]:
        parents: list[dict[str, Any]] = []
        seen = {row[10]}
        current = row[15]
        while current is not None and len(parents) < _MAX_LINEAGE:
            if current in seen:
                logger.error("artifact lineage of %s has a cycle at %s", row[10], current)
                break
            seen.add(current)
            parent_row = self._first_artifact_row(current)
            if parent_row is None:
                # Its tensors are stored (checked at publish) but no entry describes them.
                parents.append({"digest": current, "log_index": None})
                break
            parents.append(_artifact_summary(parent_row))
            current = parent_row[15]
        children = self._entry_rows("kind = 'artifact' AND parent = ?", [row[10]], _MAX_CHILDREN)
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
        after = decode_cursor(cursor)
        where = ["kind IN (" + ", ".join(f"'{k}'" for k in RECORD_KINDS) + ")", "log_index > ?"]
        params: list[Any] = [after]
        if kind:
            resolved = kind_of_filter(kind)
            if resolved == "artifact":
                raise BadRequestError("artifacts are not records", hint="list artifacts with GET /v1/artifacts")
            where.append("kind = ?")
            params.append(resolved)
        if publisher:
            where.append("publisher = ?")
            params.append(publisher)
        if artifact:
            parse_digest_ref(artifact, what="artifact")
            where.append("log_index IN (SELECT log_index FROM entry_refs WHERE ref = ?)")
            params.append(artifact)
        with self.db.lock:
            rows = self._entry_rows(" AND ".join(where), params, limit + 1)
            return self._page(self._render(rows[:limit]), rows, limit)

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


def _check_head(db: Database, log: TransparencyLog) -> LogHead:
    row = db.query_one("SELECT tree_size, root_hash, note FROM checkpoints ORDER BY tree_size DESC LIMIT 1")
    if row is None:
        if log.size:
            raise LogIntegrityError(f"the log has {log.size} entries but no checkpoint")
        head = log.sign(0)
        with db.transaction() as conn:
            conn.execute("INSERT INTO checkpoints VALUES (?, ?, ?, ?)", [0, head.root_hash, head.note, now_utc()])
        return head
    size, root, note = int(row[0]), bytes(row[1]), bytes(row[2])
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


def _statement_json(envelope_bytes: bytes) -> Any:
    try:
        doc = parse_json(envelope_bytes, what="stored envelope")
        return parse_json(b64decode_any(doc["payload"], what="stored payload"), what="stored statement")
    except (DocumentError, MalformedInputError, KeyError, TypeError) as e:
        raise RegistryError(f"a stored envelope cannot be decoded: {e}") from e


def _text_preview(text: str | None) -> str | None:
    if text is None or len(text) <= _TEXT_PREVIEW:
        return text
    return text[: _TEXT_PREVIEW - 1] + "\u2026"


def _artifact_block(r: tuple[Any, ...], *, full_text: bool = False) -> dict[str, Any] | None:
    if r[10] is None:
        return None
    block = {
        "digest": r[10],
        "model": {"name": r[11], "weights_digest": r[12], "config_digest": r[13]},
        "profile": r[14],
        "parent": r[15],
        "chain_key": r[16],
        "positions": [int(r[17]), int(r[18])],
        "tokens": int(r[18]) - int(r[17]),
        "text_digest": r[20],
    }
    if full_text:
        block["text"] = r[19]
    else:
        block["text_preview"] = _text_preview(r[19])
    return block


def _entry_meta(r: tuple[Any, ...], subjects: list[dict[str, str]]) -> dict[str, Any]:
    return {
        "log_index": int(r[0]),
        "digest": r[1],
        "leaf_hash": bytes(r[2]).hex(),
        "payload_type": r[3],
        "predicate_type": r[4],
        "kind": r[5],
        "publisher": r[6],
        "keyids": list(r[7]),
        "integrated_at": r[8],
        "size": int(r[9]),
        "subjects": subjects,
        "envelope_url": f"/v1/entries/{r[1]}/envelope",
        "artifact": _artifact_block(r),
    }


def _artifact_summary(r: tuple[Any, ...], *, full_text: bool = False) -> dict[str, Any]:
    block = _artifact_block(r, full_text=full_text) or {}
    return {
        **block,
        "log_index": int(r[0]),
        "entry_digest": r[1],
        "publisher": r[6],
        "keyids": list(r[7]),
        "integrated_at": r[8],
    }
