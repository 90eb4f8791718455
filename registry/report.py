"""Client side of audit reports: log proofs for local records, and whole report folders fetched
from a registry (docs/records.md, "Audit").

``write_log_proofs`` fixes one signed checkpoint and writes, beside each published envelope, the
inclusion proof (``log.json``) of its exact bytes at that checkpoint's size. ``fetch_report``
pulls entries back into the layout ``kvgraft-verify audit`` reads (``kvgraft.schemas``'s
``REPORT_FOLDERS``): every blob hashed while it streams, every envelope checked against the
digest the log holds, nothing visible until the folder is complete (a ``StagedDirectory``).
The registry's sizes are bounded as for every client command (the client's ``ClientLimits``),
a full disk is one ``DiskFullError`` with nothing left behind, and the checkpoint is checked
against the one remembered for the log (``CheckpointMemory``).
"""

from __future__ import annotations

import errno
import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from kvgraft.schemas import (
    CHECKPOINT_FILE,
    LOG_PROOF_FILE,
    REGISTRY_KEY_FILE,
    REPORT_FOLDERS,
    dump_wire,
    write_atomic,
)
from kvgraft.verifier import public_key_pem

from .client import (
    LocalFilesError,
    RegistryClient,
    RegistryKey,
    RegistryResponseError,
    commit,
    envelope_file,
    local_write_error,
    safe_path,
    stage,
    statement_of,
)

#: Report sub-folder and envelope file name per predicate type (the artifact contract's).
LAYOUT = REPORT_FOLDERS


def _write(path: Path, data: bytes) -> None:
    write_atomic(path, data, 0o644)


def log_index_of(client: RegistryClient, envelope: bytes) -> int:
    """The log index of the entry whose envelope is exactly ``envelope``."""
    digest = "sha256:" + hashlib.sha256(envelope).hexdigest()
    return client.entry(digest).entry.log_index


@dataclass(frozen=True)
class Proven:
    """Where each directory's envelope sits in the log, at one checkpoint."""

    tree_size: int
    indexes: dict[Path, int]


def write_log_proofs(client: RegistryClient, key: RegistryKey, directories: Iterable[Path], checkpoint_out: Path) -> Proven:
    """Write ``log.json`` (inclusion at one signed checkpoint) into each directory, and the
    checkpoint itself to ``checkpoint_out``; the checkpoint's signature is checked first.

    ``log.json`` is the registry's ``InclusionProof`` document (``log_index``, ``tree_size``,
    ``hashes``), as ``kvgraft-verify log --inclusion`` reads it."""
    head, note = client.signed_head(key)
    indexes: dict[Path, int] = {}
    for directory in directories:
        envelope = envelope_file(directory).read_bytes()
        index = log_index_of(client, envelope)
        if index >= head.size:
            raise RegistryResponseError(f"{client.url}: entry {index} is past the checkpoint's size {head.size}")
        proof = client.inclusion_proof(index, tree_size=head.size)
        _write(directory / LOG_PROOF_FILE, json.dumps(dump_wire(proof), indent=2).encode() + b"\n")
        indexes[directory] = index
    checkpoint_out.parent.mkdir(parents=True, exist_ok=True)
    _write(checkpoint_out, note)
    return Proven(head.size, indexes)


def fetch_report(client: RegistryClient, key: RegistryKey, refs: Iterable[str], out: Path) -> dict[str, list[str]]:
    """Pull the entries ``refs`` (log indexes or ``sha256:`` envelope digests) with their blobs
    into a new report folder ``out``, with log proofs at one checkpoint and the registry key.

    Returns the report's relative directories per sub-folder. ``out`` appears only when complete.
    """
    staged = stage(out, tag="tmp", hint="fetch a report into a new directory")
    tmp = staged.path
    made: dict[str, list[str]] = {}
    ref = ""
    try:
        dirs = []
        fetched: set[str] = set()
        for ref in refs:
            envelope = client.envelope(ref)
            digest = "sha256:" + hashlib.sha256(envelope).hexdigest()
            if client.entry(digest).entry.digest != digest:
                raise RegistryResponseError(f"{client.url}: entry {ref} served an envelope whose digest is {digest}")
            if digest in fetched:
                continue  # the same entry asked for twice (by index and by digest, or repeated)
            fetched.add(digest)
            try:
                statement = statement_of(envelope, f"entry {ref}")
            except LocalFilesError as e:
                # Logged before its registry checked subject names by the one rule, or not a statement.
                raise LocalFilesError(
                    e.message, hint="this entry cannot be written into a report folder: name the others with --entry"
                ) from e
            if statement.predicate_type not in LAYOUT:
                continue  # a record type audits do not cover
            folder, file_name = LAYOUT[statement.predicate_type]
            hex_digest = digest.removeprefix("sha256:")
            directory = tmp / folder / hex_digest[:16]
            if directory.exists():
                directory = tmp / folder / hex_digest  # two entries whose digests share 16 hex digits
            directory.mkdir(parents=True)
            _write(directory / file_name, envelope)
            for s in statement.subject:
                dest = safe_path(directory, s.name, f"entry {ref}")
                dest.parent.mkdir(parents=True, exist_ok=True)
                client.download_blob("sha256:" + s.digest.sha256, dest, space_dir=out.parent)
            dirs.append(directory)
            made.setdefault(folder, []).append(str(directory.relative_to(tmp)))
        write_log_proofs(client, key, dirs, tmp / CHECKPOINT_FILE)
        # The key the checkpoint was just verified with (pinned, or trusted on first use).
        _write(tmp / REGISTRY_KEY_FILE, public_key_pem(key.public_key))
    except OSError as e:
        staged.discard()
        if e.errno in (errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
            # Two files of the report want one path: what the entries name clashed, not the disk.
            where = Path(e.filename).relative_to(tmp) if e.filename and Path(e.filename).is_relative_to(tmp) else e.filename
            raise LocalFilesError(
                f"entry {ref} clashes with what the report already holds: {where} ({e.strerror}); nothing was written to {out}",
                hint="the entries name files at the same path; fetch them into separate reports (--entry)",
            ) from e
        raise local_write_error(e, out, out.parent) from e
    except BaseException:
        staged.discard()
        raise
    commit(staged)
    return made
