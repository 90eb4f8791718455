"""Pull: an artifact (and with ``with_parents`` its parent chain) into new directories, every
blob hashed while it streams, the statement checked to be about exactly those files, the
envelope proved to be in the signed log, and nothing visible until all of it holds."""

from __future__ import annotations

import dataclasses
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvgraft.schemas import (
    KV_FILE,
    STATEMENT_FILE,
    ArtifactDocument,
    KvArtifactStatement,
    SchemaError,
    StagedDirectory,
    Statement,
    statement_unverified,
)
from kvgraft.verifier import (
    BadSignatureError,
    ThresholdNotMetError,
    TrustedKeys,
    UnknownKeyError,
    VerificationError,
    parse_envelope,
    verify_statement_envelope,
    verify_subjects,
)

from .errors import EnvelopeSignatureError, EvidenceError, LocalFilesError
from .evidence import RegistryKey, registry_key, verify_entry_evidence
from .http import RegistryClient, checked_digest
from .progress import progress_bar
from .publish import MAX_CHAIN
from .store import commit, local_write_error, safe_path, stage


def signature_phrase(checked: bool, signers: tuple[str, ...]) -> str:
    """One phrase on a pulled envelope's signature: who signed it, or that it was not checked."""
    if checked:
        return "signature verified: signed by " + ", ".join(signers)
    return "signature NOT checked (no --trusted-keys given)"


@dataclass(frozen=True)
class PullResult:
    """What ``pull`` wrote and proved for one artifact."""

    registry: str
    directory: Path
    artifact_digest: str
    parent: str | None
    log_index: int
    entry_digest: str
    tree_size: int
    root_hash: str
    files: tuple[str, ...]
    size: int
    #: The names of the trusted keys that signed, or () when no trusted keys were given.
    signers: tuple[str, ...]
    signature_checked: bool
    registry_key: RegistryKey
    #: The token positions [start, end) the artifact covers.
    positions: tuple[int, int] = (0, 0)
    #: With ``with_parents``: the parents pulled into sibling directories, nearest first.
    parents: tuple[PullResult, ...] = ()

    @property
    def signature(self) -> str:
        """One phrase on the envelope's signature."""
        return signature_phrase(self.signature_checked, self.signers)

    def to_json(self) -> dict[str, Any]:
        """A JSON object for ``--json`` output."""
        return {
            "registry": self.registry,
            "directory": str(self.directory),
            "artifact_digest": self.artifact_digest,
            "parent": self.parent,
            "positions": list(self.positions),
            "log_index": self.log_index,
            "entry_digest": self.entry_digest,
            "tree_size": self.tree_size,
            "root_hash": self.root_hash,
            "files": list(self.files),
            "size": self.size,
            "signature_checked": self.signature_checked,
            "signers": list(self.signers),
            "registry_key": self.registry_key.to_json(),
            "parents": [p.to_json() for p in self.parents],
            "verified": ["blob_digests", "subjects", "leaf_hash", "inclusion", "checkpoint_signature"]
            + (["envelope_signature"] if self.signature_checked else []),
        }


def pull(
    client: RegistryClient,
    digest: str,
    out: Path,
    *,
    trusted_keys: TrustedKeys | None = None,
    registry_key_file: Path | None = None,
    with_parents: bool = False,
    progress: bool = False,
) -> PullResult:
    """Pull the artifact whose tensors have ``digest`` into the new directory ``out``.

    Everything is written to a staged directory beside ``out`` (``kvgraft.schemas.StagedDirectory``)
    and checked there: every blob's sha256 while it streams, the envelope's signature against
    ``trusted_keys`` (when given; otherwise the result says it was not checked), that the
    statement is about exactly these files, and that the envelope is in the log (inclusion proof
    against a checkpoint signed by the registry key). Only then is it renamed to ``out``; on any
    failure nothing appears at ``out`` and the staged directory is removed. With ``with_parents``
    the parent chain is pulled too, into ``OUT.parent-1`` (the parent), ``OUT.parent-2``, ...
    beside ``out``, where the engine finds them; all of them appear, or none.
    """
    digest = checked_digest(digest, "artifact digest")
    if out.exists() or out.is_symlink():
        raise LocalFilesError(f"{out} already exists", hint="pull into a new directory")
    key = registry_key(client, registry_key_file)
    stages: list[StagedDirectory] = []
    results: list[PullResult] = []
    placed: list[Path] = []
    try:
        current: str | None = digest
        while current is not None:
            if len(results) > MAX_CHAIN:
                raise EvidenceError(f"the parent chain of {digest} is longer than {MAX_CHAIN} (a cycle?)")
            target = out if not results else out.with_name(f"{out.name}.parent-{len(results)}")
            stages.append(stage(target, tag="pull", hint="pull into a new directory"))
            result = _stage(client, current, stages[-1], key, trusted_keys, progress)
            if results:
                _check_link(client.url, results[-1], result)
            results.append(result)
            current = result.parent if with_parents else None
        # Root first, so that a child never appears without its parents.
        for staged in reversed(stages):
            placed.append(commit(staged))
    except BaseException:
        for staged in stages:
            staged.discard()
        for target in placed:
            shutil.rmtree(target, ignore_errors=True)
        raise
    return dataclasses.replace(results[0], parents=tuple(results[1:]))


def _check_link(url: str, child: PullResult, parent: PullResult) -> None:
    # The parent was fetched by the digest the child names, and its statement was checked to be
    # about those tensors; the positions must join too (the engine re-checks chain keys on load).
    if child.parent != parent.artifact_digest or parent.positions[1] != child.positions[0]:
        raise EvidenceError(
            f"{url}: artifact {parent.artifact_digest} (positions {list(parent.positions)}) does not lead to its child "
            f"{child.artifact_digest} (positions {list(child.positions)})",
            hint="the chain on the registry is inconsistent; report it to the registry's operator",
        )


def _claim(client: RegistryClient, digest: str, trusted: TrustedKeys | None) -> ArtifactDocument:
    """The artifact document of the entry the trusted keys signed, when one of them did.

    Anyone may log a statement about any tensors: the first entry logged is only the oldest
    claim. With ``trusted`` keys the first claim the registry says one of them signed is asked
    for (``?signer=``); the envelope's signature is then verified here as for any entry (the
    registry's word on who signed decides nothing). Without, or when no claim names a trusted
    key, the first entry logged (whose signature then fails against ``trusted``).
    """
    doc = client.artifact(digest)
    if trusted is None:
        return doc
    wanted = {str(k.keyid) for k in trusted.keys}
    if wanted & set(doc.entry.keyids):
        return doc
    for other in doc.other_entries:
        signer = next((k for k in other.keyids if k in wanted), None)
        if signer is not None:
            return client.artifact(digest, signer=signer)
    return doc


def logged_statement(envelope: bytes, index: int, url: str, trusted: TrustedKeys | None, *, named: str) -> tuple[Statement, tuple[str, ...]]:
    """The statement of entry ``index``'s logged envelope bytes (never the server's decoded copy),
    its signature verified against ``trusted`` (the names of the keys that signed), or explicitly
    unchecked when no keys are given (no signers). ``named`` says what a signature failure is about."""
    signers: tuple[str, ...] = ()
    try:
        parsed = parse_envelope(envelope, source=f"the envelope of entry {index}")
        if trusted is not None:
            verified, statement = verify_statement_envelope(parsed, trusted)
            signers = tuple(k.name for k in verified.signers)
        else:
            # Explicitly unchecked (no --trusted-keys): the result says so.
            statement = statement_unverified(parsed, what=f"the envelope of entry {index}")
    except (UnknownKeyError, BadSignatureError, ThresholdNotMetError) as e:
        raise EnvelopeSignatureError(f"{named}: {e.message}", hint=e.hint) from e
    except VerificationError as e:
        raise EvidenceError(f"the envelope of entry {index} of {url} is not usable: {e.message}") from e
    except SchemaError as e:
        raise EvidenceError(f"the statement of entry {index} of {url} is not valid: {e}") from e
    return statement, signers


def _stage(
    client: RegistryClient,
    digest: str,
    staged: StagedDirectory,
    key: RegistryKey,
    trusted: TrustedKeys | None,
    progress: bool,
) -> PullResult:
    """Fetch and check one artifact into ``staged.path``; its result names ``staged.target``."""
    url = f"{client.url}/v1/artifacts/{digest}"
    target, tmp = staged.target, staged.path
    doc = _claim(client, digest, trusted)
    entry_digest = doc.entry.digest
    envelope = client.envelope(entry_digest)
    index, head = verify_entry_evidence(client, url, envelope, doc.entry, doc.inclusion_proof, doc.checkpoint, key)

    statement, signers = logged_statement(envelope, index, client.url, trusted, named=f"artifact {digest} (entry {index} of {client.url})")
    if not isinstance(statement, KvArtifactStatement):
        raise EvidenceError(
            f"entry {index} of {client.url} is a {statement.predicate_type} statement, not a KV artifact"
        )
    subjects = {s.name: "sha256:" + s.digest.sha256 for s in statement.subject}
    if subjects.get(KV_FILE) != digest:
        raise EvidenceError(
            f"{client.url} answered for artifact {digest} with entry {index}, whose statement is about "
            f"{KV_FILE} {subjects.get(KV_FILE)}",
            hint="the registry served the wrong artifact; report it to the registry's operator",
        )

    if set(subjects) != {KV_FILE}:
        # The engine loads only kv.safetensors; anything else is refused before a byte is fetched
        # (a lying registry's statement could name any number of files).
        names = sorted(subjects)
        raise EvidenceError(
            f"the statement of entry {index} of {client.url} names {len(names)} subjects "
            f"({', '.join(repr(n[:40]) for n in names[:3])}{', ...' if len(names) > 3 else ''}), not only {KV_FILE}",
            hint="a KV artifact's only subject is kv.safetensors; report it to the registry's operator",
        )
    files = []
    size = 0
    with progress_bar(progress, None, f"pull {target.name}") as bar:
        for name, subject_digest in subjects.items():
            path = safe_path(tmp, name, f"entry {index}")
            path.parent.mkdir(parents=True, exist_ok=True)
            size += client.download_blob(subject_digest, path, progress=bar, space_dir=target.parent)
            files.append(name)
    if STATEMENT_FILE in subjects:
        raise EvidenceError(f"entry {index} names a subject {STATEMENT_FILE}, which would overwrite the envelope")
    try:
        envelope_path = staged.write(STATEMENT_FILE, envelope)
    except OSError as e:
        raise local_write_error(e, tmp / STATEMENT_FILE, target.parent, needed=len(envelope)) from e
    try:
        verify_subjects(statement, tmp, exclude=[envelope_path])
    except VerificationError as e:
        raise EvidenceError(f"the files pulled for {digest} are not the statement's subjects: {e.message}") from e
    p = statement.predicate
    return PullResult(
        registry=client.url,
        directory=target,
        artifact_digest=digest,
        parent=str(p.parent) if p.parent else None,
        log_index=index,
        entry_digest=entry_digest,
        tree_size=head.size,
        root_hash=head.root_hash.hex(),
        files=tuple(sorted(files)),
        size=size,
        signers=signers,
        signature_checked=trusted is not None,
        registry_key=key,
        positions=(p.positions.start, p.positions.end),
    )
