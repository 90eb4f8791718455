"""The data directory: where the database, blobs, registry key and admin handle live.

    DATA/registry.duckdb        metadata, the log's leaves and checkpoints (DuckDB; with
                                --database the same live in PostgreSQL instead, db.py)
    DATA/registry-key.pem       the registry's Ed25519 checkpoint-signing key (0600)
    DATA/registry-key.pub.pem   its public key, for 'kvgraft-verify log --registry-key'
    DATA/blobs/sha256/<hex>     content-addressed blobs
    DATA/blobs/tmp/             uploads in progress (emptied at start)
    DATA/blobs/quarantine/      blobs found damaged, as <hex>.<UTC timestamp> (never served; see blobs.py)
    DATA/admin.json             while a server runs: its URL and admin secret (0600)
    DATA/signed-head.json       the largest tree head this directory's processes signed or served, kept outside the database
                                so that a rolled-back database is refused (see log/signedhead.py)
    DATA/.signed-head.lock      flock'ed while signed-head.json is written (it never moves back)
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from kvgraft.schemas import DocumentError, parse_json
from kvgraft.verifier import (
    KeyFileError,
    generate_private_key,
    keyid_of,
    load_private_key,
    require_ed25519,
    save_private_key,
    save_public_key,
    write_atomic,
)

from .blobconfig import parse_blob_store_url
from .errors import ConfigError, DataDirError, LogRollbackError
from .storage.db import Database

KEY_FILE = "registry-key.pem"
PUBLIC_KEY_FILE = "registry-key.pub.pem"
ADMIN_FILE = "admin.json"
SIGNED_HEAD_FILE = "signed-head.json"
#: ``flock``ed around each write of the signed head, so processes sharing the directory never move it back.
SIGNED_HEAD_LOCK_FILE = ".signed-head.lock"
#: A signed head file is a few hundred bytes; anything much larger is not one.
_MAX_SIGNED_HEAD_BYTES = 64 * 1024

# c2sp.org/signed-note key names: no spaces, '+' or control characters. Kept to a sober subset.
_ORIGIN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/@-]{0,254}", re.ASCII)


@dataclass(frozen=True)
class DataDir:
    """The paths of a registry data directory."""

    root: Path

    @property
    def key_path(self) -> Path:
        """The registry's private key (PEM, 0600)."""
        return self.root / KEY_FILE

    @property
    def public_key_path(self) -> Path:
        """The registry's public key (PEM)."""
        return self.root / PUBLIC_KEY_FILE

    @property
    def blobs(self) -> Path:
        """The blob store's root."""
        return self.root / "blobs"

    @property
    def admin_file(self) -> Path:
        """The running server's admin handle."""
        return self.root / ADMIN_FILE

    @property
    def signed_head_path(self) -> Path:
        """The last tree head the registry signed (JSON, see ``write_signed_head``)."""
        return self.root / SIGNED_HEAD_FILE


def prepare(root: Path) -> DataDir:
    """Create the data directory (0700) if needed and return its paths."""
    try:
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as e:
        raise DataDirError(f"cannot create the data directory {root}: {e.strerror}") from e
    if not root.is_dir():
        raise DataDirError(f"{root} is not a directory")
    return DataDir(root)


def ensure_registry_key(data: DataDir) -> Ed25519PublicKey:
    """Create the registry's signing key on first use; return its public key.

    Refuses a key file that others may read: whoever reads it can forge checkpoints.
    """
    path = data.key_path
    if not path.exists():
        key = generate_private_key("ed25519")
        save_private_key(key, path)
        save_public_key(key.public_key(), data.public_key_path)
        return require_ed25519(key.public_key(), f"the registry key {path}")
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o077:
        raise DataDirError(
            f"the registry key {path} has mode {mode:04o}: other users may read it",
            hint=f"chmod 600 {path}",
        )
    try:
        # Checkpoints are C2SP signed notes, whose keys are Ed25519 only.
        public = require_ed25519(load_private_key(path).public_key(), "it")
    except KeyFileError as e:
        raise DataDirError(f"the registry key {path} cannot be loaded: {e.message}", hint=e.hint) from e
    if not data.public_key_path.exists():
        save_public_key(public, data.public_key_path)
    return public


def check_origin(origin: str) -> str:
    """Return ``origin`` if it can name a log (and its checkpoint key), else raise ``ConfigError``."""
    if not _ORIGIN.fullmatch(origin):
        raise ConfigError(
            f"the log origin {origin!r} is not acceptable",
            hint="use a schema-less URL such as registry.example.com/kvgraft: letters, digits and . _ : / @ -, no spaces or '+'",
        )
    return origin


def resolve_origin(db: Database, configured: str | None, public_key: Ed25519PublicKey) -> str:
    """The log's origin: persisted at first start, never changed afterwards."""
    stored = db.get_meta("origin")
    if stored is not None:
        if configured is not None and configured != stored:
            raise ConfigError(
                f"this registry's log is named {stored!r}; it cannot be renamed to {configured!r}",
                hint=f"drop --origin, or pass --origin {stored}; a new name needs a new data directory",
            )
        return stored
    origin = check_origin(configured if configured is not None else f"kvgraft-registry/{keyid_of(public_key)[:16]}")
    db.set_meta("origin", origin)
    db.set_meta("registry_keyid", keyid_of(public_key))
    return origin


def check_registry_key(db: Database, public_key: Ed25519PublicKey) -> None:
    """Refuse a registry key other than the one the log was started with."""
    stored = db.get_meta("registry_keyid")
    if stored is not None and stored != keyid_of(public_key):
        raise DataDirError(
            f"the registry key {keyid_of(public_key)} is not the key this log's checkpoints are signed with ({stored})",
            hint="restore the original registry-key.pem; a log cannot change its key",
        )


#: The ``meta`` key naming where this log's blobs are: ``DATA_DIRECTORY_STORE`` or an ``s3://`` URL.
BLOB_STORE_META = "blob_store"
DATA_DIRECTORY_STORE = "data-directory"


def blob_store_name(blob_store: str | None) -> str:
    """How ``meta`` names the store of ``RegistrySettings.blob_store``: the data directory, or the normalised s3:// URL."""
    return DATA_DIRECTORY_STORE if blob_store is None else parse_blob_store_url(blob_store).url


def check_blob_store(db: Database, blob_store: str | None, *, moved: bool = False) -> None:
    """Refuse a blob store other than the one this log's blobs are in (``meta``), which the first start records.

    A server started on the wrong store would answer every blob 404 and refuse every publish
    whose blobs are elsewhere; on a shared database, every process must use one store. With
    ``moved`` (the operator copied the blobs there) the new store is recorded instead. An
    endpoint is not part of the name: one bucket may be reached through several.
    """
    stored = db.get_meta(BLOB_STORE_META)
    current = blob_store_name(blob_store)
    if stored == current:
        return
    if stored is not None and not moved:
        raise blob_store_mismatch(stored, current)
    db.set_meta(BLOB_STORE_META, current)


def blob_store_mismatch(stored: str, current: str) -> DataDirError:
    """The refusal of store ``current`` for a log whose blobs are in ``stored`` (both as ``blob_store_name`` gives)."""
    flag = "no --blob-store" if stored == DATA_DIRECTORY_STORE else f"--blob-store {stored[:200]}"
    return DataDirError(
        f"this log's blobs are in {_store_words(stored[:200])}, but this command was given {_store_words(current)}",
        hint=f"pass {flag}; if every blob was copied to the new store, start 'kvgraft serve' once with "
        "--blob-store-moved to record it (then 'kvgraft fsck' checks that each entry's blobs are there)",
    )


def _store_words(name: str) -> str:
    return "the data directory's blobs/" if name == DATA_DIRECTORY_STORE else name


@dataclass(frozen=True)
class AdminHandle:
    """How an admin command reaches the running server."""

    url: str | None
    secret: str
    pid: int


def write_admin_handle(data: DataDir, handle: AdminHandle) -> None:
    """Write ``admin.json`` (0600) for admin commands run beside this server."""
    doc = {"url": handle.url, "secret": handle.secret, "pid": handle.pid}
    write_atomic(data.admin_file, (json.dumps(doc, indent=2) + "\n").encode("utf-8"), 0o600)


def read_admin_handle(data: DataDir) -> AdminHandle | None:
    """The running server's admin handle, or None when no server wrote one."""
    try:
        raw = data.admin_file.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise DataDirError(f"cannot read {data.admin_file}: {e.strerror}", hint="run the admin command as the registry's user") from e
    try:
        doc = parse_json(raw, what=str(data.admin_file))
    except DocumentError as e:
        raise DataDirError(f"{data.admin_file} is not valid JSON: {e}", hint="restart the server to rewrite it") from e
    if not isinstance(doc, dict) or not isinstance(doc.get("secret"), str) or not isinstance(doc.get("pid"), int):
        raise DataDirError(f"{data.admin_file} is not an admin handle", hint="restart the server to rewrite it")
    url = doc.get("url")
    return AdminHandle(url=url if isinstance(url, str) else None, secret=doc["secret"], pid=doc["pid"])


def remove_admin_handle(data: DataDir, secret: str) -> None:
    """Remove ``admin.json`` if it is still this server's (a newer server may have replaced it)."""
    try:
        current = read_admin_handle(data)
    except DataDirError:
        return
    if current is not None and current.secret == secret:
        try:
            os.unlink(data.admin_file)
        except FileNotFoundError:
            pass


# --- the signed tree head, outside the database --------------------------------------------------


@dataclass(frozen=True)
class SignedHead:
    """The last tree head a registry signed, as ``signed-head.json`` holds it.

    File format (JSON object): ``origin`` (the log's name), ``tree_size`` (int >= 0),
    ``root_hash`` (64 lowercase hex digits) and ``checkpoint`` (the signed note text, whose
    signature the registry checks before trusting the other fields).
    """

    origin: str
    tree_size: int
    root_hash: bytes
    checkpoint: bytes


def write_signed_head(data: DataDir, head: SignedHead, *, root_at: Callable[[int], bytes] | None = None) -> bool:
    """Replace ``signed-head.json`` atomically and durably: temp file, fsync, rename, fsync of the directory.

    A crash leaves the old file or the new one, never a mix; once this returns, the new head
    survives a power loss. Raises ``OSError`` as the file system reports it.

    Never moves the file back: under an ``flock`` of ``SIGNED_HEAD_LOCK_FILE``, a file already
    at a larger tree size is kept. Processes sharing the directory (a PostgreSQL deployment)
    write it concurrently: a sequencer that committed a batch, then paused while another took
    the lease and appended, or a follower starting with the head it read a moment ago, would
    otherwise write an older head over a newer one, and a database rolled back to that older
    size would then pass the start-up check. Returns whether the file was written.

    Never accepts a different tree either: a head at the file's size with another root, or
    (given ``root_at``, the root of the caller's tree at a size up to ``head.tree_size``) one
    whose tree does not hold the file's tree as its prefix, raises ``LogRollbackError`` and
    writes nothing. The file is the largest tree any process of this directory signed or
    served; a head that does not extend it is a fork.
    """
    doc = {
        "origin": head.origin,
        "tree_size": head.tree_size,
        "root_hash": head.root_hash.hex(),
        "checkpoint": head.checkpoint.decode("utf-8"),
    }
    fd = os.open(data.root / SIGNED_HEAD_LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        # Held for one read and one small fsynced write, by registry processes only.
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            current = read_signed_head(data)
        except DataDirError:
            current = None  # unreadable: replaced by a good head (the start-up check refuses it otherwise)
        if current is not None:
            if current.tree_size > head.tree_size:
                return False
            if current.tree_size == head.tree_size:
                forked = current.root_hash != head.root_hash
            else:
                forked = root_at is not None and root_at(current.tree_size) != current.root_hash
            if forked:
                raise LogRollbackError(
                    f"this registry already signed or served the tree of size {current.tree_size} with root "
                    f"{current.root_hash.hex()} ({SIGNED_HEAD_FILE}), and the database's tree of size {head.tree_size} "
                    "does not extend it: the database was rolled back or replaced; serving it would fork the log",
                    hint=f"restore the database from a backup taken at tree size {current.tree_size} or later; never "
                    f"delete {SIGNED_HEAD_FILE} to get past this: clients that saw size {current.tree_size} would see a fork",
                )
        # The one atomic writer; its temp files are the ``.signed-head.json.*.tmp`` removed below.
        write_atomic(data.signed_head_path, (json.dumps(doc, indent=2) + "\n").encode("utf-8"), 0o600)
        return True
    finally:
        os.close(fd)  # releases the lock


def remove_stale_head_temps(data: DataDir, *, min_age: float = 0.0) -> None:
    """Delete temp files a crash left behind while writing ``signed-head.json``, those at least
    ``min_age`` seconds old (another process sharing the directory may be writing a fresh one)."""
    now = time.time()
    for leftover in data.root.glob(f".{SIGNED_HEAD_FILE}.*.tmp"):
        with contextlib.suppress(FileNotFoundError):
            if min_age <= 0 or now - leftover.stat().st_mtime >= min_age:
                leftover.unlink()


def read_signed_head(data: DataDir) -> SignedHead | None:
    """The saved signed head, or None when the file does not exist.

    Raises ``DataDirError`` when it exists but cannot be read or is not a signed head file
    (its signature is the caller's to check).
    """
    path = data.signed_head_path
    try:
        with path.open("rb") as f:
            raw = f.read(_MAX_SIGNED_HEAD_BYTES + 1)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise DataDirError(
            f"cannot read {SIGNED_HEAD_FILE}: {e.strerror}", hint="run the registry as the user that owns its data"
        ) from e
    bad = DataDirError(
        f"{SIGNED_HEAD_FILE} in the data directory is not a signed tree head file",
        hint=f"restore {SIGNED_HEAD_FILE} from the backup registry.duckdb came from; the registry does not guess it",
    )
    if len(raw) > _MAX_SIGNED_HEAD_BYTES:
        raise bad
    try:
        doc: Any = parse_json(raw, what=SIGNED_HEAD_FILE)
    except DocumentError as e:
        raise bad from e
    if not isinstance(doc, dict):
        raise bad
    origin, size, root, note = doc.get("origin"), doc.get("tree_size"), doc.get("root_hash"), doc.get("checkpoint")
    if (
        not isinstance(origin, str)
        or isinstance(size, bool)
        or not isinstance(size, int)
        or size < 0
        or not isinstance(root, str)
        or not re.fullmatch(r"[0-9a-f]{64}", root)
        or not isinstance(note, str)
    ):
        raise bad
    return SignedHead(origin=origin, tree_size=size, root_hash=bytes.fromhex(root), checkpoint=note.encode("utf-8"))
