"""The registry's log as c2sp.org/tlog-tiles: served under ``/tlog/``, and exported to a directory.

Served (``app.py``; docs/registry.md, "The log as tiles")::

    GET /tlog/checkpoint                      the note GET /v1/log/checkpoint serves (text/plain)
    GET /tlog/tile/<L>/<N>[.p/<W>]            hash tiles, from the in-memory Merkle tree
    GET /tlog/tile/entries/<N>[.p/<W>]        entry bundles, from the entries table

A tile exists once the announced tree (the latest signed checkpoint) is large enough to have it
(``Tile.min_tree_size``): the partial tiles of every size up to it are served, so every partial
tile any checkpoint produced (one per batch of publishes) still is, as the spec requires; one
wider than the tree is 404. Full
tiles and bundles never change (``Cache-Control: ... immutable``); partial ones get a short
max-age. Entry bundles hold the envelopes exactly as logged; an envelope over 65,535 bytes
cannot be length-prefixed with a uint16, so the bundle that would hold it is 404
(``EntryTooLargeForTilesError``: which entry, its size, the limit, and its URL under /v1) and
the entry is read from the API, its leaf hash still proven by the level-0 tile.

``export_tiles`` writes the same resources to a directory, so that any static file server over
it (``python -m http.server``) is a complete tlog-tiles log: the data directory's database is
opened read-only, as ``kvgraft fsck`` opens it (refused while a server holds it); leaf hashes are
recomputed from the envelopes; full tiles and bundles already there are compared byte for byte
and kept (a difference is refused: the directory holds another log); every file is written
atomically; the whole directory is then read back and verified with the registry's key before
the checkpoint is written, last; partial tiles superseded by full ones are removed after it.
"""

from __future__ import annotations

import hashlib
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from kvgraft.schemas import write_atomic
from kvgraft.verifier import (
    MAX_ENTRY_BYTES,
    TILE_WIDTH,
    TILES_CHECKPOINT,
    Checkpoint,
    DirectoryTileSource,
    KeyFileError,
    LogProofError,
    MalformedInputError,
    MerkleTree,
    Tile,
    bundles_for_size,
    encode_bundle,
    fetch_checkpoint,
    format_vkey,
    hash_leaf,
    load_public_key,
    parse_tile_path,
    read_tiled_log,
    require_ed25519,
    tile_data,
    tiles_for_size,
    verify_checkpoint,
)

from . import queries
from .datadir import PUBLIC_KEY_FILE
from .errors import DataDirError, EntryTooLargeForTilesError, LogIntegrityError, TileNotFoundError
from .log.cosignatures import CosignatureStore
from .ranges import none_match
from .storage.db import DB_FILE, DUCKDB, POSTGRES, Database, redact
from .storage.ddl import SCHEMA_VERSION

if TYPE_CHECKING:
    from .service import Registry

#: Where the registry serves the tiled log (the tlog-tiles *prefix* is ``<registry URL>/tlog/``).
TILES_PREFIX = "/tlog"
#: Full tiles and bundles never change.
IMMUTABLE = "public, max-age=31536000, immutable"
#: A partial tile never changes either, but is superseded by the full one (and may be removed then).
PARTIAL = "public, max-age=60"
#: The checkpoint changes with every entry (the spec: no caching beyond a few seconds).
CHECKPOINT_CACHE = "no-cache"

_FILE_MODE = 0o644


# --- serving -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class TileResource:
    """A tile or bundle to answer with: ``body`` is None when the client's copy (If-None-Match) is current."""

    tile: Tile
    etag: str
    body: bytes | None

    @property
    def cache_control(self) -> str:
        """Long-lived for a full tile or bundle, short for a partial one."""
        return IMMUTABLE if self.tile.is_full else PARTIAL


def tile_resource(registry: Registry, path: str, if_none_match: str | None) -> TileResource:
    """The tile or entry bundle at ``path`` (under ``/tlog/``, e.g. ``tile/0/000.p/7``) of the announced tree.

    404 (``TileNotFoundError``) for a malformed path or a tile the tree does not have yet;
    ``EntryTooLargeForTilesError`` (404) for a bundle holding an entry over 65,535 bytes. The ETag
    is the sha256 of the tile, or, for a bundle, of its level-0 tile (which fixes every entry),
    so a bundle that has not changed is answered without reading an envelope.
    """
    try:
        tile = parse_tile_path(path)
    except MalformedInputError as e:
        raise TileNotFoundError(e.message, hint=e.hint) from e
    with registry.db.lock:
        size = registry.head.size
        if tile.min_tree_size > size:
            raise TileNotFoundError(_not_yet(tile, size))
        hashes = registry.log.tile(Tile(0, tile.index, tile.width) if tile.is_bundle else tile)
    etag = f'"{"entries-" if tile.is_bundle else ""}sha256:{hashlib.sha256(hashes).hexdigest()}"'
    if none_match(if_none_match, etag):
        return TileResource(tile, etag, None)
    body = _bundle(registry.db, tile) if tile.is_bundle else hashes
    return TileResource(tile, etag, body)


def _not_yet(tile: Tile, size: int) -> str:
    return (
        f"{tile} is not in this log yet: it needs a tree of {tile.min_tree_size} entries and the latest "
        f"checkpoint has {size}"
    )


def _too_large(tile: Tile, index: int, size: int) -> EntryTooLargeForTilesError:
    url = f"/v1/entries/{index}/envelope"
    return EntryTooLargeForTilesError(
        f"{tile} would hold entry {index}, whose envelope is {size} bytes: a tlog-tiles entry bundle holds "
        f"entries of at most {MAX_ENTRY_BYTES} bytes (a uint16 length), so this bundle does not exist",
        hint=f"read entry {index} at {url} (and the bundle's other entries at /v1/entries/<index>/envelope); "
        f"its leaf hash, SHA-256(0x00 || envelope), is hash {index - tile.start} of {Tile(0, tile.index, tile.width)}",
        extra={"entry": index, "size": size, "limit": MAX_ENTRY_BYTES, "envelope_url": url},
    )


def _bundle(db: Database, tile: Tile) -> bytes:
    """The entry bundle ``tile`` from the stored envelopes; refused before reading any when one is too long."""
    end = tile.start + tile.width
    longer = queries.envelopes_longer_than(db, tile.start, end, MAX_ENTRY_BYTES)
    if longer:
        raise _too_large(tile, *longer[0])
    stored = queries.envelopes_between(db, tile.start, end)
    if [s.log_index for s in stored] != list(range(tile.start, end)):
        raise LogIntegrityError(f"the database lacks some of entries {tile.start} to {end - 1}, which the log has")
    return encode_bundle(s.envelope for s in stored)


# --- export ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SkippedBundle:
    """An entry bundle not written: it would hold ``entry``, whose envelope is ``size`` bytes."""

    tile: Tile
    entry: int
    size: int

    def document(self) -> dict[str, Any]:
        """The JSON form."""
        return {
            "bundle": self.tile.path, "entry": self.entry, "size": self.size, "limit": MAX_ENTRY_BYTES,
            "envelope_url": f"/v1/entries/{self.entry}/envelope",
        }


@dataclass
class ExportReport:
    """What ``export_tiles`` did: the tree exported, and the files written, kept and removed."""

    out: Path
    origin: str = ""
    tree_size: int = 0
    root_hash: bytes = b""
    previous_size: int | None = None
    written: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    skipped: list[SkippedBundle] = field(default_factory=list)

    def document(self) -> dict[str, Any]:
        """The report as JSON (``kvgraft tiles export --json``)."""
        return {
            "out": str(self.out),
            "origin": self.origin,
            "tree_size": self.tree_size,
            "root_hash": self.root_hash.hex(),
            "previous_tree_size": self.previous_size,
            "written": len(self.written),
            "kept": len(self.kept),
            "removed": self.removed,
            "skipped_bundles": [s.document() for s in self.skipped],
        }

    def summary(self) -> str:
        """A few lines for people."""
        was = "" if self.previous_size is None else f" (was {self.previous_size})"
        lines = [
            f"exported the log {self.origin} at tree size {self.tree_size}{was} to {self.out}: {len(self.written)} "
            f"file(s) written, {len(self.kept)} full tile(s) and bundle(s) kept (verified), {len(self.removed)} "
            "superseded partial(s) removed",
        ]
        for s in self.skipped:
            lines.append(
                f"note: {s.tile} not written: entry {s.entry} is {s.size} bytes, over the {MAX_ENTRY_BYTES} a bundle "
                f"entry can be; read it at <registry>/v1/entries/{s.entry}/envelope"
            )
        return "\n".join(lines)


_BUSY_HINT = (
    "stop the server and export again; or read the running registry's tiles over HTTP at <registry>/tlog/ "
    "(they are the same resources)"
)


def export_tiles(data: Path, out: Path, *, database: str | None = None) -> ExportReport:
    """Write the log of registry data directory ``data`` to ``out`` as tlog-tiles (see the module docstring).

    With ``database`` the metadata is read from that PostgreSQL database, in one read-only
    snapshot while its servers keep running. Raises ``DataDirError`` (``DatabaseLockedError``
    while a server holds the DuckDB file) when ``data`` cannot be read, ``LogIntegrityError``
    when ``out`` holds another log's files or a newer checkpoint, or the stored log does not verify.
    """
    from .fsck import read_only_snapshot

    with read_only_snapshot(data, database, command="kvgraft tiles export", busy_hint=_BUSY_HINT) as conn:
        public_key = _registry_key(data)
        db = Database(data / DB_FILE if database is None else redact(database), conn, DUCKDB if database is None else POSTGRES)
        _check_schema(db)
        return _Exporter(db, public_key, out).run()


def _check_schema(db: Database) -> None:
    # Read-only, the database cannot be migrated here: one from an older kvgraft lacks tables.
    row = db.query_one("SELECT max(version) FROM schema_version")
    current = int(row[0]) if row is not None and row[0] is not None else 0
    known = SCHEMA_VERSION
    if current != known:
        raise DataDirError(
            f"the registry database {db.path} has schema version {current}; this kvgraft reads version {known}",
            hint="start the registry once with this kvgraft ('kvgraft serve --data DIR') to migrate it, then export"
            if current < known else "export with the kvgraft that last served this data directory",
        )


def _registry_key(data: Path) -> Ed25519PublicKey:
    path = data / PUBLIC_KEY_FILE
    try:
        return require_ed25519(load_public_key(path), f"the registry key {PUBLIC_KEY_FILE}")
    except KeyFileError as e:
        raise DataDirError(
            f"the registry's public key cannot be loaded: {e.message}",
            hint=f"start the registry once ('kvgraft serve --data {data}') so that it writes {PUBLIC_KEY_FILE}",
        ) from e


class _Exporter:
    def __init__(self, db: Database, public_key: Ed25519PublicKey, out: Path) -> None:
        self.db = db
        self.out = out
        self.report = ExportReport(out=out)
        origin = db.get_meta("origin")
        if origin is None:
            raise DataDirError("the registry database has no log origin yet", hint="start the registry once to initialise it")
        self.origin = origin
        self.public_key = public_key
        self.vkey = format_vkey(origin, public_key)

    def run(self) -> ExportReport:
        report = self.report
        note, checkpoint = self._latest_checkpoint()
        report.origin, report.tree_size, report.root_hash = self.origin, checkpoint.size, checkpoint.root_hash
        previous = self._previous_checkpoint(checkpoint)
        report.previous_size = None if previous is None else previous.size
        if self.out.exists() and not self.out.is_dir():
            raise DataDirError(f"{self.out} exists and is not a directory", hint="pass a directory for --out")
        leaves = list(self._bundles(checkpoint.size))
        tree = MerkleTree(leaves)
        if tree.root() != checkpoint.root_hash:
            raise LogIntegrityError(
                f"the stored envelopes make root {tree.root().hex()} at size {checkpoint.size}, not the latest "
                f"checkpoint's {checkpoint.root_hash.hex()}",
                hint="run 'kvgraft fsck --data DIR' to find the damaged entry; restore registry.duckdb from a backup",
            )
        if previous is not None and tree.root(previous.size) != previous.root_hash:
            raise LogIntegrityError(
                f"{self.out / TILES_CHECKPOINT} is this log's checkpoint at size {previous.size}, but with another root "
                "than the registry's tree at that size: the directory holds a fork of the log",
                hint="export into a new directory; keep the old one as evidence",
            )
        for tile in tiles_for_size(checkpoint.size):
            self._put(tile, tile_data(tree, tile))
        self._verify(note, checkpoint)
        self._write(TILES_CHECKPOINT, note)
        self._remove_superseded(0 if previous is None else previous.size, checkpoint.size)
        return report

    def _latest_checkpoint(self) -> tuple[bytes, Checkpoint]:
        # The note the registry serves at /v1/log/checkpoint after a restart: its latest, with the
        # witness cosignature lines stored for it (tlog-tiles clients ignore signatures they do not know).
        latest = queries.checkpoints(self.db, before=1 << 63, limit=1).rows
        note = queries.checkpoint_note(self.db, latest[0].tree_size) if latest else None
        if note is None:
            raise DataDirError("the registry database holds no checkpoint yet", hint="start the registry once to initialise it")
        try:
            checkpoint = verify_checkpoint(note, self.origin, self.public_key, origin=self.origin)
            return note + CosignatureStore(self.db).lines(checkpoint.size), checkpoint
        except (LogProofError, MalformedInputError) as e:
            raise LogIntegrityError(
                f"the latest stored checkpoint does not verify with the registry key: {e.message}",
                hint="run 'kvgraft fsck --data DIR'",
            ) from e

    def _previous_checkpoint(self, checkpoint: Checkpoint) -> Checkpoint | None:
        path = self.out / TILES_CHECKPOINT
        if not self.out.is_dir():
            return None
        try:
            data = fetch_checkpoint(DirectoryTileSource(self.out))
            if data is None:
                return None
            previous = verify_checkpoint(data, self.origin, self.public_key, origin=self.origin)
        except (LogProofError, MalformedInputError) as e:
            raise LogIntegrityError(
                f"{path} is not a checkpoint of this log ({self.origin}) signed by this registry: {e.message}",
                hint="export into an empty directory (or one this registry's log was exported to)",
            ) from e
        if previous.size > checkpoint.size:
            raise LogIntegrityError(
                f"{path} is for tree size {previous.size}, but the registry's latest checkpoint is for {checkpoint.size}: "
                "the data directory is behind what was exported (rolled back?)",
                hint="run 'kvgraft fsck --data DIR'; never export an older log over a newer one",
            )
        return previous

    def _bundles(self, size: int) -> Iterator[bytes]:
        """Write every entry bundle; yield every entry's leaf hash, recomputed from its envelope."""
        for tile in bundles_for_size(size):
            end = tile.start + tile.width
            longer = queries.envelopes_longer_than(self.db, tile.start, end, MAX_ENTRY_BYTES)
            if longer:
                # Read one at a time (each may be up to the registry's envelope limit): only the hashes are needed.
                self.report.skipped.append(SkippedBundle(tile, *longer[0]))
                for index in range(tile.start, end):
                    stored = queries.stored_envelope(self.db, index)
                    if stored is None:
                        raise LogIntegrityError(f"the database has no entry {index}, which its latest checkpoint covers")
                    yield hash_leaf(stored.envelope)
                continue
            envelopes = [s.envelope for s in queries.envelopes_between(self.db, tile.start, end)]
            if len(envelopes) != tile.width:
                raise LogIntegrityError(f"the database lacks some of entries {tile.start} to {end - 1}, which its checkpoint covers")
            self._put(tile, encode_bundle(envelopes))
            yield from (hash_leaf(e) for e in envelopes)

    def _put(self, tile: Tile, data: bytes) -> None:
        """Write ``tile`` unless it is there already with these bytes; refuse a full one that differs."""
        path = self.out / tile.path
        if path.is_file():
            # At most one full bundle (16 MiB) is read back at a time.
            if path.stat().st_size == len(data) and path.read_bytes() == data:
                self.report.kept.append(tile.path)
                return
            if tile.is_full:
                raise LogIntegrityError(
                    f"{path} is not this log's {tile}: the directory holds another log's files, or they were altered",
                    hint="export into an empty directory (full tiles never change; kvgraft does not overwrite one)",
                )
        self._write(tile.path, data)

    def _write(self, name: str, data: bytes) -> None:
        write_atomic(self.out / name, data, _FILE_MODE)
        self.report.written.append(name)

    def _verify(self, note: bytes, checkpoint: Checkpoint) -> None:
        """Read the directory back as a tlog-tiles client would, with the new checkpoint, before publishing it."""
        source = _WithCheckpoint(DirectoryTileSource(self.out), note)
        skipped = {s.tile.path for s in self.report.skipped}
        try:
            log = read_tiled_log(
                source, self.vkey, origin=self.origin, max_entries=max(checkpoint.size, 1),
                allow_missing_bundles=bool(skipped), keep_entries=False,
            )
        except (LogProofError, MalformedInputError) as e:
            raise LogIntegrityError(f"the exported tiles in {self.out} do not verify: {e.message}", hint=e.hint) from e
        missing = {t.path for t in log.missing}
        if missing != skipped:
            raise LogIntegrityError(f"the exported tiles in {self.out} lack {', '.join(sorted(missing - skipped))}")

    def _remove_superseded(self, old_size: int, new_size: int) -> None:
        """Remove the partial tiles (``<N>.p/``) of every tile index that became full since ``old_size``."""
        levels: list[int | None] = [None]
        while new_size >= TILE_WIDTH ** (len(levels)):
            levels.append(len(levels) - 1)
        for level in levels:
            span = TILE_WIDTH ** ((0 if level is None else level) + 1)
            for index in range(old_size // span, new_size // span):
                full = Tile(level, index)
                partials = (self.out / full.path).with_name(full.path.rsplit("/", 1)[1] + ".p")
                if partials.is_dir() and not partials.is_symlink():
                    shutil.rmtree(partials)
                    self.report.removed.append(str(partials.relative_to(self.out)))


class _WithCheckpoint:
    """A directory source that answers ``checkpoint`` with a note not written yet."""

    def __init__(self, inner: DirectoryTileSource, note: bytes) -> None:
        self.inner = inner
        self.note = note

    def describe(self) -> str:
        return self.inner.describe()

    def fetch(self, path: str, max_bytes: int) -> bytes | None:
        return self.note if path == TILES_CHECKPOINT else self.inner.fetch(path, max_bytes)
