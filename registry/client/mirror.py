"""Mirror: copy every entry of one registry that another lacks, with its blobs, in log order,
then prove from signed checkpoints that the target's log extends the source's."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvgraft.schemas import EntryDocument, EntryMeta
from kvgraft.verifier import hash_leaf

from .errors import (
    BlobDigestError,
    EvidenceError,
    MirrorDivergedError,
    RegistryAuthError,
    RegistryClientError,
    RegistryResponseError,
    malformed,
)
from .evidence import RegistryKey, prove_consistency, registry_key
from .http import RegistryClient, sha256_of
from .progress import progress_bar
from .transport import parse_wire


@dataclass(frozen=True)
class MirrorResult:
    """What ``mirror`` copied, and the proof that the target's log extends the source's."""

    source: str
    target: str
    #: The target's size before copying: entries below it were already there.
    start_size: int
    #: N: the source's size when the mirror began; entries [start_size, N) were copied.
    copied_size: int
    copied_entries: int
    blobs_copied: tuple[str, ...]
    blobs_skipped: int
    bytes_copied: int
    #: The source's signed root at N, and the target's at N (equal), and at its current size.
    source_root: str
    target_root_at_copied: str
    target_size: int
    target_root: str
    source_key: RegistryKey
    target_key: RegistryKey
    notes: tuple[str, ...] = field(default=())

    def to_json(self) -> dict[str, Any]:
        """A JSON object for ``--json`` output."""
        return {
            "source": self.source,
            "target": self.target,
            "start_size": self.start_size,
            "copied_size": self.copied_size,
            "copied_entries": self.copied_entries,
            "blobs_copied": list(self.blobs_copied),
            "blobs_skipped": self.blobs_skipped,
            "bytes_copied": self.bytes_copied,
            "source_root": self.source_root,
            "target_root_at_copied": self.target_root_at_copied,
            "target_size": self.target_size,
            "target_root": self.target_root,
            "source_key": self.source_key.to_json(),
            "target_key": self.target_key.to_json(),
            "notes": list(self.notes),
            "verified": ["source_checkpoint", "target_checkpoints", "roots_equal_at_copied_size", "consistency"],
        }


def mirror(
    source: RegistryClient,
    target: RegistryClient,
    *,
    source_key_file: Path | None = None,
    target_key_file: Path | None = None,
    extra_tokens: Sequence[str] = (),
    progress: bool = False,
) -> MirrorResult:
    """Copy every entry of ``source`` that ``target`` lacks, with its blobs, in log order.

    The target must be a mirror of the source so far: its log's first entries must be the
    source's (the larger log's consistency proof from the smaller one's size, verified against
    both signed heads) or ``MirrorDivergedError``. The source's size
    N is fixed when the mirror begins; entries [target size, N) are copied. Each envelope is
    posted byte for byte as the source stored it (checked against the source's digest and leaf
    hash), after every blob it names: blobs the target holds are skipped, others stream from a
    GET on the source into a PUT on the target, hashed on the way. Re-running copies only what
    is new.

    Then the proof: the source's checkpoint at N (signed by the source key) and the target's
    checkpoint at N (signed by the target key) must have the same root, and the target's
    consistency proof from N to its current size must verify against the source's root at N.

    ``target`` carries the token; the target's rule is that a token may publish only under keys
    it is bound to, so it must be bound to the keys of the source's publishers. A post refused
    as ``key-not-bound`` is retried with each of ``extra_tokens`` in turn (one per publisher).
    """
    source_key = registry_key(source, source_key_file)
    target_key = registry_key(target, target_key_file)
    source_head, _ = source.signed_head(source_key)
    target_head, _ = target.signed_head(target_key)
    n = source_head.size
    start = target_head.size
    common = min(n, start)
    if common:
        # The target must hold exactly the source's first entries, else copying would misplace them.
        # Proved from the two signed heads: the larger log's consistency proof from the smaller
        # one's size, against both roots (a registry signs a checkpoint per batch of publishes, so
        # neither need have one at the other's size, e.g. after an interrupted mirror).
        smaller, larger, prover = (target_head, source_head, source) if start <= n else (source_head, target_head, target)
        try:
            prove_consistency(prover, smaller.size, smaller.root_hash, larger, f"{prover.url} at size {larger.size}")
        except EvidenceError as e:
            raise MirrorDivergedError(
                f"the first {common} entries of {target.url} are not those of {source.url} "
                f"(root {smaller.root_hash.hex()[:16]} at size {common} is not a prefix of the larger log: {e.message})"
            ) from e
    notes = []
    if start > n:
        notes.append(f"the target already holds {start - n} entries past the source's {n}")

    copied = 0
    blobs_copied: list[str] = []
    blobs_skipped = 0
    bytes_copied = 0
    present: set[str] = set()
    tokens: list[str | None] = [None, *extra_tokens]
    entries = source.iter_entries(below=n) if start < n else iter(())
    with progress_bar(progress, max(n - start, 0), f"mirror {source.url} -> {target.url}", unit="entry") as bar:
        # Metadata is listed from the start (the API's cursors are opaque); only entries from
        # the target's size on are copied.
        for listed in entries:
            index = listed["log_index"]  # checked by the listing (a ListedItem)
            if index < start:
                continue
            if index >= n:
                break
            item = parse_wire(EntryMeta, listed, source.url + "/v1/entries", f"entry {index}")
            if index != start + copied:
                raise EvidenceError(f"{source.url} listed entry {index} where entry {start + copied} was due")
            envelope = _source_envelope(source, item)
            for blob in _blobs_of(item):
                if blob in present:
                    continue
                if target.blob_size(blob) is None:
                    bytes_copied += _copy_blob(source, target, blob)
                    blobs_copied.append(blob)
                else:
                    blobs_skipped += 1
                present.add(blob)
            entry = _post_with_tokens(target, envelope, tokens, index).entry
            if entry.log_index != index or entry.digest != item.digest:
                raise MirrorDivergedError(
                    f"{target.url} logged source entry {index} ({item.digest}) as entry {entry.log_index}: "
                    "something else was published to the target meanwhile"
                )
            copied += 1
            bar.update(1)
    if start + copied < n:
        raise EvidenceError(
            f"{source.url} listed entries only up to {start + copied - 1}, but its checkpoint is at size {n}"
        )

    # The proof, from signed checkpoints only.
    final, _ = target.signed_head(target_key)
    at_n, _ = target.signed_head(target_key, n)
    if at_n.root_hash != source_head.root_hash:
        raise MirrorDivergedError(
            f"after copying, {target.url} at size {n} has root {at_n.root_hash.hex()}, "
            f"but {source.url} at size {n} has root {source_head.root_hash.hex()}"
        )
    prove_consistency(
        target,
        n,
        source_head.root_hash,
        final,
        f"{target.url}'s log at size {final.size} is not proved to extend the source's at size {n}",
    )
    return MirrorResult(
        source=source.url,
        target=target.url,
        start_size=start,
        copied_size=n,
        copied_entries=copied,
        blobs_copied=tuple(blobs_copied),
        blobs_skipped=blobs_skipped,
        bytes_copied=bytes_copied,
        source_root=source_head.root_hash.hex(),
        target_root_at_copied=at_n.root_hash.hex(),
        target_size=final.size,
        target_root=final.root_hash.hex(),
        source_key=source_key,
        target_key=target_key,
        notes=tuple(notes),
    )


def _source_envelope(source: RegistryClient, item: EntryMeta) -> bytes:
    envelope = source.envelope(item.log_index)
    if sha256_of(envelope) != item.digest or hash_leaf(envelope).hex() != item.leaf_hash:
        raise EvidenceError(
            f"{source.url}/v1/entries/{item.log_index}/envelope: the envelope bytes hash to {sha256_of(envelope)}, "
            f"not the entry's digest {item.digest} and leaf"
        )
    return envelope


def _blobs_of(item: EntryMeta) -> list[str]:
    # What the target will require before it accepts the entry: every subject, and a child
    # artifact's parent tensors.
    blobs = [s.digest for s in item.subjects]
    if item.artifact is not None and item.artifact.parent is not None:
        blobs.append(item.artifact.parent)
    return list(dict.fromkeys(blobs))


def _copy_blob(source: RegistryClient, target: RegistryClient, digest: str) -> int:
    h = hashlib.sha256()
    sent = 0
    with source.open_blob(digest) as (length, chunks):
        if length is None:
            raise malformed(f"{source.url}/v1/blobs/{digest}", "the blob came without a Content-Length")

        def hashed() -> Iterator[bytes]:
            nonlocal sent
            for chunk in chunks:
                h.update(chunk)
                sent += len(chunk)
                yield chunk

        try:
            target.put_blob(digest, hashed(), length)
        except RegistryResponseError as e:
            got = "sha256:" + h.hexdigest()
            if got != digest:
                raise BlobDigestError(
                    f"{source.url} served {sent} bytes for blob {digest} that hash to {got}; the target kept nothing"
                ) from e
            raise
    if "sha256:" + h.hexdigest() != digest:
        raise BlobDigestError(f"{source.url} served bytes for blob {digest} that hash to sha256:{h.hexdigest()}")
    return sent


def _post_with_tokens(
    target: RegistryClient, envelope: bytes, tokens: Sequence[str | None], index: int
) -> EntryDocument:
    for i, token in enumerate(tokens):
        try:
            doc, _ = target.post_entry(envelope, token=token)
            return doc
        except RegistryAuthError as e:
            if e.problem_type.endswith("/key-not-bound") and i + 1 < len(tokens):
                continue
            if e.problem_type.endswith("/key-not-bound"):
                raise RegistryAuthError(
                    f"{target.url} refused source entry {index}: {e.problem.get('detail', e.message)}",
                    hint="on the target, bind a token to the source publisher's key (kvgraft token create --data DIR "
                    "--publisher NAME --key PUB.pem) and pass it with --token (repeat --token, one per publisher)",
                    status=e.status,
                    problem=e.problem,
                ) from e
            raise
    raise RegistryClientError("no token to publish with", hint="pass --token")  # unreachable: tokens has one entry
