"""Publish: an artifact or record directory's missing blobs, then its envelope, with the
registry's answer verified (leaf hash, inclusion proof, signed checkpoint)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import LocalFilesError, ParentNotPublishedError, RegistryNotFoundError, RegistryResponseError
from .evidence import RegistryKey, registry_key, verify_entry_evidence
from .http import CHUNK, RegistryClient, sha256_of
from .progress import Progress, progress_bar
from .store import LocalEntry, file_digest, find_local_artifact, read_local

#: No real chain is this deep; a cycle cannot make publish or pull recurse forever.
MAX_CHAIN = 1_000


@dataclass(frozen=True)
class PublishResult:
    """What ``publish`` did and proved."""

    registry: str
    directory: Path
    kind: str
    predicate_type: str
    artifact_digest: str | None
    log_index: int
    entry_digest: str
    tree_size: int
    root_hash: str
    #: False when these exact envelope bytes were already logged (the same entry came back).
    created: bool
    uploaded: tuple[str, ...]
    uploaded_bytes: int
    #: Blobs the registry already held (not sent again).
    skipped: tuple[str, ...]
    registry_key: RegistryKey
    #: Parents published first because the registry lacked them (nearest last).
    parents: tuple[PublishResult, ...] = ()
    #: A parent whose tensors are on the registry but no entry describes them (not an error).
    notes: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        """A JSON object for ``--json`` output."""
        return {
            "registry": self.registry,
            "directory": str(self.directory),
            "kind": self.kind,
            "predicate_type": self.predicate_type,
            "artifact_digest": self.artifact_digest,
            "log_index": self.log_index,
            "entry_digest": self.entry_digest,
            "tree_size": self.tree_size,
            "root_hash": self.root_hash,
            "created": self.created,
            "blobs": {
                "uploaded": list(self.uploaded),
                "uploaded_bytes": self.uploaded_bytes,
                "skipped": list(self.skipped),
            },
            "registry_key": self.registry_key.to_json(),
            "parents": [p.to_json() for p in self.parents],
            "notes": list(self.notes),
            "verified": ["leaf_hash", "inclusion", "checkpoint_signature"],
        }


def publish(
    client: RegistryClient,
    directory: Path,
    *,
    registry_key_file: Path | None = None,
    publish_parents: bool = True,
    progress: bool = False,
) -> PublishResult:
    """Publish an artifact or record directory: the blobs the registry lacks, then the envelope.

    Each blob is first asked for (``HEAD``); only the missing ones are sent, streamed, so a
    publish that broke off resumes where it stopped. A child artifact needs its parent's
    tensors on the registry: a parent with no entry there that is found locally (the local
    index or a sibling directory) is published first, unless ``publish_parents`` is False;
    otherwise ``ParentNotPublishedError``. The answer is verified: the entry's leaf is
    SHA-256(0x00 || the envelope bytes), its inclusion proof leads to the returned checkpoint,
    and that checkpoint is signed by the registry key (``registry_key_file``, else fetched
    from the registry and reported as trust on first use).
    """
    local = read_local(directory)  # local mistakes fail before anything is asked of the registry
    key = registry_key(client, registry_key_file)
    return _publish(client, local, key, publish_parents=publish_parents, progress=progress, depth=0)


def _publish(
    client: RegistryClient, local: LocalEntry, key: RegistryKey, *, publish_parents: bool, progress: bool, depth: int
) -> PublishResult:
    directory = local.directory
    if depth > MAX_CHAIN:
        raise LocalFilesError(f"the parent chain of {directory} is longer than {MAX_CHAIN} (a cycle?)")
    parents: list[PublishResult] = []
    notes: list[str] = []
    if local.parent is not None:
        parent_result, note = _ensure_parent(
            client, local, key, publish_parents=publish_parents, progress=progress, depth=depth
        )
        if parent_result is not None:
            parents += [*parent_result.parents, parent_result]
        if note:
            notes.append(note)

    # One path per digest: two subjects with the same bytes are one blob.
    wanted = dict((d, p) for _, d, p in reversed(local.subjects))
    missing = [(d, p) for d, p in wanted.items() if client.blob_size(d) is None]
    skipped = tuple(d for d in wanted if d not in dict(missing))
    # The registry checks what it is sent, but not what it already holds: a local copy of those is
    # checked here, before anything is sent, so a corrupt copy is never published as if it were good.
    for d in skipped:
        _check_local_copy(directory, d, wanted[d], client.url)
    sizes = []
    for d, p in missing:
        try:
            sizes.append(p.stat().st_size)
        except OSError as e:
            raise LocalFilesError(
                f"subject {p.relative_to(directory)} ({d}) is missing from {directory} and not on {client.url}",
                hint="publish from the directory that holds every file the statement names",
            ) from e
    uploaded_bytes = 0
    with progress_bar(progress, sum(sizes), f"publish {directory.name}") as bar:
        for (d, p), size in zip(missing, sizes, strict=True):
            _upload_file(client, d, p, size, bar)
            uploaded_bytes += size

    doc, created = client.post_entry(local.envelope)
    index, head = verify_entry_evidence(
        client, client.url + "/v1/entries", local.envelope, doc.entry, doc.inclusion_proof, doc.checkpoint, key
    )
    return PublishResult(
        registry=client.url,
        directory=directory,
        kind=local.kind,
        predicate_type=local.statement.predicate_type,
        artifact_digest=local.artifact_digest,
        log_index=index,
        entry_digest=sha256_of(local.envelope),
        tree_size=head.size,
        root_hash=head.root_hash.hex(),
        created=created,
        uploaded=tuple(d for d, _ in missing),
        uploaded_bytes=uploaded_bytes,
        skipped=skipped,
        registry_key=key,
        parents=tuple(parents),
        notes=tuple(notes),
    )


def _check_local_copy(directory: Path, digest: str, path: Path, url: str) -> None:
    """Refuse a local subject file that does not hash to the digest its signed statement names
    (``LocalFilesError``); a file that is absent is fine, since the registry holds the blob."""
    try:
        got = file_digest(path)
    except FileNotFoundError:
        return
    except OSError as e:
        raise LocalFilesError(f"cannot read {path}: {e.strerror}") from e
    if got != digest:
        raise LocalFilesError(
            f"your local copy is corrupt: {path.relative_to(directory)} in {directory} hashes to {got}, but the "
            f"signed statement names {digest} (which {url} already holds); nothing was published",
            hint=f"restore the file from a good copy (an artifact: kvgraft pull ITS_DIGEST --registry {url} --out NEW_DIR), "
            "or capture or sign it again",
        )


def _upload_file(client: RegistryClient, digest: str, path: Path, size: int, bar: Progress) -> None:
    h = hashlib.sha256()

    def chunks() -> Iterator[bytes]:
        with path.open("rb") as f:
            while chunk := f.read(CHUNK):
                h.update(chunk)
                bar.update(len(chunk))
                yield chunk

    try:
        client.put_blob(digest, chunks(), size)
    except RegistryResponseError as e:
        got = "sha256:" + h.hexdigest()
        if e.status == 400 and got != digest:
            raise LocalFilesError(
                f"{path} hashes to {got}, but the statement names it as {digest}; the registry kept nothing",
                hint="the file was altered after signing: capture or sign it again",
            ) from e
        raise
    except OSError as e:
        raise LocalFilesError(f"cannot read {path}: {e.strerror}") from e


def _ensure_parent(
    client: RegistryClient, local: LocalEntry, key: RegistryKey, *, publish_parents: bool, progress: bool, depth: int
) -> tuple[PublishResult | None, str | None]:
    parent = local.parent
    if parent is None:
        return None, None
    try:
        client.artifact(parent)
        return None, None
    except RegistryNotFoundError:
        pass
    found = find_local_artifact(parent, local.directory)
    if found is not None and publish_parents:
        return _publish(client, read_local(found), key, publish_parents=True, progress=progress, depth=depth + 1), None
    if client.blob_size(parent) is not None:
        # The registry accepts a child whose parent tensors it holds, even without their entry.
        return None, f"the parent tensors {parent} are on the registry, but no entry describes them"
    where = f"; it is at {found}" if found is not None else " and was not found on this machine"
    raise ParentNotPublishedError(
        f"the parent artifact {parent} of {local.directory} is not on {client.url}{where}",
        hint=f"publish the parent first: kvgraft publish --registry {client.url} "
        + (str(found) if found is not None else "PARENT_DIR"),
    )
