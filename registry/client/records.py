"""Pull one logged record (any statement but a KV artifact's) with its subject files into a new
directory: the envelope checked against the entry the log holds and proved to be in the signed
log, its signature checked against trusted keys when given, every subject blob hashed while it
streams, and nothing visible until all of it holds (a ``StagedDirectory``).

The directory holds the envelope (``envelope_name(statement)``, ``record.dsse.json`` unless said
otherwise) and the statement's subjects under their own names.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvgraft.schemas import RECORD_FILE, KvArtifactStatement, Statement
from kvgraft.verifier import TrustedKeys, VerificationError, verify_subjects

from .errors import EvidenceError, LocalFilesError
from .evidence import RegistryKey, registry_key, verify_entry_evidence
from .http import RegistryClient
from .pull import logged_statement, signature_phrase
from .store import commit, local_write_error, safe_path, stage


@dataclass(frozen=True)
class RecordPullResult:
    """What ``pull_record`` wrote and proved."""

    registry: str
    directory: Path
    envelope: Path
    predicate_type: str
    log_index: int
    entry_digest: str
    tree_size: int
    files: tuple[str, ...]
    #: The names of the trusted keys that signed, or () when no trusted keys were given.
    signers: tuple[str, ...]
    signature_checked: bool
    registry_key: RegistryKey

    @property
    def signature(self) -> str:
        """One phrase on the envelope's signature."""
        return signature_phrase(self.signature_checked, self.signers)

    def to_json(self) -> dict[str, Any]:
        """A JSON object for ``--json`` output."""
        return {"registry": self.registry, "directory": str(self.directory), "envelope": str(self.envelope),
                "predicate_type": self.predicate_type, "log_index": self.log_index, "entry_digest": self.entry_digest,
                "tree_size": self.tree_size, "files": list(self.files), "signature_checked": self.signature_checked,
                "signers": list(self.signers), "registry_key": self.registry_key.to_json()}


def pull_record(
    client: RegistryClient,
    ref: str,
    out: Path,
    *,
    statement_type: type[Statement],
    trusted_keys: TrustedKeys | None = None,
    registry_key_file: Path | None = None,
    envelope_name: Callable[[Statement], str] = lambda _: RECORD_FILE,
) -> RecordPullResult:
    """Pull entry ``ref`` (a log index or an ``sha256:`` envelope digest), which must hold a
    ``statement_type`` statement, into the new directory ``out`` (module docstring)."""
    if statement_type is KvArtifactStatement:
        raise LocalFilesError("a KV artifact is pulled by its tensors' digest", hint="use kvgraft pull")
    key = registry_key(client, registry_key_file)
    staged = stage(out, tag="pull", hint="pull into a new directory")
    try:
        envelope = client.envelope(ref)
        digest = "sha256:" + hashlib.sha256(envelope).hexdigest()
        doc = client.entry(digest)
        index, head = verify_entry_evidence(client, f"{client.url}/v1/entries/{ref}", envelope, doc.entry,
                                            doc.inclusion_proof, doc.checkpoint, key)
        statement, signers = logged_statement(envelope, index, client.url, trusted_keys, named=f"entry {index} of {client.url}")
        if not isinstance(statement, statement_type):
            raise EvidenceError(f"entry {index} of {client.url} is a {statement.predicate_type} statement, "
                                f"not a {statement_type.model_fields['predicate_type'].default} one",
                                hint="name the entry of the record you want (kvgraft records list, or the registry's page)")
        name = envelope_name(statement)
        names = [s.name for s in statement.subject]
        if name in names:
            raise EvidenceError(f"entry {index} names a subject {name}, which would overwrite its envelope")
        for s in statement.subject:
            path = safe_path(staged.path, s.name, f"entry {index}")
            path.parent.mkdir(parents=True, exist_ok=True)
            client.download_blob("sha256:" + s.digest.sha256, path, space_dir=out.parent)
        try:
            envelope_path = staged.write(name, envelope)
        except OSError as e:
            raise local_write_error(e, staged.path / name, out.parent, needed=len(envelope)) from e
        try:
            verify_subjects(statement, staged.path, exclude=[envelope_path])
        except VerificationError as e:
            raise EvidenceError(f"the files pulled for entry {index} are not its statement's subjects: {e.message}") from e
        directory = commit(staged)
    except BaseException:
        staged.discard()
        raise
    return RecordPullResult(registry=client.url, directory=directory, envelope=directory / name,
                            predicate_type=statement.predicate_type, log_index=index, entry_digest=digest,
                            tree_size=head.size, files=tuple(names), signers=signers,
                            signature_checked=trusted_keys is not None, registry_key=key)
