"""Client side of audit reports: log proofs for local records, and whole report folders fetched
from a registry (docs/records.md, "Audit").

``write_log_proofs`` fixes one signed checkpoint and writes, beside each published envelope, the
inclusion proof (``log.json``) of its exact bytes at that checkpoint's size. ``fetch_report``
pulls entries back into the layout ``kvgraft-verify audit`` reads: every blob hashed while it
streams, every envelope checked against the digest the log holds, nothing visible until the
folder is complete. The registry's sizes are bounded as for every client command (the
client's ``ClientLimits``), a full disk is one ``DiskFullError`` with nothing left behind, and
the checkpoint is checked against the one remembered for the log (``CheckpointMemory``).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from kvgraft.schemas import (
    EVALUATION_PREDICATE,
    EXACTNESS_PREDICATE,
    KV_ARTIFACT_PREDICATE,
    PRE_REGISTRATION_PREDICATE,
    REPLAY_PREDICATE,
)
from kvgraft.verifier import write_atomic

from .client import (
    RECORD_FILE,
    STATEMENT_FILE,
    LocalFilesError,
    RegistryClient,
    RegistryKey,
    RegistryResponseError,
    _safe_path,
    _statement_of,
    local_write_error,
    public_key_pem,
)

LOG_PROOF_FILE = "log.json"
CHECKPOINT_FILE = "checkpoint.txt"
REGISTRY_KEY_FILE = "registry-key.pub.pem"

#: Report sub-folder and envelope file name per predicate type.
LAYOUT = {
    KV_ARTIFACT_PREDICATE: ("artifacts", STATEMENT_FILE),
    EXACTNESS_PREDICATE: ("exactness", RECORD_FILE),
    EVALUATION_PREDICATE: ("evaluations", RECORD_FILE),
    PRE_REGISTRATION_PREDICATE: ("pre-registrations", RECORD_FILE),
    REPLAY_PREDICATE: ("replays", RECORD_FILE),
}


def _envelope_file(directory: Path) -> Path:
    for name in (STATEMENT_FILE, RECORD_FILE):
        if (directory / name).is_file():
            return directory / name
    raise LocalFilesError(f"{directory} holds neither {STATEMENT_FILE} nor {RECORD_FILE}")


def _write(path: Path, data: bytes) -> None:
    write_atomic(path, data, 0o644)


def log_index_of(client: RegistryClient, envelope: bytes) -> int:
    """The log index of the entry whose envelope is exactly ``envelope``."""
    digest = "sha256:" + hashlib.sha256(envelope).hexdigest()
    doc = client.entry(digest)
    entry = doc.get("entry")
    index = entry.get("log_index") if isinstance(entry, dict) else None
    if not isinstance(index, int):
        raise RegistryResponseError(f"{client.url}: the entry {digest} came back without a log index")
    return index


@dataclass(frozen=True)
class Proven:
    """Where each directory's envelope sits in the log, at one checkpoint."""

    tree_size: int
    indexes: dict[Path, int]


def write_log_proofs(client: RegistryClient, key: RegistryKey, directories: Iterable[Path], checkpoint_out: Path) -> Proven:
    """Write ``log.json`` (inclusion at one signed checkpoint) into each directory, and the
    checkpoint itself to ``checkpoint_out``; the checkpoint's signature is checked first."""
    head, note = client.signed_head(key)
    indexes: dict[Path, int] = {}
    for directory in directories:
        envelope = _envelope_file(directory).read_bytes()
        index = log_index_of(client, envelope)
        if index >= head.size:
            raise RegistryResponseError(f"{client.url}: entry {index} is past the checkpoint's size {head.size}")
        proof = client.inclusion_proof(index, tree_size=head.size)
        _write(directory / LOG_PROOF_FILE, json.dumps(proof, indent=2).encode() + b"\n")
        indexes[directory] = index
    checkpoint_out.parent.mkdir(parents=True, exist_ok=True)
    _write(checkpoint_out, note)
    return Proven(head.size, indexes)


def fetch_report(client: RegistryClient, key: RegistryKey, refs: Iterable[str], out: Path) -> dict[str, list[str]]:
    """Pull the entries ``refs`` (log indexes or ``sha256:`` envelope digests) with their blobs
    into a new report folder ``out``, with log proofs at one checkpoint and the registry key.

    Returns the report's relative directories per sub-folder. ``out`` appears only when complete.
    """
    if out.exists():
        raise LocalFilesError(f"{out} already exists", hint="fetch a report into a new directory")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-"))
    except OSError as e:
        raise local_write_error(e, out, out.parent) from e
    made: dict[str, list[str]] = {}
    try:
        dirs = []
        for ref in refs:
            envelope = client.envelope(ref)
            digest = "sha256:" + hashlib.sha256(envelope).hexdigest()
            stored = client.entry(digest).get("entry", {})
            if not isinstance(stored, dict) or stored.get("digest", digest) != digest:
                raise RegistryResponseError(f"{client.url}: entry {ref} served an envelope whose digest is {digest}")
            statement = _statement_of(envelope, f"entry {ref}")
            if statement.predicate_type not in LAYOUT:
                continue  # a record type audits do not cover
            folder, file_name = LAYOUT[statement.predicate_type]
            directory = tmp / folder / digest.removeprefix("sha256:")[:16]
            directory.mkdir(parents=True)
            _write(directory / file_name, envelope)
            for s in statement.subject:
                dest = _safe_path(directory, s.name, f"entry {ref}")
                dest.parent.mkdir(parents=True, exist_ok=True)
                client.download_blob("sha256:" + s.digest.sha256, dest, space_dir=out.parent)
            dirs.append(directory)
            made.setdefault(folder, []).append(str(directory.relative_to(tmp)))
        write_log_proofs(client, key, dirs, tmp / CHECKPOINT_FILE)
        # The key the checkpoint was just verified with (pinned, or trusted on first use).
        _write(tmp / REGISTRY_KEY_FILE, public_key_pem(key.public_key))
        os.replace(tmp, out)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise local_write_error(e, out, out.parent) from e
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return made
