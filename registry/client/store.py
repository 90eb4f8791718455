"""The client's local store: artifact and record directories read for publishing, the local
artifact index, staged directories for what is pulled, and local write failures in one line.

The file names, ``$KVGRAFT_HOME``, the local index and the staged-directory writer are the
torch-free artifact contract of ``kvgraft.schemas`` (docs/architecture.md, "The artifact
contract"): the client reads and writes exactly what the engine does, without importing it.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import shutil
from dataclasses import dataclass
from pathlib import Path

from kvgraft.schemas import (
    KV_FILE,
    RECORD_FILE,
    STATEMENT_FILE,
    KvArtifactStatement,
    SchemaError,
    StagedDirectory,
    Statement,
    artifact_candidates,
    check_subject_name,
    statement_unverified,
)

from .errors import DiskFullError, LocalFilesError

#: The registry's default envelope limit is 16 MiB; refuse to read a local "envelope" far past it.
MAX_ENVELOPE_BYTES = 64 << 20


def safe_path(root: Path, name: str, what: str) -> Path:
    """``root / name`` for a subject name, by the one subject-name rule (``check_subject_name``).

    ``what`` names the statement for the message. Raises ``LocalFilesError`` for a name the rule
    refuses (a statement parsed by ``kvgraft.schemas`` was checked already; this guards paths).
    """
    try:
        return root.joinpath(*check_subject_name(name))
    except SchemaError as e:
        raise LocalFilesError(f"{what}: {e.message}", hint=e.hint) from e


def free_bytes(directory: Path) -> int | None:
    """The free space of ``directory``'s filesystem in bytes, or None when it cannot be known."""
    try:
        return shutil.disk_usage(directory).free
    except OSError:
        return None


def local_write_error(
    e: OSError, path: Path, directory: Path | None = None, *, needed: int | None = None
) -> LocalFilesError:
    """A one-line error for a failed local write: ``DiskFullError`` (naming ``directory``, the
    space needed and the space free) for ENOSPC/EDQUOT, else ``LocalFilesError``."""
    directory = directory or path.parent
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        free = free_bytes(path.parent if path.parent.exists() else directory)
        need = f"{needed} bytes are needed, " if needed is not None else ""
        return DiskFullError(
            f"no space left on the device of {directory} while writing {path.name}: {need}"
            f"{free if free is not None else 'an unknown number of'} bytes are free; nothing was kept"
        )
    if e.errno in (errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
        # A clash of names, not a disk that refuses: say which path is taken.
        at = e.filename or path
        return LocalFilesError(
            f"cannot write {path}: {at} clashes with a file or folder already there ({e.strerror})",
            hint="two files want the same path; remove what is there or choose another directory",
        )
    return LocalFilesError(f"cannot write {path}: {e.strerror or e}", hint="check that the directory is writable")


def stage(target: Path, *, tag: str, hint: str) -> StagedDirectory:
    """A ``StagedDirectory`` for the new directory ``target`` (``.<name>.<tag>-XXXX`` beside it),
    with an existing target (said with ``hint``) or a failed write as ``LocalFilesError`` /
    ``DiskFullError``."""
    if target.exists() or target.is_symlink():
        raise LocalFilesError(f"{target} already exists", hint=hint)
    try:
        return StagedDirectory(target, tag=tag)
    except OSError as e:
        raise local_write_error(e, target, target.parent) from e


def commit(staged: StagedDirectory) -> Path:
    """Rename a complete staged directory into place (``StagedDirectory.commit``: everything
    fsynced first); on failure the staged directory is removed and the error is one line."""
    try:
        return staged.commit()
    except OSError as e:
        raise local_write_error(e, staged.target, staged.target.parent) from e
    except SchemaError as e:  # the target appeared meanwhile
        raise LocalFilesError(e.message, hint="write into a new directory") from e


def statement_of(envelope: bytes, what: str) -> Statement:
    """The statement in ``envelope`` (bytes of a ``.dsse.json`` file), NOT verified: the
    registry verifies what is published, and a pull verifies what it keeps."""
    try:
        return statement_unverified(envelope, what=what)
    except SchemaError as e:
        raise LocalFilesError(e.message, hint="pass the .dsse.json file as the signer wrote it") from e


def file_digest(path: Path) -> str:
    """``sha256:<hex>`` of the file at ``path``."""
    with path.open("rb") as f:
        return "sha256:" + hashlib.file_digest(f, "sha256").hexdigest()


# --- reading a local directory ---------------------------------------------------------------------


@dataclass(frozen=True)
class LocalEntry:
    """An artifact or record directory, read for publishing (the statement is not verified here:
    the registry verifies it against the keys the token is bound to)."""

    directory: Path
    envelope_path: Path
    envelope: bytes
    statement: Statement
    #: (subject name, sha256:hex, local path)
    subjects: tuple[tuple[str, str, Path], ...]

    @property
    def kind(self) -> str:
        """``artifact`` or ``record``."""
        return "artifact" if self.envelope_path.name == STATEMENT_FILE else "record"

    @property
    def artifact_digest(self) -> str | None:
        """The tensors' digest of an artifact."""
        return next((d for n, d, _ in self.subjects if n == KV_FILE), None) if self.kind == "artifact" else None

    @property
    def parent(self) -> str | None:
        """The parent's tensors digest of a child artifact."""
        s = self.statement
        return str(s.predicate.parent) if isinstance(s, KvArtifactStatement) and s.predicate.parent else None


def envelope_file(directory: Path) -> Path:
    """The envelope of an artifact (``statement.dsse.json``) or record (``record.dsse.json``) directory."""
    for name in (STATEMENT_FILE, RECORD_FILE):
        if (directory / name).is_file():
            return directory / name
    raise LocalFilesError(f"{directory} holds neither {STATEMENT_FILE} nor {RECORD_FILE}")


def read_local(directory: Path) -> LocalEntry:
    """Read an artifact directory (``statement.dsse.json``) or a record directory (``record.dsse.json``)."""
    if not directory.is_dir():
        raise LocalFilesError(f"{directory} is not a directory")
    path = envelope_file(directory)
    try:
        if path.stat().st_size > MAX_ENVELOPE_BYTES:
            raise LocalFilesError(f"{path} is larger than {MAX_ENVELOPE_BYTES} bytes; it is not an envelope")
        envelope = path.read_bytes()
    except OSError as e:
        raise LocalFilesError(f"cannot read {path}: {e.strerror}") from e
    statement = statement_of(envelope, str(path))
    is_artifact = path.name == STATEMENT_FILE
    if is_artifact and not isinstance(statement, KvArtifactStatement):
        raise LocalFilesError(f"{path} holds a {statement.predicate_type} statement, not a KV artifact")
    subjects = tuple(
        (s.name, "sha256:" + s.digest.sha256, safe_path(directory, s.name, str(path))) for s in statement.subject
    )
    if is_artifact and KV_FILE not in {n for n, _, _ in subjects}:
        raise LocalFilesError(f"{path} names no {KV_FILE} subject")
    return LocalEntry(directory, path, envelope, statement, subjects)


def find_local_artifact(digest: str, near: Path) -> Path | None:
    """An artifact directory whose tensors have ``digest``: the local index, or a sibling of ``near``.

    The same places the engine's ``find_artifact`` looks (``kvgraft.schemas.artifact_candidates``).
    A candidate counts only when its statement names these tensors and its kv.safetensors hashes
    to them.
    """
    for c in artifact_candidates(digest, near.resolve()):
        with contextlib.suppress(LocalFilesError, OSError):
            local = read_local(c)
            if local.kind == "artifact" and local.artifact_digest == digest and file_digest(c / KV_FILE) == digest:
                return c
    return None
