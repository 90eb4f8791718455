"""The on-disk contract of artifacts, records and report folders, torch-free.

Everything every room must agree on about files lives here, so that the engine (which writes
artifacts and records), the registry client (which pulls and publishes them), the registry and
the offline verifier read one definition (docs/architecture.md, "The artifact contract"):

- the file names an artifact, record, library or report directory holds;
- the home directory (``$KVGRAFT_HOME``, default ``~/.cache/kvgraft``) and the local index under
  it, which maps a tensors digest to the directory that held it (it only points: whatever it
  points at is re-verified when used);
- ``token_digest`` and ``chain_key``, pure hashes over canonical JSON that bind an artifact to its
  tokens and to its parent;
- reading a statement from an envelope *without* verifying it (``statement_unverified``), for
  code that has verified it already, will verify it later, or only displays it;
- the one staged-directory writer (``StagedDirectory``, ``write_staged_directory``) and the one
  single-file atomic writer (``write_atomic``): a reader never sees a half-written directory or
  file, and what was renamed into place survives a crash (files, the staged directory and the
  parent are fsynced).
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import hashlib
import os
import shutil
import tempfile
import unicodedata
from collections.abc import Mapping
from pathlib import Path, PurePosixPath
from types import MappingProxyType, TracebackType

from .canonical import canonical_json, canonical_model, parse_json
from .digests import Sha256Digest, hex_of, sha256_bytes
from .documents import parse_statement
from .dsse import Envelope
from .errors import DirectoryExistsError, DocumentError
from .predicates import KV_ARTIFACT_PREDICATE, DeterminismProfile, ModelRef
from .records import EVALUATION_PREDICATE, EXACTNESS_PREDICATE, PRE_REGISTRATION_PREDICATE, REPLAY_PREDICATE
from .statement import Statement

# --- file names --------------------------------------------------------------------------------

#: An artifact directory holds exactly these two files (and optionally ``MODEL_SIG_FILE``).
KV_FILE = "kv.safetensors"
STATEMENT_FILE = "statement.dsse.json"
#: An OpenSSF model signing signature of the whole directory (``kvgraft oms sign``, or
#: ``model_signing sign key``): any artifact, record or library-entry directory may hold it beside
#: its files; the subjects check passes over it, ``kvgraft-verify oms`` checks it
#: (docs/model-signing.md).
MODEL_SIG_FILE = "model.sig"

#: A record directory holds its envelope, the subjects it names, and optionally its log proof.
RECORD_FILE = "record.dsse.json"
#: Evaluation and replay records: one JSON line per item (docs/records.md).
OUTPUTS_FILE = "outputs.jsonl"
#: A pre-registration: the output hashes its replay must reproduce.
EXPECTED_OUTPUTS_FILE = "expected-outputs.jsonl"
#: An exactness record's logits files live under this folder (``logits/<hex>.f32``).
LOGITS_DIR = "logits"
#: The inclusion proof of the directory's envelope, beside it.
LOG_PROOF_FILE = "log.json"

#: A report folder (``kvgraft report``, ``kvgraft-verify audit``) at its top level; the datasets
#: its evaluations name are ``datasets/<name>.jsonl``.
TRUSTED_KEYS_FILE = "trusted-keys.json"
REGISTRY_KEY_FILE = "registry-key.pub.pem"
CHECKPOINT_FILE = "checkpoint.txt"
SUMMARY_FILE = "summary.json"
REPORT_DATASETS_DIR = "datasets"
#: A report folder's sub-folder per predicate type, and the envelope file each directory there holds.
REPORT_FOLDERS: Mapping[str, tuple[str, str]] = MappingProxyType({
    KV_ARTIFACT_PREDICATE: ("artifacts", STATEMENT_FILE),
    EXACTNESS_PREDICATE: ("exactness", RECORD_FILE),
    EVALUATION_PREDICATE: ("evaluations", RECORD_FILE),
    PRE_REGISTRATION_PREDICATE: ("pre-registrations", RECORD_FILE),
    REPLAY_PREDICATE: ("replays", RECORD_FILE),
})

#: A library directory: its description, its index (one JSON line per deposited problem), the
#: shared prefix artifact, and one child artifact per entry (``entries/<problem hash[:16]>``).
LIBRARY_FILE = "library.json"
LIBRARY_INDEX_FILE = "index.jsonl"
LIBRARY_PREFIX_DIR = "prefix"
LIBRARY_ENTRIES_DIR = "entries"


# --- subject names: the one rule -------------------------------------------------------------------

#: A subject name's limits. A name becomes a path under an artifact, record or report directory
#: on every machine that pulls it: one component is at most 255 bytes (NAME_MAX), the whole name
#: at most 1,024 bytes and 16 components (kvgraft writes at most 2: ``logits/<hex>.f32``), so the
#: path fits PATH_MAX under any sane directory and nothing walks it recursively without bound.
MAX_SUBJECT_NAME_BYTES = 1024
MAX_SUBJECT_PART_BYTES = 255
MAX_SUBJECT_DEPTH = 16
#: The files a directory holds beside its subjects: a subject may not take their place.
RESERVED_SUBJECT_NAMES = frozenset({STATEMENT_FILE, RECORD_FILE, LOG_PROOF_FILE})

_SUBJECT_HINT = "subject names are relative paths inside the directory, such as kv.safetensors or logits/<hex>.f32"


def _check_relative_name(name: str, what: str) -> tuple[str, ...]:
    # The structure and limits of a subject name, shared by the files written beside subjects.
    shown = repr(name[:60] + ("..." if len(name) > 60 else ""))
    try:
        size = len(name.encode("utf-8"))
    except UnicodeEncodeError as e:
        raise DocumentError(f"{what} {shown} is not valid Unicode text", hint=_SUBJECT_HINT) from e
    if size > MAX_SUBJECT_NAME_BYTES:
        raise DocumentError(f"{what} {shown} is {size} bytes long; the limit is {MAX_SUBJECT_NAME_BYTES}", hint=_SUBJECT_HINT)
    if any(ord(c) < 0x20 or c in "\x7f\\" for c in name):
        raise DocumentError(f"{what} {shown} holds a NUL, control character or backslash", hint=_SUBJECT_HINT)
    parts = tuple(name.split("/"))
    if len(parts) > MAX_SUBJECT_DEPTH:
        raise DocumentError(f"{what} {shown} is {len(parts)} levels deep; the limit is {MAX_SUBJECT_DEPTH}", hint=_SUBJECT_HINT)
    if not name or name.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise DocumentError(f"{what} {shown} is not a plain relative path: it must be a relative path without '.', '..' or empty parts", hint=_SUBJECT_HINT)
    for part in parts:
        if len(part.encode("utf-8")) > MAX_SUBJECT_PART_BYTES:
            raise DocumentError(
                f"{what} {shown} has a part of {len(part.encode('utf-8'))} bytes; the limit is {MAX_SUBJECT_PART_BYTES} (a file name)",
                hint=_SUBJECT_HINT,
            )
    return parts


def check_subject_name(name: str) -> tuple[str, ...]:
    """Check one subject name against the rule every writer and reader uses; its ``/`` parts.

    A subject name is a ``/``-separated relative path: no empty, ``.`` or ``..`` part, no
    backslash, NUL or other control character, valid UTF-8, within ``MAX_SUBJECT_NAME_BYTES``,
    ``MAX_SUBJECT_PART_BYTES`` a part and ``MAX_SUBJECT_DEPTH`` parts, and its first part is
    not one of the files held beside the subjects (``RESERVED_SUBJECT_NAMES``). Raises
    ``DocumentError`` naming what is wrong. See ``check_subject_names`` for a statement's set.
    """
    parts = _check_relative_name(name, "subject name")
    if parts[0] in RESERVED_SUBJECT_NAMES:
        raise DocumentError(
            f"subject name {name[:60]!r} takes the place of {parts[0]}, which the directory holds beside its subjects",
            hint=_SUBJECT_HINT,
        )
    return parts


def _clash_key(parts: tuple[str, ...]) -> tuple[str, ...]:
    # Case-insensitive file systems (macOS, Windows) and NFC/NFD normalisation make these one file.
    return tuple(unicodedata.normalize("NFC", p).casefold() for p in parts)


def check_subject_names(names: list[str]) -> None:
    """Check a statement's subject names, each by ``check_subject_name`` and together: no two
    are the same file (compared case-insensitively and after Unicode normalisation, as some file
    systems do), and none is a folder of another (``x`` and ``x/y``). Raises ``DocumentError``."""
    seen: dict[tuple[str, ...], str] = {}
    for name in names:
        key = _clash_key(check_subject_name(name))
        if key in seen:
            raise DocumentError(
                f"subject names {seen[key][:60]!r} and {name[:60]!r} are the same file on some file systems",
                hint="give every subject a distinct name",
            )
        seen[key] = name
    for key, name in seen.items():
        for depth in range(1, len(key)):
            if key[:depth] in seen:
                raise DocumentError(
                    f"subject {seen[key[:depth]][:60]!r} is a file, and subject {name[:60]!r} needs it to be a folder",
                    hint="give every subject a distinct path; no subject may be the folder of another",
                )


# --- the home directory and the local index -------------------------------------------------------


def kvgraft_home() -> Path:
    """``$KVGRAFT_HOME``, default ``~/.cache/kvgraft``: models, keys, checkpoints, the local index."""
    return Path(os.environ.get("KVGRAFT_HOME") or Path.home() / ".cache" / "kvgraft")


def local_index_path(kv_digest: Sha256Digest | str) -> Path:
    """``$KVGRAFT_HOME/index/<hex>``: a text file holding the absolute path of the artifact
    directory whose ``kv.safetensors`` has ``kv_digest``."""
    return kvgraft_home() / "index" / hex_of(Sha256Digest(kv_digest))


def remember_artifact(directory: Path, kv_digest: Sha256Digest | str) -> None:
    """Point the local index at ``directory`` for ``kv_digest`` (replacing an older pointer)."""
    write_atomic(local_index_path(kv_digest), str(directory.resolve()).encode("utf-8"), 0o644)


#: A local index pointer longer than this is not a path (PATH_MAX is 4096 on Linux).
_MAX_POINTER_BYTES = 16 << 10


def artifact_candidates(kv_digest: Sha256Digest | str, near: Path) -> list[Path]:
    """Where an artifact with ``kv_digest`` may live: the local index's pointer, then every
    directory beside ``near``, sorted. Only candidates: the caller checks what it finds."""
    candidates: list[Path] = []
    # The pointer is only a hint: one that cannot be read, is not UTF-8, holds a NUL or is longer
    # than any path is skipped (the siblings are still tried), never an error.
    with contextlib.suppress(OSError, ValueError), local_index_path(kv_digest).open("rb") as f:
        pointer = f.read(_MAX_POINTER_BYTES + 1)
        if len(pointer) <= _MAX_POINTER_BYTES and b"\0" not in pointer:
            candidates.append(Path(pointer.decode("utf-8").strip()))
    with contextlib.suppress(OSError):
        candidates += sorted(p for p in near.parent.iterdir() if p.is_dir())
    return candidates


# --- the hashes that bind an artifact -----------------------------------------------------------


def token_digest(ids: list[int] | tuple[int, ...]) -> Sha256Digest:
    """sha256 of the canonical JSON list of token ids (a predicate's ``tokens.digest``)."""
    return sha256_bytes(canonical_json(list(ids)))


def chain_key(
    parent_key: Sha256Digest | None,
    model: ModelRef,
    tokenizer: Sha256Digest,
    profile: DeterminismProfile,
    ids: list[int] | tuple[int, ...],
) -> Sha256Digest:
    """``sha256(parent_key || model || tokenizer || profile || token ids)``, each part fixed-length
    or canonical.

    The parent key is its 32 raw bytes (32 zero bytes for a root); model and profile enter as the
    32-byte sha256 of their canonical JSON, the tokenizer as its 32 digest bytes, the ids as
    their canonical JSON list.
    """
    h = hashlib.sha256()
    h.update(bytes.fromhex(hex_of(parent_key)) if parent_key else b"\0" * 32)
    h.update(hashlib.sha256(canonical_model(model)).digest())
    h.update(bytes.fromhex(hex_of(tokenizer)))
    h.update(hashlib.sha256(canonical_model(profile)).digest())
    h.update(canonical_json(list(ids)))
    return Sha256Digest("sha256:" + h.hexdigest())


# --- reading an envelope without verifying it ------------------------------------------------------


def decode_base64(text: object, *, what: str) -> bytes:
    """Decode standard or URL-safe base64, padded or not (DSSE allows both); refuse anything else.

    Raises ``DocumentError`` naming ``what`` (the verifier re-raises it as ``MalformedInputError``).
    """
    if not isinstance(text, str):
        raise DocumentError(f"{what} must be a base64 string, got {type(text).__name__}")
    stripped = text.rstrip("=")
    if len(text) - len(stripped) > 2 or len(stripped) % 4 == 1:
        raise DocumentError(f"{what} is not valid base64: wrong length or padding")
    if ("-" in stripped or "_" in stripped) and ("+" in stripped or "/" in stripped):
        raise DocumentError(f"{what} mixes the standard and URL-safe base64 alphabets")
    normal = stripped.replace("-", "+").replace("_", "/")
    try:
        return base64.b64decode(normal + "=" * (-len(normal) % 4), validate=True)
    except (binascii.Error, ValueError) as e:
        raise DocumentError(f"{what} is not valid base64: {e}") from e


def payload_unverified(envelope: bytes | Envelope, *, what: str = "envelope") -> bytes:
    """The payload bytes of a DSSE envelope (its JSON bytes, or parsed), NO signature checked.

    Raises ``DocumentError`` when the bytes are not JSON, not an object with a base64 ``payload``.
    """
    if isinstance(envelope, Envelope):
        return decode_base64(envelope.payload, what=f"{what} payload")
    doc = parse_json(envelope, what=what)
    if not isinstance(doc, dict) or "payload" not in doc:
        raise DocumentError(f"{what} is not a DSSE envelope (a JSON object with a payload)")
    return decode_base64(doc["payload"], what=f"{what} payload")


def statement_unverified(envelope: bytes | Envelope, *, what: str = "envelope") -> Statement:
    """The in-toto statement an envelope carries, parsed WITHOUT checking any signature.

    Only for an envelope whose signature was checked already (stored by the registry after it
    verified it), is checked later by its reader, or was explicitly not to be checked
    (``--insecure-skip-verify``). Never trust what it returns on its own. Raises
    ``DocumentError`` for bad JSON, bad base64 or a payload that is not a known statement.
    """
    return parse_statement(payload_unverified(envelope, what=what), what=f"statement in {what}")


# --- writing: one file, or one directory, atomically and durably -----------------------------------


def fsync_path(path: Path) -> None:
    """fsync a file or a directory by its path (for a directory: so that the names created or
    renamed in it survive a crash)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes, mode: int) -> None:
    """Write ``data`` to ``path`` (file mode ``mode``): a fsynced temp file beside it, renamed into
    place, then the directory fsynced. A reader sees the old file or the new one, never a part."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), mode)
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_path(path.parent)


def _relative(name: str) -> PurePosixPath:
    # File names come from code (the envelope beside the subjects) and from statements' subjects:
    # the subject-name rule's structure and limits for both.
    return PurePosixPath(*_check_relative_name(name, "file name"))


class StagedDirectory:
    """A directory built beside its target and renamed into place only when complete.

    ``StagedDirectory(target)`` refuses an existing ``target`` (``DirectoryExistsError``; with
    ``replace_empty`` an existing *empty* directory is replaced) and makes a temp directory
    ``.<target name>.<tag>-XXXX`` beside it. Write files into ``path`` (``write``, or any other
    way), then ``commit()``: every file under ``path`` is fsynced, then every directory, then the
    temp directory is renamed to ``target`` and the parent fsynced. ``discard()`` (or any failure
    in ``commit``) removes the temp directory. Used as a context manager it commits on a clean
    exit and discards on an exception, so nothing is ever left at ``target`` half-written.
    """

    def __init__(self, target: Path, *, replace_empty: bool = False, tag: str = "tmp") -> None:
        self.target = target
        self._replace_empty = replace_empty
        self._check_target()
        target.parent.mkdir(parents=True, exist_ok=True)
        self.path = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.{tag}-"))
        self._synced: set[Path] = set()

    def _check_target(self) -> None:
        t = self.target
        if not (t.exists() or t.is_symlink()):
            return
        if self._replace_empty and t.is_dir() and not t.is_symlink() and not any(t.iterdir()):
            return
        raise DirectoryExistsError(f"{t} already exists" + (" and is not an empty directory" if self._replace_empty else ""))

    def write(self, name: str, data: bytes) -> Path:
        """Write a new file ``name`` (relative, ``/``-separated) with ``data``, fsynced; its path."""
        path = self.path.joinpath(*_relative(name).parts)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("xb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        self._synced.add(path)
        return path

    def _sync_tree(self) -> None:
        for root, _, files in os.walk(self.path, topdown=False):
            for name in files:
                path = Path(root) / name
                if path not in self._synced and not path.is_symlink():
                    fsync_path(path)
            fsync_path(Path(root))

    def commit(self) -> Path:
        """fsync everything, rename the staged directory to the target, fsync the parent; the target."""
        try:
            self._sync_tree()
            self._check_target()
            if self.target.is_dir() and not self.target.is_symlink():
                self.target.rmdir()  # empty, checked just above (replace_empty)
            os.rename(self.path, self.target)
            fsync_path(self.target.parent)
        except BaseException:
            self.discard()
            raise
        return self.target

    def discard(self) -> None:
        """Remove the staged directory and all it holds (nothing happens at the target)."""
        shutil.rmtree(self.path, ignore_errors=True)

    def __enter__(self) -> StagedDirectory:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if kind is None:
            self.commit()
        else:
            self.discard()


def write_staged_directory(target: Path, files: Mapping[str, bytes], *, replace_empty: bool = False) -> Path:
    """Write ``files`` (relative name -> bytes) as the new directory ``target``, atomically and
    durably (see ``StagedDirectory``); returns ``target``."""
    with StagedDirectory(target, replace_empty=replace_empty) as stage:
        for name, data in files.items():
            stage.write(name, data)
    return target

