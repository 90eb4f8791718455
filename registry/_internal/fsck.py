"""``kvgraft fsck``: check a registry data directory offline, end to end.

What it checks, in order:

1. every file under ``blobs/sha256/`` hashes to its name; one that does not is moved to
   ``blobs/quarantine/<hex>.<UTC timestamp>`` (fsynced), so no server serves it again, and an
   upload of the right bytes repairs it;
2. every entry's stored envelope hashes to its recorded digest and RFC 9162 leaf hash, decodes
   as a DSSE envelope whose statement names the subjects the index recorded, and every blob the
   entry needs (its subjects, a KV artifact's parent tensors) is stored and intact;
3. the log: entries are numbered 0..n-1 without a gap, and the Merkle root recomputed from the
   envelopes (not from the stored leaf hashes) matches every stored checkpoint, whose note
   must verify with the registry key; the latest checkpoint covers every entry; the tree head
   kept outside the database (``signed-head.json``) verifies, is not ahead of the database
   (a rollback) and has the same root at its size (a fork).

The DuckDB file is opened read-only, and held for the whole run, so no server can start and write
meanwhile; a running server holds it, and fsck then refuses with a hint (stop the server, or
let it scrub its blobs in the background with ``--scrub-interval``). A PostgreSQL database
(``--database URL``) is read in one ``REPEATABLE READ READ ONLY`` transaction while its servers
keep running: every check sees one committed state of the log, and ``signed-head.json`` is read
before that snapshot is taken, so a head a server saves meanwhile cannot look like a rollback.
"""

from __future__ import annotations

import contextlib
import hashlib
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import duckdb
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from kvgraft.schemas import KV_ARTIFACT_PREDICATE, DocumentError, parse_json, payload_unverified
from kvgraft.verifier import (
    KeyFileError,
    LogProofError,
    MalformedInputError,
    MerkleTree,
    keyid_of,
    load_private_key,
    load_public_key,
    require_ed25519,
    verify_checkpoint,
)

from .blobs.factory import open_blob_store
from .blobs.store import BlobStore
from .datadir import (
    BLOB_STORE_META,
    KEY_FILE,
    PUBLIC_KEY_FILE,
    SIGNED_HEAD_FILE,
    DataDir,
    SignedHead,
    blob_store_mismatch,
    blob_store_name,
    read_signed_head,
)
from .errors import DatabaseLockedError, DataDirError, RegistryError
from .log.tree import hash_leaf
from .settings import RegistrySettings
from .storage.db import DB_FILE, Connection, PostgresConnection, is_postgres_url, redact

#: Envelopes fetched from the database per batch: memory stays bounded by a few of the largest.
_BATCH = 64
#: Damaged things named in the one-line failure; the JSON report lists all of them.
_NAMED = 10
#: DuckDB names the process holding its file lock so: "... (PID 1234) ...".
_LOCK_PID = re.compile(r"\(PID (\d+)\)")


@dataclass(frozen=True)
class Damage:
    """One damaged thing: ``kind`` is blob, entry, log, checkpoint or key; ``name`` says which
    (``blob sha256:<hex>``, ``entry 3``, ``checkpoint 7``); ``detail`` what is wrong with it."""

    kind: str
    name: str
    detail: str
    quarantined_to: str | None = None

    def document(self) -> dict[str, Any]:
        """The JSON form of the damage."""
        doc: dict[str, Any] = {"kind": self.kind, "name": self.name, "detail": self.detail}
        if self.quarantined_to is not None:
            doc["quarantined_to"] = self.quarantined_to
        return doc


@dataclass
class FsckReport:
    """What fsck checked and found; ``ok`` when nothing is damaged."""

    data: Path
    blobs_checked: int = 0
    blob_bytes: int = 0
    entries_checked: int = 0
    checkpoints_checked: int = 0
    tree_size: int = 0
    damaged: list[Damage] = field(default_factory=list)
    #: Files under blobs/sha256 whose names are not digests: never served, left in place.
    strays: list[str] = field(default_factory=list)
    #: Files already in blobs/quarantine when fsck started (from earlier checks).
    previously_quarantined: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Whether nothing is damaged."""
        return not self.damaged

    @property
    def quarantined(self) -> list[str]:
        """The quarantine paths (under ``blobs/``) of the blobs this run moved aside."""
        return [d.quarantined_to for d in self.damaged if d.quarantined_to is not None]

    def names(self) -> str:
        """The damaged things, named, for a one-line message."""
        shown = [f"{d.name} ({d.detail})" for d in self.damaged[:_NAMED]]
        more = len(self.damaged) - _NAMED
        return "; ".join(shown) + (f"; and {more} more" if more > 0 else "")

    def document(self) -> dict[str, Any]:
        """The report as JSON (``kvgraft fsck --json``)."""
        return {
            "data": str(self.data),
            "clean": self.ok,
            "blobs": {
                "checked": self.blobs_checked,
                "bytes": self.blob_bytes,
                "strays": self.strays,
                "previously_quarantined": self.previously_quarantined,
            },
            "entries": {"checked": self.entries_checked},
            "log": {"tree_size": self.tree_size, "checkpoints_checked": self.checkpoints_checked},
            "damaged": [d.document() for d in self.damaged],
            "quarantined": self.quarantined,
        }

    def summary(self) -> str:
        """A few lines for people."""
        lines = [
            f"fsck {self.data}: {self.blobs_checked} blob(s) ({self.blob_bytes} bytes), {self.entries_checked} "
            f"entr{'y' if self.entries_checked == 1 else 'ies'}, {self.checkpoints_checked} checkpoint(s) checked; "
            f"log at tree size {self.tree_size}",
        ]
        if self.ok:
            lines.append("no damage found")
        for d in self.damaged:
            moved = f" -> moved to blobs/{d.quarantined_to}" if d.quarantined_to else ""
            lines.append(f"DAMAGED {d.name}: {d.detail}{moved}")
        for s in self.strays:
            lines.append(f"note: blobs/sha256/{s} is not named by a digest (never served; left in place)")
        return "\n".join(lines)


def fsck(
    root: Path, *, quarantine: bool = True, settings: RegistrySettings | None = None, database: str | None = None
) -> FsckReport:
    """Check the data directory ``root`` (see the module docstring); quarantine damaged blobs
    unless ``quarantine`` is False. ``settings`` name the blob store (``blob_store``, ``s3``) when
    it is not ``root/blobs``; ``database`` the PostgreSQL database when the metadata is there.
    Raises ``DataDirError`` when ``root`` is not a registry data directory and
    ``DatabaseLockedError`` while a server (or an admin command) holds its DuckDB file;
    ``DatabaseUnavailableError`` when PostgreSQL does not answer, and an object store that does
    not answer raises ``StorageUnavailableError``."""
    report = FsckReport(data=root)
    try:  # before the snapshot: a head saved after it is taken would look like a rollback
        saved: SignedHead | DataDirError | None = read_signed_head(DataDir(root))
    except DataDirError as e:
        saved = e
    with read_only_snapshot(root, database) as conn:
        # The store the log's blobs are in, as the server recorded it: another would be all "missing".
        stored = conn.execute("SELECT value FROM meta WHERE key = ?", [BLOB_STORE_META]).fetchone()
        current = blob_store_name((settings or RegistrySettings()).blob_store)
        if stored is not None and str(stored[0]) != current:
            raise blob_store_mismatch(str(stored[0]), current)
        with open_blob_store(root / "blobs", settings or RegistrySettings()) as store:
            report.previously_quarantined = store.quarantine_names()
            scrubbed = store.scrub(quarantine=quarantine)
            report.blobs_checked, report.blob_bytes, report.strays = scrubbed.checked, scrubbed.bytes, scrubbed.strays
            damaged_blobs = set()
            for b in scrubbed.damaged:
                damaged_blobs.add(b.hex_digest)
                report.damaged.append(
                    Damage(
                        "blob",
                        f"blob sha256:{b.hex_digest}",
                        f"its {b.size} bytes hash to sha256:{b.actual}",
                        b.quarantined_to,
                    )
                )
            leaves = _check_entries(conn, store, damaged_blobs, report)
        _check_log(conn, root, leaves, saved, report)
    return report


_FSCK_BUSY_HINT = (
    "stop the server and run 'kvgraft fsck' again; while it runs, 'kvgraft serve --scrub-interval "
    "SECONDS' re-hashes its blobs in the background and it re-checks every small blob it serves"
)


@contextlib.contextmanager
def read_only_snapshot(
    root: Path, database: str | None, *, command: str = "fsck", busy_hint: str = _FSCK_BUSY_HINT
) -> Iterator[Connection]:
    """One unchanging view of the registry's metadata, for ``command``: the data directory's DuckDB
    file opened read-only (``open_read_only``), or, with ``database``, a ``REPEATABLE READ READ
    ONLY`` transaction on that PostgreSQL database, whose servers may go on writing meanwhile."""
    if database is None:
        if not (root / DB_FILE).is_file():
            raise DataDirError(f"{root} holds no registry database ({DB_FILE})", hint="pass the directory given to 'kvgraft serve --data'")
        duck = open_read_only(root, command=command, busy_hint=busy_hint)
        try:
            yield duck
        finally:
            duck.close()
        return
    if not is_postgres_url(database):
        raise DataDirError(
            f"--database {redact(database)[:80]!r} is not a PostgreSQL URL",
            hint="pass postgresql://USER@HOST:PORT/DBNAME, or no --database for the DuckDB file in the data directory",
        )
    pg = PostgresConnection(database, application_name="kvgraft-registry-fsck")
    try:
        pg.execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY").fetchall()
        try:
            pg.execute("SELECT count(*) FROM entries").fetchone()
            pg.execute("SELECT count(*) FROM checkpoints").fetchone()
        except RegistryError as e:
            raise DataDirError(
                f"{pg.location} is not a registry database kvgraft can check: {e.message}",
                hint="start the registry once with 'kvgraft serve --data DIR --database URL' to initialise it",
            ) from e
        yield pg
    finally:
        pg.close()  # the transaction wrote nothing: closing ends it


def open_read_only(root: Path, *, command: str = "fsck", busy_hint: str = _FSCK_BUSY_HINT) -> duckdb.DuckDBPyConnection:
    """The registry database of ``root``, opened read-only and held until closed, for ``command``.

    DuckDB lets no other process open the file meanwhile, so no server starts and writes under
    the reader; a running server holds it, and this raises ``DatabaseLockedError`` with ``busy_hint``.
    """
    path = root / DB_FILE
    try:
        conn = duckdb.connect(str(path), read_only=True)
    except duckdb.Error as e:
        if isinstance(e, duckdb.IOException) and "lock" in str(e).lower():
            pid = _LOCK_PID.search(str(e))
            holder = f"process {pid.group(1)}" if pid else "another process"
            raise DatabaseLockedError(
                f"the registry database {path} is in use by {holder} (a running server?); {command} needs it to itself",
                hint=busy_hint,
                extra={"pid": int(pid.group(1)) if pid else None},
            ) from e
        raise DataDirError(f"cannot open the registry database {path} read-only: {e}") from e
    try:
        conn.execute("SELECT count(*) FROM entries").fetchone()
        conn.execute("SELECT count(*) FROM checkpoints").fetchone()
    except duckdb.Error as e:
        conn.close()
        raise DataDirError(
            f"{path} is not a registry database kvgraft can check: {e}",
            hint="start the registry once with 'kvgraft serve --data DIR' to initialise it",
        ) from e
    return conn


def _rows(conn: Connection, sql: str) -> Iterator[tuple[Any, ...]]:
    cursor = conn.execute(sql)
    while batch := cursor.fetchmany(_BATCH):
        yield from batch


def _check_entries(
    conn: Connection, store: BlobStore, damaged_blobs: set[str], report: FsckReport
) -> list[bytes]:
    """Check each entry (see the module docstring); return the leaf hashes of the envelopes, in order."""
    recorded: dict[int, set[tuple[str, str]]] = {}
    for index, name, digest in conn.execute("SELECT log_index, name, digest FROM entry_subjects").fetchall():
        recorded.setdefault(int(index), set()).add((str(name), str(digest)))
    leaves: list[bytes] = []
    expected = 0
    for index, digest, leaf_hash, envelope in _rows(
        conn, "SELECT log_index, digest, leaf_hash, envelope FROM entries ORDER BY log_index"
    ):
        index = int(index)
        if index != expected:
            missing = f"entry {expected}" if index == expected + 1 else f"entries {expected} to {index - 1}"
            report.damaged.append(
                Damage("log", missing, f"missing from the database (the next stored entry is {index})")
            )
        expected = index + 1
        data = bytes(envelope)
        leaf = hash_leaf(data)
        leaves.append(leaf)
        report.entries_checked += 1
        name = f"entry {index}"
        actual = "sha256:" + hashlib.sha256(data).hexdigest()
        if actual != digest:
            report.damaged.append(
                Damage("entry", name, f"its stored envelope hashes to {actual}, not its recorded digest {digest}")
            )
        if bytes(leaf_hash) != leaf:
            report.damaged.append(
                Damage("entry", name, "its stored leaf hash is not the RFC 9162 leaf hash of its envelope")
            )
        try:
            subjects, required = _statement_blobs(data)
        except (DocumentError, MalformedInputError, KeyError, TypeError, ValueError, AttributeError) as e:
            report.damaged.append(
                Damage("entry", name, f"its stored envelope does not decode as a signed statement: {e}")
            )
            continue
        if subjects != recorded.get(index, set()):
            report.damaged.append(
                Damage("entry", name, "the subjects its statement names are not those the index recorded")
            )
        for hex_digest in required:
            what = f"blob sha256:{hex_digest}"
            if hex_digest in damaged_blobs:
                report.damaged.append(Damage("entry", name, f"needs {what}, which is damaged"))
            elif not store.exists(hex_digest):
                gone = "quarantined" if store.quarantined(hex_digest) else "not stored"
                report.damaged.append(Damage("entry", name, f"needs {what}, which is {gone}"))
    return leaves


def _statement_blobs(envelope: bytes) -> tuple[set[tuple[str, str]], list[str]]:
    """The (name, ``sha256:<hex>``) subjects of the envelope's statement, and the bare hex of every
    blob the registry required at publish (the subjects, and a KV artifact's parent tensors)."""
    statement = parse_json(payload_unverified(envelope, what="stored envelope"), what="stored statement")
    subjects = {(str(s["name"]), "sha256:" + str(s["digest"]["sha256"])) for s in statement["subject"]}
    required = [d.removeprefix("sha256:") for _, d in sorted(subjects, key=lambda s: s[0])]
    if statement.get("predicateType") == KV_ARTIFACT_PREDICATE:
        parent = statement["predicate"].get("parent")
        if isinstance(parent, str):
            required.append(parent.removeprefix("sha256:"))
    # A digest that is not 64 hex digits cannot name a blob; the registry refused it at publish.
    checked = [h for h in dict.fromkeys(required) if len(h) == 64 and all(c in "0123456789abcdef" for c in h)]
    if len(checked) != len(dict.fromkeys(required)):
        raise ValueError("a subject digest is not 64 lowercase hex digits")
    return subjects, checked


def _registry_public_key(root: Path, conn: Connection, report: FsckReport) -> Ed25519PublicKey | None:
    try:
        if (root / PUBLIC_KEY_FILE).is_file():
            public = require_ed25519(load_public_key(root / PUBLIC_KEY_FILE), f"the registry key {PUBLIC_KEY_FILE}")
        else:
            public = require_ed25519(load_private_key(root / KEY_FILE).public_key(), f"the registry key {KEY_FILE}")
    except (KeyFileError, OSError) as e:
        detail = e.message if isinstance(e, KeyFileError) else str(e)
        report.damaged.append(
            Damage("key", "registry key", f"cannot be loaded, so no checkpoint can be checked: {detail}")
        )
        return None
    row = conn.execute("SELECT value FROM meta WHERE key = 'registry_keyid'").fetchone()
    if row is not None and row[0] != keyid_of(public):
        report.damaged.append(
            Damage("key", "registry key", f"{keyid_of(public)} is not the key the log was started with ({row[0]})")
        )
        return None
    return public


def _check_log(
    conn: Connection, root: Path, leaves: list[bytes], saved: SignedHead | DataDirError | None, report: FsckReport
) -> None:
    tree = MerkleTree(leaves)
    report.tree_size = tree.size
    origin_row = conn.execute("SELECT value FROM meta WHERE key = 'origin'").fetchone()
    origin = str(origin_row[0]) if origin_row is not None else None
    public = _registry_public_key(root, conn, report)
    latest = -1
    for size, root_hash, note in _rows(conn, "SELECT tree_size, root_hash, note FROM checkpoints ORDER BY tree_size"):
        size = int(size)
        latest = max(latest, size)
        report.checkpoints_checked += 1
        name = f"checkpoint {size}"
        if size > tree.size:
            report.damaged.append(
                Damage("checkpoint", name, f"is for {size} entries, but the database holds {tree.size}")
            )
            continue
        root_now = tree.root(size)
        if bytes(root_hash) != root_now:
            report.damaged.append(
                Damage(
                    "checkpoint",
                    name,
                    f"records root {bytes(root_hash).hex()}, but the stored envelopes make {root_now.hex()}",
                )
            )
        if public is None or origin is None:
            continue
        try:
            signed = verify_checkpoint(bytes(note), origin, public, origin=origin)
        except (LogProofError, MalformedInputError) as e:
            report.damaged.append(
                Damage("checkpoint", name, f"its signed note does not verify with the registry key: {e.message}")
            )
            continue
        if signed.size != size or signed.root_hash != root_now:
            report.damaged.append(
                Damage(
                    "checkpoint",
                    name,
                    f"its signed note is for size {signed.size} with root {signed.root_hash.hex()}, "
                    f"not the stored envelopes' root {root_now.hex()} at size {size}",
                )
            )
    if latest < 0:
        if tree.size:
            report.damaged.append(Damage("log", "log", f"holds {tree.size} entries but no checkpoint"))
    elif latest < tree.size:
        report.damaged.append(
            Damage(
                "log",
                "log",
                f"entries {latest} to {tree.size - 1} are not covered by any signed checkpoint (latest: {latest})",
            )
        )
    _check_signed_head(conn, saved, public, origin, tree, report)


def _check_signed_head(
    conn: Connection,
    saved: SignedHead | DataDirError | None,
    public: Ed25519PublicKey | None,
    origin: str | None,
    tree: MerkleTree,
    report: FsckReport,
) -> None:
    """Compare the tree head kept outside the database (``signed-head.json``) with the stored log:
    the database must not be behind it, nor differ from it, and the file must not be missing
    from a database that wrote one. ``saved`` is the file as read before the database (or why it
    could not be read)."""
    if isinstance(saved, DataDirError):
        report.damaged.append(Damage("log", SIGNED_HEAD_FILE, saved.message))
        return
    if saved is None:
        if conn.execute("SELECT value FROM meta WHERE key = 'signed_head_file'").fetchone() is not None:
            report.damaged.append(
                Damage(
                    "log", SIGNED_HEAD_FILE, "is missing, but this database wrote one: a rollback cannot be ruled out"
                )
            )
        return
    if public is None or origin is None:
        return
    try:
        signed = verify_checkpoint(saved.checkpoint, origin, public, origin=origin)
    except (LogProofError, MalformedInputError) as e:
        report.damaged.append(Damage("log", SIGNED_HEAD_FILE, f"holds a checkpoint that does not verify: {e.message}"))
        return
    if signed.size > tree.size:
        report.damaged.append(
            Damage(
                "log",
                "log",
                f"the database holds {tree.size} entries, behind the tree head signed at size {signed.size} "
                f"({SIGNED_HEAD_FILE}): rolled back",
            )
        )
    elif tree.root(signed.size) != signed.root_hash:
        report.damaged.append(
            Damage(
                "log",
                "log",
                f"the stored envelopes' root at size {signed.size} is not the one signed in {SIGNED_HEAD_FILE}: forked",
            )
        )
