"""The registry's one read model: every query the API (``service.py``) and the browser (``ui.py``) read by.

Rows come back as frozen dataclasses and named tuples whose fields are the columns, selected by
name (``SELECT <expression> AS <name>``) and read by name, never by position:

- ``EntryRow``: an entry's metadata (the API's entry documents, the pages of one entry), with
  the artifact columns as ``entries.ArtifactFields`` when the entry is a KV artifact;
- ``EntrySummary``: the lean row of the browser's listings (no leaf hash, key ids or size; the
  source text cut to a preview);
- ``SubjectRow``, ``PublisherKey``, ``CheckpointRow``, ``StoredEnvelope``, ``Totals``, ``Facets``.

One filter per listing: ``ArtifactFilter`` (model, profile, parent or ``"none"`` for roots,
publisher, search words) and ``RecordFilter`` (kind, publisher, artifact) turn request values
into a ``Where``; both the API and the browser list through them, the API in log order after a
cursor, the browser newest first before a log index (``Seek``). A filter checks its values
(digests, the search's bounds) when its ``Where`` is built, so call ``where`` before taking the
database lock: a refused query never waits for it.

Locking: each function runs its statements through ``Database.query``, which takes
``db.lock`` per statement. A caller that needs several reads to see one state holds
``db.lock`` around them; nothing here parses an envelope or verifies a signature, so that hold
stays short (the browser verifies signatures after releasing it).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Generic, Literal, NamedTuple, TypeVar

from . import search
from .blobs.store import parse_digest_ref
from .entries import RECORD_KINDS, ArtifactFields, kind_of_filter
from .errors import BadRequestError
from .settings import RegistrySettings
from .storage.db import Database

R = TypeVar("R")

#: Children of one artifact listed on its views, at most.
MAX_CHILDREN = 1_000

#: SQL of the record kinds (constants of this module, never request values).
_RECORD_KINDS_SQL = "(" + ", ".join(f"'{k}'" for k in RECORD_KINDS) + ")"


class Where(NamedTuple):
    """A SQL condition on ``entries`` and its parameters (``?`` placeholders, in order)."""

    sql: str
    params: list[Any]


#: Every entry.
ALL = Where("TRUE", [])


@dataclass(frozen=True)
class Seek:
    """Which page of a listing: ``limit`` rows in log order after log index ``after`` (the API's
    cursor; -1 for the first page), or, when ``before`` is set, newest first below log index
    ``before`` (the browser's pages)."""

    limit: int
    after: int = -1
    before: int | None = None


@dataclass(frozen=True)
class Listing(Generic[R]):
    """One page of rows, and whether a further row follows the last one."""

    rows: list[R]
    more: bool


@dataclass(frozen=True)
class EntryRow:
    """An entry's metadata: one row of ``entries`` without the envelope bytes (``size`` counts them)."""

    log_index: int
    digest: str
    leaf_hash: bytes
    payload_type: str
    predicate_type: str
    kind: str
    publisher: str
    keyids: tuple[str, ...]
    integrated_at: str
    size: int
    artifact: ArtifactFields | None


@dataclass(frozen=True)
class EntrySummary:
    """An entry as the browser's listings show it; the artifact fields are None for a record.

    ``text`` is at most the first ``text_chars`` characters of the source text (the listing
    asked for one more than it shows, so it can tell a cut).
    """

    log_index: int
    digest: str
    kind: str
    publisher: str
    integrated_at: str
    predicate_type: str
    artifact_digest: str | None
    model_name: str | None
    profile_name: str | None
    parent: str | None
    position_start: int | None
    position_end: int | None
    text: str | None


class SubjectRow(NamedTuple):
    """A subject of an entry's statement; ``_asdict()`` is the API's subject document."""

    name: str
    digest: str


class PublisherKey(NamedTuple):
    """A registered key: its key id and public key PEM."""

    keyid: str
    public_key_pem: str


class CheckpointRow(NamedTuple):
    """A signed checkpoint's tree size, root hash and signing time (RFC 3339 UTC)."""

    tree_size: int
    root_hash: bytes
    created_at: str


class SignedCheckpoint(NamedTuple):
    """A stored checkpoint: its tree size, root hash and signed note."""

    tree_size: int
    root_hash: bytes
    note: bytes


class StoredEnvelope(NamedTuple):
    """An entry's envelope exactly as logged, with its log index and digest."""

    log_index: int
    digest: str
    envelope: bytes


class Totals(NamedTuple):
    """The overview's counts: entries per kind, publishers, registered keys."""

    kinds: dict[str, int]
    publishers: int
    keys: int


class Facets(NamedTuple):
    """The distinct values of the artifact filters, sorted."""

    models: list[str]
    profiles: list[str]
    publishers: list[str]


@dataclass(frozen=True)
class Ancestor:
    """An artifact in a lineage walk, described by its first entry (None: no entry describes it)."""

    digest: str
    entry: EntryRow | None


@dataclass(frozen=True)
class Ancestry:
    """A lineage walk's ancestors, nearest first, and why it stopped early.

    ``cut`` is None (the root was reached, or an ancestor has no entry here: it is the last one
    listed), ``"depth"`` (the chain goes on past the limit; ``cut_at`` is the first ancestor
    not walked) or ``"cycle"`` (the chain reaches ``cut_at`` a second time; it is not listed again).
    """

    ancestors: list[Ancestor]
    cut: Literal["depth", "cycle"] | None = None
    cut_at: str | None = None


# --- filters -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ArtifactFilter:
    """The artifact listing's filter, as ``GET /v1/artifacts`` and ``/artifacts`` take it.

    Empty values filter nothing. ``parent`` is a ``sha256:`` digest, or ``"none"`` for roots;
    ``q`` keeps artifacts whose source text holds every word (``search.search_condition``).
    """

    model: str | None = None
    profile: str | None = None
    parent: str | None = None
    publisher: str | None = None
    q: str | None = None

    def where(self, settings: RegistrySettings) -> Where:
        """The condition; raises ``BadDigestError`` for a malformed parent and
        ``QueryTooLargeError`` for a search past ``settings``' bounds."""
        clauses = ["kind = 'artifact'"]
        params: list[Any] = []
        for column, value in (("model_name", self.model), ("profile_name", self.profile), ("publisher", self.publisher)):
            if value:
                clauses.append(f"{column} = ?")
                params.append(value)
        if self.parent:
            if self.parent == "none":
                clauses.append("parent IS NULL")
            else:
                parse_digest_ref(self.parent, what="parent")
                clauses.append("parent = ?")
                params.append(self.parent)
        found = search.search_condition(self.q, max_terms=settings.max_search_terms, max_length=settings.max_query_length)
        if found is not None:
            clauses.append(found[0])
            params.extend(found[1])
        return Where(" AND ".join(clauses), params)


@dataclass(frozen=True)
class RecordFilter:
    """The record listing's filter: ``kind`` (a record kind or its predicate type URI), the
    publisher, and an artifact the record points at (a subject, prefix or library artifact)."""

    kind: str | None = None
    publisher: str | None = None
    artifact: str | None = None

    def resolved_kind(self, *, artifacts_hint: str) -> str | None:
        """The record kind filtered by (None: all); ``BadRequestError`` for an unknown one or for
        ``artifact``, with ``artifacts_hint`` saying where artifacts are listed."""
        if not self.kind:
            return None
        resolved = kind_of_filter(self.kind)
        if resolved == "artifact":
            raise BadRequestError("artifacts are not records", hint=artifacts_hint)
        return resolved

    def where(self, *, artifacts_hint: str) -> Where:
        """The condition; raises as ``resolved_kind`` does, and ``BadDigestError`` for a malformed artifact."""
        clauses = [f"kind IN {_RECORD_KINDS_SQL}"]
        params: list[Any] = []
        kind = self.resolved_kind(artifacts_hint=artifacts_hint)
        if kind is not None:
            clauses.append("kind = ?")
            params.append(kind)
        if self.publisher:
            clauses.append("publisher = ?")
            params.append(self.publisher)
        if self.artifact:
            parse_digest_ref(self.artifact, what="artifact")
            clauses.append("log_index IN (SELECT log_index FROM entry_refs WHERE ref = ?)")
            params.append(self.artifact)
        return Where(" AND ".join(clauses), params)


# --- selecting by name -------------------------------------------------------------------------

#: (name, SQL expression) of an EntryRow, then of its ArtifactFields (named as the dataclass's fields).
_ENTRY_COLUMNS: tuple[tuple[str, str], ...] = (
    ("log_index", "log_index"),
    ("digest", "digest"),
    ("leaf_hash", "leaf_hash"),
    ("payload_type", "payload_type"),
    ("predicate_type", "predicate_type"),
    ("kind", "kind"),
    ("publisher", "publisher"),
    ("keyids", "keyids"),
    ("integrated_at", "integrated_at"),
    ("size", "octet_length(envelope)"),
)
_ARTIFACT_COLUMNS: tuple[tuple[str, str], ...] = (
    ("digest", "artifact_digest"),
    ("model_name", "model_name"),
    ("model_weights_digest", "model_weights_digest"),
    ("model_config_digest", "model_config_digest"),
    ("profile_name", "profile_name"),
    ("parent", "parent"),
    ("chain_key", "chain_key"),
    ("position_start", "position_start"),
    ("position_end", "position_end"),
    ("source_text", "source_text"),
    ("source_text_digest", "source_text_digest"),
)
_SUMMARY_COLUMNS: tuple[tuple[str, str], ...] = (
    ("log_index", "log_index"),
    ("digest", "digest"),
    ("kind", "kind"),
    ("publisher", "publisher"),
    ("integrated_at", "integrated_at"),
    ("predicate_type", "predicate_type"),
    ("artifact_digest", "artifact_digest"),
    ("model_name", "model_name"),
    ("profile_name", "profile_name"),
    ("parent", "parent"),
    ("position_start", "position_start"),
    ("position_end", "position_end"),
)


def _select(
    db: Database, columns: tuple[tuple[str, str], ...], tail: str, params: list[Any]
) -> list[dict[str, Any]]:
    """``SELECT <expr> AS <name>, ... FROM entries <tail>``, each row as a dict by column name."""
    names = [name for name, _ in columns]
    listed = ", ".join(f"{expr} AS {name}" for name, expr in columns)
    return [dict(zip(names, row, strict=True)) for row in db.query(f"SELECT {listed} FROM entries {tail}", params)]


# The artifact columns are selected with an "a_" prefix: their names repeat the entry's ("digest").
_FULL_COLUMNS = _ENTRY_COLUMNS + tuple((f"a_{name}", expr) for name, expr in _ARTIFACT_COLUMNS)


def _entry_row(v: dict[str, Any]) -> EntryRow:
    # Column names are the dataclasses' field names; DuckDB hands back int, str, bytes and lists.
    artifact = None
    if v["a_digest"] is not None:
        artifact = ArtifactFields(**{name: v[f"a_{name}"] for name, _ in _ARTIFACT_COLUMNS})
    fields = {name: v[name] for name, _ in _ENTRY_COLUMNS}
    return EntryRow(**{**fields, "keyids": tuple(fields["keyids"])}, artifact=artifact)


def _page_tail(where: Where, seek: Seek) -> tuple[str, list[Any]]:
    # One row past the page, so the caller knows whether another page follows.
    if seek.before is None:
        order, bound, mark = "ASC", "log_index > ?", seek.after
    else:
        order, bound, mark = "DESC", "log_index < ?", seek.before
    tail = f"WHERE ({where.sql}) AND {bound} ORDER BY log_index {order} LIMIT {int(seek.limit) + 1}"
    return tail, [*where.params, mark]


def _listing(rows: list[R], limit: int) -> Listing[R]:
    return Listing(rows[:limit], len(rows) > limit)


def _value(db: Database, sql: str, params: list[Any]) -> Any:
    """The one column of the first row ``sql`` selects, or None when it selects none."""
    row = db.query_one(sql, params)
    if row is None:
        return None
    (value,) = row
    return value


def _in_list(values: Iterable[int]) -> tuple[str, list[int]]:
    """``(?, ?, ...)`` with one placeholder per value, and the values as ints."""
    ints = [int(v) for v in values]
    return "(" + ", ".join("?" for _ in ints) + ")", ints


def _bytes_by(db: Database, table: str, key: str, column: str, values: Iterable[int]) -> dict[int, bytes]:
    """The BLOB ``column`` of the rows of ``table`` whose integer ``key`` is in ``values``, by key
    (the names are this module's constants, never request values)."""
    marks, keys = _in_list(values)
    if not keys:
        return {}
    rows = db.query(f"SELECT {key}, {column} FROM {table} WHERE {key} IN {marks}", keys)
    return {int(k): bytes(v) for k, v in rows}


# --- entries -----------------------------------------------------------------------------------


def entries(db: Database, where: Where, seek: Seek) -> Listing[EntryRow]:
    """One page of entries matching ``where`` (the API's listings)."""
    tail, params = _page_tail(where, seek)
    return _listing([_entry_row(v) for v in _select(db, _FULL_COLUMNS, tail, params)], seek.limit)


def summaries(db: Database, where: Where, seek: Seek, *, text_chars: int) -> Listing[EntrySummary]:
    """One page of entries matching ``where`` as the browser lists them, texts cut to ``text_chars``."""
    columns = (*_SUMMARY_COLUMNS, ("text", f"left(source_text, {int(text_chars)})"))
    tail, params = _page_tail(where, seek)
    return _listing([EntrySummary(**v) for v in _select(db, columns, tail, params)], seek.limit)


def count(db: Database, where: Where) -> int:
    """How many entries match ``where``."""
    return int(_value(db, f"SELECT count(*) FROM entries WHERE {where.sql}", where.params) or 0)


def entry_at(db: Database, log_index: int) -> EntryRow | None:
    """The entry at ``log_index``, or None."""
    rows = _select(db, _FULL_COLUMNS, "WHERE log_index = ?", [log_index])
    return _entry_row(rows[0]) if rows else None


def entry_by_digest(db: Database, digest: str) -> EntryRow | None:
    """The entry whose envelope has ``digest`` (``sha256:<hex>``), or None."""
    rows = _select(db, _FULL_COLUMNS, "WHERE digest = ?", [digest])
    return _entry_row(rows[0]) if rows else None


def index_of(db: Database, digest: str) -> int | None:
    """The log index of the entry whose envelope has ``digest``, or None."""
    log_index = _value(db, "SELECT log_index FROM entries WHERE digest = ?", [digest])
    return None if log_index is None else int(log_index)


def indices_of(db: Database, digests: Iterable[str]) -> dict[str, int]:
    """The log index of each envelope digest in ``digests`` that is logged, by digest (one statement)."""
    wanted = list(dict.fromkeys(digests))
    if not wanted:
        return {}
    rows = db.query("SELECT digest, log_index FROM entries WHERE digest IN (SELECT unnest(?::VARCHAR[]))", [wanted])
    return {str(d): int(i) for d, i in rows}


#: Entries of one tensor digest read at most for its artifact document and page (each is a claim
#: by whoever logged it; a log of more is a flood, and its first ones are what is shown).
MAX_ARTIFACT_CLAIMS = 1000


def artifact_entries(db: Database, digest: str, limit: int = MAX_ARTIFACT_CLAIMS) -> list[EntryRow]:
    """The entries of the KV artifact whose tensors have ``digest``, in log order, at most ``limit``.

    Each is a claim by its publisher: none owns the digest (the first is only the oldest).
    """
    tail = f"WHERE artifact_digest = ? ORDER BY log_index LIMIT {int(limit)}"
    return [_entry_row(v) for v in _select(db, _FULL_COLUMNS, tail, [digest])]


def check_signer(signer: str | None) -> str | None:
    """``signer`` (a key id: 64 lowercase hex digits, as ``keyids`` holds them) or None; else ``BadRequestError``."""
    if signer is not None and not (len(signer) == 64 and all(c in "0123456789abcdef" for c in signer)):
        raise BadRequestError(
            f"signer {signer[:80]!r} is not a key id",
            hint="pass the signing key's id: 64 lowercase hex digits (sha256 of its raw public key), as 'keyids' shows",
        )
    return signer


def claim_by(rows: list[EntryRow], signer: str | None) -> EntryRow | None:
    """The first of an artifact's ``rows`` signed by key ``signer`` (the first of all without one); None if none."""
    if signer is None:
        return rows[0] if rows else None
    return next((r for r in rows if signer in r.keyids), None)


def first_artifact_entry(db: Database, digest: str) -> EntryRow | None:
    """The first entry of the artifact ``digest``: the one every lineage view describes it by."""
    rows = _select(db, _FULL_COLUMNS, "WHERE artifact_digest = ? ORDER BY log_index LIMIT 1", [digest])
    return _entry_row(rows[0]) if rows else None


def children(db: Database, digest: str, limit: int = MAX_CHILDREN) -> list[EntryRow]:
    """The artifact entries naming ``digest`` as their parent, in log order, at most ``limit``."""
    tail = f"WHERE kind = 'artifact' AND parent = ? ORDER BY log_index LIMIT {int(limit)}"
    return [_entry_row(v) for v in _select(db, _FULL_COLUMNS, tail, [digest])]


def subjects(db: Database, log_indices: Iterable[int]) -> dict[int, list[SubjectRow]]:
    """The subjects of each entry in ``log_indices``, by name (entries without subjects are absent)."""
    marks, indices = _in_list(log_indices)
    if not indices:
        return {}
    rows = db.query(
        f"SELECT log_index, name, digest FROM entry_subjects WHERE log_index IN {marks} ORDER BY log_index, name", indices
    )
    out: dict[int, list[SubjectRow]] = {}
    for log_index, name, digest in rows:
        out.setdefault(int(log_index), []).append(SubjectRow(name, digest))
    return out


def stored_envelope(db: Database, log_index: int) -> StoredEnvelope | None:
    """The envelope bytes of the entry at ``log_index`` as logged, or None."""
    row = db.query_one("SELECT log_index, digest, envelope FROM entries WHERE log_index = ?", [log_index])
    if row is None:
        return None
    log_index, digest, envelope = row
    return StoredEnvelope(int(log_index), str(digest), bytes(envelope))


def envelopes(db: Database, log_indices: Iterable[int]) -> dict[int, bytes]:
    """The envelope bytes of each entry in ``log_indices``, by log index."""
    return _bytes_by(db, "entries", "log_index", "envelope", log_indices)


def envelopes_between(db: Database, start: int, end: int) -> list[StoredEnvelope]:
    """The envelopes of entries ``start`` to ``end - 1`` as logged, in log order (a tlog-tiles entry bundle)."""
    rows = db.query(
        "SELECT log_index, digest, envelope FROM entries WHERE log_index >= ? AND log_index < ? ORDER BY log_index",
        [start, end],
    )
    return [StoredEnvelope(int(i), str(d), bytes(e)) for i, d, e in rows]


def envelopes_longer_than(db: Database, start: int, end: int, limit: int) -> list[tuple[int, int]]:
    """``(log_index, size)`` of entries ``start`` to ``end - 1`` whose envelope is over ``limit`` bytes,
    in log order (sizes only: no envelope is read)."""
    rows = db.query(
        "SELECT log_index, octet_length(envelope) FROM entries WHERE log_index >= ? AND log_index < ? "
        "AND octet_length(envelope) > ? ORDER BY log_index",
        [start, end, limit],
    )
    return [(int(i), int(n)) for i, n in rows]


def exactness_companions(db: Database, log_index: int, limit: int = 6) -> list[StoredEnvelope]:
    """Other exactness records over any prefix artifact of the exactness record at ``log_index``, in log order."""
    rows = db.query(
        "SELECT DISTINCT e.log_index, e.digest, e.envelope FROM entry_refs r JOIN entries e ON e.log_index = r.log_index "
        "WHERE r.role = 'prefix_artifact' AND e.kind = 'exactness' AND e.log_index <> ? AND r.ref IN "
        "(SELECT ref FROM entry_refs WHERE log_index = ? AND role = 'prefix_artifact') "
        f"ORDER BY e.log_index LIMIT {int(limit)}",
        [log_index, log_index],
    )
    return [StoredEnvelope(int(i), str(d), bytes(e)) for i, d, e in rows]


# --- lineage -----------------------------------------------------------------------------------


def ancestors(
    db: Database,
    digest: str,
    parent: str | None,
    limit: int,
    *,
    first_entry: Callable[[str], EntryRow | None] | None = None,
) -> Ancestry:
    """The ancestors of the artifact ``digest`` whose parent is ``parent``, nearest first, at most ``limit``.

    The one lineage walk: publish refuses a chain it cuts, the API and the pages show what it
    found. Each ancestor is described by its first entry; the walk follows that entry's parent,
    keeps the digests seen (``digest`` included, so it need not be logged yet), and stops at a
    root, at an ancestor with no entry, at a digest seen before (``"cycle"``, possible in old
    data) or when one more ancestor lies past ``limit`` (``"depth"``): at most ``limit`` + 1
    indexed lookups, whatever the data. ``first_entry`` finds an artifact's first entry
    (default: ``first_artifact_entry``; the sequencer's also sees its batch's entries).
    """
    if first_entry is None:
        first_entry = functools.partial(first_artifact_entry, db)
    seen = {digest}
    out: list[Ancestor] = []
    current = parent
    while current is not None:
        if current in seen:
            return Ancestry(out, "cycle", current)
        if len(out) == limit:
            return Ancestry(out, "depth", current)
        seen.add(current)
        entry = first_entry(current)
        out.append(Ancestor(current, entry))
        if entry is None or entry.artifact is None:
            break
        current = entry.artifact.parent
    return Ancestry(out)


# --- publishers, counts, facets ----------------------------------------------------------------


def publisher_keys(db: Database, publisher: str) -> tuple[PublisherKey, ...]:
    """The keys registered to ``publisher``, sorted by key id."""
    rows = db.query("SELECT keyid, public_key_pem FROM publisher_keys WHERE publisher = ? ORDER BY keyid", [publisher])
    return tuple(PublisherKey(str(keyid), str(pem)) for keyid, pem in rows)


def publisher_names(db: Database) -> list[str]:
    """Every publisher's name, sorted."""
    return [str(name) for (name,) in db.query("SELECT name FROM publishers ORDER BY name")]


def totals(db: Database) -> Totals:
    """Entries per kind, publishers and registered keys, in one statement."""
    kinds: dict[str, int] = {}
    publishers = keys = 0
    # The kinds are lowercase words; the two other counts are named so that no kind can clash.
    for kind, n in db.query(
        "SELECT kind, count(*) FROM entries GROUP BY kind UNION ALL "
        "SELECT '.publishers', count(*) FROM publishers UNION ALL SELECT '.keys', count(*) FROM publisher_keys"
    ):
        if kind == ".publishers":
            publishers = int(n)
        elif kind == ".keys":
            keys = int(n)
        else:
            kinds[kind] = int(n)
    return Totals(kinds, publishers, keys)


def kinds_by_publisher(db: Database) -> dict[str, dict[str, int]]:
    """Per publisher, how many entries of each kind it published."""
    out: dict[str, dict[str, int]] = {}
    for publisher, kind, n in db.query("SELECT publisher, kind, count(*) FROM entries GROUP BY publisher, kind"):
        out.setdefault(publisher, {})[kind] = int(n)
    return out


def artifact_facets(db: Database) -> Facets:
    """The models, profiles and publishers of all artifacts, each distinct and sorted."""
    row = db.query_one(
        "SELECT array_agg(DISTINCT model_name ORDER BY model_name) AS models, "
        "array_agg(DISTINCT profile_name ORDER BY profile_name) AS profiles, "
        "array_agg(DISTINCT publisher ORDER BY publisher) AS publishers FROM entries WHERE kind = 'artifact'"
    )
    models, profiles, publishers = row if row is not None else (None, None, None)
    return Facets(list(models or []), list(profiles or []), list(publishers or []))


# --- checkpoints -------------------------------------------------------------------------------


def checkpoint_note(db: Database, tree_size: int) -> bytes | None:
    """The signed checkpoint note at ``tree_size``, or None."""
    note = _value(db, "SELECT note FROM checkpoints WHERE tree_size = ?", [tree_size])
    return None if note is None else bytes(note)


def checkpoints(db: Database, before: int, limit: int) -> Listing[CheckpointRow]:
    """Checkpoints below tree size ``before``, newest first, ``limit`` of them."""
    rows = db.query(
        "SELECT tree_size, root_hash, created_at FROM checkpoints WHERE tree_size < ? ORDER BY tree_size DESC "
        f"LIMIT {int(limit) + 1}",
        [before],
    )
    return _listing([CheckpointRow(int(size), bytes(root), str(at)) for size, root, at in rows], limit)


def newest_checkpoint(db: Database, max_size: int) -> SignedCheckpoint | None:
    """The checkpoint of the largest tree size up to ``max_size``, or None."""
    row = db.query_one(
        "SELECT tree_size, root_hash, note FROM checkpoints WHERE tree_size <= ? ORDER BY tree_size DESC LIMIT 1", [max_size]
    )
    if row is None:
        return None
    tree_size, root_hash, note = row
    return SignedCheckpoint(int(tree_size), bytes(root_hash), bytes(note))


def leaf_hashes(db: Database, start: int, end: int) -> list[tuple[int, bytes]]:
    """``(log_index, leaf_hash)`` of the entries ``start`` to ``end - 1`` that are stored, in log order."""
    rows = db.query(
        "SELECT log_index, leaf_hash FROM entries WHERE log_index >= ? AND log_index < ? ORDER BY log_index", [start, end]
    )
    return [(int(i), bytes(h)) for i, h in rows]


def checkpoint_roots(db: Database, tree_sizes: Iterable[int]) -> dict[int, bytes]:
    """The root hash of each checkpoint in ``tree_sizes`` that was signed, by tree size."""
    return _bytes_by(db, "checkpoints", "tree_size", "root_hash", tree_sizes)


# --- short digests -----------------------------------------------------------------------------
# Resolved as git resolves an abbreviated object name: a unique prefix names its digest; an
# ambiguous one is refused with the candidates listed (the UI, GET /v1/digests/{prefix}, kvgraft pull).

#: The fewest hex digits a short digest may have (git's minimum abbreviation).
MIN_PREFIX_HEX = 4
#: Candidates listed at most for an ambiguous prefix.
MAX_PREFIX_MATCHES = 10


class DigestMatch(NamedTuple):
    """A digest a prefix names: an artifact's tensors (``kind`` artifact, its first entry) or a record's envelope."""

    digest: str
    kind: str
    log_index: int
    publisher: str


def parse_digest_prefix(text: str) -> str | None:
    """The hex digits of a short digest (``sha256:1f2e``, ``1f2e3d4c``; 4 to 64 lowercase hex), or
    None when ``text`` is not one."""
    hex_part = text.removeprefix("sha256:")
    if MIN_PREFIX_HEX <= len(hex_part) <= 64 and all(c in "0123456789abcdef" for c in hex_part):
        return hex_part
    return None


def digest_prefix_matches(
    db: Database, prefix_hex: str, *, artifacts_only: bool = False, limit: int = MAX_PREFIX_MATCHES
) -> list[DigestMatch]:
    """Artifacts whose tensor digest, then records whose envelope digest, start with
    ``sha256:<prefix_hex>``, each ordered by digest; at most ``limit + 1`` (one more says there are more).

    ``prefix_hex`` must come from ``parse_digest_prefix``: hex only, so no LIKE wildcard reaches the query.
    """
    if parse_digest_prefix(prefix_hex) != prefix_hex:
        raise BadRequestError(f"{prefix_hex[:80]!r} is not a short digest", hint="pass 4 to 64 lowercase hex digits")
    like, cap = f"sha256:{prefix_hex}%", int(limit) + 1
    rows = db.query(
        "SELECT e.artifact_digest, 'artifact', e.log_index, e.publisher FROM entries e WHERE e.artifact_digest LIKE ? "
        "AND e.log_index = (SELECT min(f.log_index) FROM entries f WHERE f.artifact_digest = e.artifact_digest) "
        f"ORDER BY e.artifact_digest LIMIT {cap}",
        [like],
    )
    if not artifacts_only and len(rows) < cap:
        rows += db.query(
            f"SELECT digest, kind, log_index, publisher FROM entries WHERE kind <> 'artifact' AND digest LIKE ? "
            f"ORDER BY digest LIMIT {cap - len(rows)}",
            [like],
        )
    return [DigestMatch(str(d), str(k), int(i), str(p)) for d, k, i, p in rows]


# --- linked records ----------------------------------------------------------------------------

#: Linked records read at most for one record page.
MAX_LINKED = 50


def linked_entries(db: Database, log_index: int, digest: str, limit: int = MAX_LINKED) -> list[EntryRow]:
    """The records linked with entry ``log_index`` (envelope ``digest``) both ways, in log order:
    those that reference it (a replay names its pre-registration), those it references, and
    those with a subject file of the same digest (an evaluation's outputs are its
    pre-registration's expected outputs, and a reproducing replay's outputs)."""
    tail = (
        "WHERE kind <> 'artifact' AND log_index <> ? AND ("
        "log_index IN (SELECT log_index FROM entry_refs WHERE ref = ?) "
        "OR digest IN (SELECT ref FROM entry_refs WHERE log_index = ?) "
        "OR log_index IN (SELECT s.log_index FROM entry_refs s WHERE s.role = 'subject' AND s.ref IN "
        "(SELECT ref FROM entry_refs WHERE log_index = ? AND role = 'subject'))) "
        f"ORDER BY log_index LIMIT {int(limit)}"
    )
    return [_entry_row(v) for v in _select(db, _FULL_COLUMNS, tail, [log_index, digest, log_index, log_index])]
