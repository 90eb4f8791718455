"""The read side of the registry: entries, envelopes, artifacts, records and publishers, as documents.

``Reader`` reads through the model the pages share (``queries.py``) and builds its answers with
``documents.py``. Every method is blocking and thread-safe (under the database lock); the app
calls them from worker threads. It reads the log's announced head through a ``LogView`` (the
``Registry``), never past it: an entry committed but not yet announced is not served.
"""

from __future__ import annotations

import logging
import re
from typing import Any, Protocol

from kvgraft.schemas import parse_json

from . import queries
from .accounts import Accounts
from .blobs.store import parse_digest_ref
from .documents import Page, artifact_summary, decode_cursor, entry_meta, other_claims, page_of, statement_json
from .errors import ArtifactNotFoundError, BadRequestError, EntryNotFoundError, RegistryError
from .log.cosignatures import CosignatureStore
from .log.tree import LogHead, TransparencyLog
from .queries import ArtifactFilter, EntryRow, RecordFilter, Seek
from .settings import RegistrySettings
from .storage.db import Database

logger = logging.getLogger("kvgraft.registry")

#: A log index in a path: ASCII digits only (str.isdigit() also takes '³' and '٣'), at most 19 (BIGINT).
INDEX_REF = re.compile(r"[0-9]{1,19}", re.ASCII)


class LogView(Protocol):
    """What a reader needs of the log's state: the announced head, and a catch-up before reading past it."""

    @property
    def head(self) -> LogHead: ...

    def sees(self, tree_size: int) -> None: ...


class Reader:
    """The registry's reads (``Registry.reader``)."""

    def __init__(
        self,
        db: Database,
        settings: RegistrySettings,
        log: TransparencyLog,
        cosignatures: CosignatureStore,
        accounts: Accounts,
        view: LogView,
    ) -> None:
        self.db = db
        self.settings = settings
        self.log = log
        self.cosignatures = cosignatures
        self.accounts = accounts
        self.view = view

    def render(self, rows: list[EntryRow]) -> list[dict[str, Any]]:
        """The metadata documents of ``rows``, each with its subjects (one query for all)."""
        subjects = queries.subjects(self.db, [r.log_index for r in rows])
        return [entry_meta(r, [s._asdict() for s in subjects.get(r.log_index, [])]) for r in rows]

    def resolve_entry(self, ref: str) -> int:
        """The log index named by ``ref``: a decimal index or ``sha256:<hex>`` of the envelope."""
        with self.db.lock:
            if INDEX_REF.fullmatch(ref):
                index = int(ref)
                self.view.sees(index + 1)
                size = self.view.head.size
                if index >= size:
                    raise EntryNotFoundError(f"the log has {size} entries; there is no entry {index}")
                return index
            if ref.startswith("sha256:"):
                parse_digest_ref(ref, what="entry digest")
                found = queries.index_of(self.db, ref)
                if found is None:
                    raise EntryNotFoundError(f"no entry has digest {ref}")
                self.view.sees(found + 1)
                return found
        raise BadRequestError(
            f"{ref[:80]!r} names no entry",
            hint="use a log index (ASCII digits: 0, 1, ...) or the envelope's digest sha256:<64 lowercase hex>",
        )

    def entry_document(self, index: int) -> dict[str, Any]:
        """Entry ``index`` (in the announced log) with its inclusion proof at the latest checkpoint, and that checkpoint."""
        with self.db.lock:
            row = queries.entry_at(self.db, index)
            if row is None:
                raise EntryNotFoundError(f"there is no entry {index}")
            head = self.view.head
            return {
                "entry": self.render([row])[0],
                "inclusion_proof": self.log.inclusion(index, head.size),
                "checkpoint": (head.note + self.cosignatures.lines(head.size)).decode("utf-8"),
            }

    def entry(self, ref: str) -> dict[str, Any]:
        """An entry's metadata with its inclusion proof at the latest checkpoint, and that checkpoint."""
        with self.db.lock:
            return self.entry_document(self.resolve_entry(ref))

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
            return page_of(self.render(listing.rows), listing)

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
        return page_of([artifact_summary(r) for r in listing.rows], listing)

    def artifact(self, digest: str, signer: str | None = None) -> dict[str, Any]:
        """An artifact by its tensors digest: statement, envelope, entry, lineage, proof, checkpoint.

        Anyone may log a statement about any tensors, so no entry owns a digest: the document is
        built from the first entry signed by key ``signer`` (a key id) when given, else from the
        first logged, and ``other_entries`` names every other claim with its signers' key ids.
        """
        signer = queries.check_signer(signer)
        with self.db.lock:
            rows = queries.artifact_entries(self.db, digest)
            if not rows:
                raise ArtifactNotFoundError(f"no KV artifact with tensors {digest} is in this registry")
            first = queries.claim_by(rows, signer)
            if first is None:
                raise ArtifactNotFoundError(
                    f"no entry of the KV artifact {digest} is signed by key {signer}; {len(rows)} entr"
                    f"{'y' if len(rows) == 1 else 'ies'} by other keys claim these tensors",
                    hint="ask without signer to see every claim (other_entries), or pass the key id of the publisher you trust",
                )
            stored = queries.stored_envelope(self.db, first.log_index)
            envelope_bytes = b"" if stored is None else stored.envelope
            head = self.view.head
            document = {
                "artifact": artifact_summary(first, full_text=True),
                "entry": self.render([first])[0],
                "other_entries": other_claims(rows, first),
                "statement": statement_json(envelope_bytes),
                "envelope": parse_json(envelope_bytes, what="stored envelope"),
                "lineage": self.lineage(first),
                "inclusion_proof": self.log.inclusion(first.log_index, head.size),
                "checkpoint": (head.note + self.cosignatures.lines(head.size)).decode("utf-8"),
            }
        return document

    def lineage(self, row: EntryRow) -> dict[str, Any]:
        """An artifact entry's parents (walked up, bounded) and children."""
        if row.artifact is None:
            raise RegistryError(f"entry {row.log_index} is not an artifact: it has no lineage")
        walk = queries.ancestors(self.db, row.artifact.digest, row.artifact.parent, self.settings.max_lineage_depth)
        if walk.cut == "cycle":
            logger.error("artifact lineage of %s has a cycle at %s", row.artifact.digest, walk.cut_at)
        parents = [
            {"digest": a.digest, "log_index": None} if a.entry is None else artifact_summary(a.entry)
            for a in walk.ancestors
        ]
        children = queries.children(self.db, row.artifact.digest)
        return {"parents": parents, "children": [artifact_summary(r) for r in children]}

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
            return page_of(self.render(listing.rows), listing)

    def publishers(self) -> list[dict[str, Any]]:
        """Publishers and their keys."""
        return self.accounts.publishers()
