"""The registry's HTTP API as typed calls: ``RegistryClient``.

One method per endpoint: short digests, the log (key, checkpoints, witnessed checkpoints, proofs),
blobs (streamed both ways, bounded by their Content-Length), entries, artifacts and records, and
the paged listings, which must advance (a new cursor, strictly increasing log indexes) within
``max_pages`` and ``max_items``. Every call goes through ``transport.Transport``: one total
deadline per request, bounded bodies, JSON read strictly into the wire models of
``kvgraft.schemas``, error documents raised as ``RegistryClientError`` subclasses.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import math
import os
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from kvgraft.schemas import (
    ArtifactDocument,
    BlobStored,
    ConsistencyProof,
    DigestMatches,
    EntryDocument,
    InclusionProof,
    Listing,
    LogKey,
    SchemaError,
    parse_sha256,
)
from kvgraft.verifier import Checkpoint, WitnessPolicy

from .errors import (
    AmbiguousDigestError,
    BlobDigestError,
    DiskFullError,
    EvidenceError,
    ListingError,
    RegistryClientError,
    RegistryNotFoundError,
    RegistryUnavailableError,
    ResponseTooLargeError,
    UnwitnessedCheckpointError,
    malformed,
)
from .evidence import NO_MEMORY, CheckpointMemory, NoMemory, prove_extends
from .progress import Progress
from .store import free_bytes, local_write_error
from .transport import ClientLimits, Transport, check_deadline, parse_json_answer, parse_wire, registry_url

if TYPE_CHECKING:
    from .evidence import RegistryKey

#: Blobs move in chunks of this size, both ways: memory stays flat in the blob size.
CHUNK = 1 << 20
#: The largest page the registry serves.
PAGE_LIMIT = 500
#: Seconds a client with a witness policy waits for a checkpoint holding its entry to be cosigned
#: (``--witness-wait``): witnesses cosign within moments of a publish when they are up.
DEFAULT_WITNESS_WAIT = 30.0
#: The first and the longest pause between two asks for a witnessed checkpoint.
_WITNESS_POLL_FIRST = 0.25
_WITNESS_POLL_MAX = 2.0


# --- small helpers -----------------------------------------------------------------------------


def checked_digest(value: str, what: str = "digest") -> str:
    """``value`` when it is ``sha256:<64 lowercase hex>``, else a one-line ``RegistryClientError``."""
    try:
        return str(parse_sha256(value))
    except SchemaError as e:
        raise RegistryClientError(
            f"{what} {value[:80]!r} is not sha256:<64 lowercase hex>", hint="copy the digest exactly"
        ) from e


def sha256_of(data: bytes) -> str:
    """``sha256:<hex>`` of ``data``."""
    return "sha256:" + hashlib.sha256(data).hexdigest()


# --- the client ----------------------------------------------------------------------------------


class RegistryClient:
    """One registry, over one ``httpx.Client`` (a ``Transport``); use it as a context manager so the connection
    pool is closed when the block ends.

    ``token`` is sent as ``Authorization: Bearer`` on every request (writes need it; reads need
    it only on registries started with ``--reads-require-token``). ``limits`` bound every
    answer (``timeout``, when given, replaces ``limits.timeout``). ``memory`` remembers the
    newest checkpoint verified per log and refuses one that does not extend it: by default
    (None) ``CheckpointMemory.default()``, under ``$KVGRAFT_HOME``; ``NO_MEMORY`` turns it off.
    ``witness_policy``, when given, is the quorum of witness cosignatures every checkpoint this
    client accepts must carry (``registry_key`` puts it on the key); ``witness_wait`` bounds how
    long it waits for the witnesses to cosign a checkpoint that holds a given entry.

    JSON answers come back as the wire models of ``kvgraft.schemas`` (``LogKey``,
    ``EntryDocument``, ...); listings yield each item as the registry sent it (a dict with at
    least a ``log_index``).
    """

    def __init__(
        self,
        url: str,
        *,
        token: str | None = None,
        timeout: float | None = None,
        transport: httpx.BaseTransport | None = None,
        limits: ClientLimits | None = None,
        memory: CheckpointMemory | None | type[NoMemory] = None,
        witness_policy: WitnessPolicy | None = None,
        witness_wait: float = DEFAULT_WITNESS_WAIT,
    ) -> None:
        url = registry_url(url)
        self.url = url
        limits = limits or ClientLimits()
        if timeout is not None:
            limits = dataclasses.replace(limits, timeout=timeout)
        self.limits = limits
        if not (math.isfinite(witness_wait) and witness_wait >= 0):
            raise RegistryClientError(
                f"witness wait {witness_wait} is not a number of seconds >= 0", hint="pass --witness-wait S with S >= 0"
            )
        self.witness_policy = witness_policy
        self.witness_wait = witness_wait
        self.memory: CheckpointMemory | None = (
            CheckpointMemory.default() if memory is None else None if memory is NO_MEMORY else memory  # type: ignore[assignment]
        )
        self._http = Transport(url, limits, token=token, transport=transport)

    def __enter__(self) -> RegistryClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the connection pool."""
        self._http.close()

    # --- short digests --------------------------------------------------------------------

    def resolve_digest(self, text: str, *, artifacts_only: bool = True) -> str:
        """``text`` as a full ``sha256:<hex>`` digest: itself when it is one; else a short digest
        (``sha256:1f2e3d4c`` or ``1f2e3d4c``, at least 4 hex digits) resolved by the registry
        (``GET /v1/digests/{prefix}``) as git resolves an abbreviation: the one digest it starts,
        ``RegistryNotFoundError`` for none, ``AmbiguousDigestError`` listing the candidates for several."""
        hex_part = text.removeprefix("sha256:")
        if len(hex_part) == 64:
            return checked_digest(text)
        if not (4 <= len(hex_part) < 64 and all(c in "0123456789abcdef" for c in hex_part)):
            raise RegistryClientError(f"{text[:80]!r} is neither a digest nor a short one",
                                      hint="pass sha256:<64 lowercase hex>, or a unique start of one (at least 4 hex digits)")
        query = "?kind=artifact" if artifacts_only else ""
        found = self._http.document(DigestMatches, f"/v1/digests/sha256:{hex_part}{query}", "the digests")[1]
        # The registry's answer is checked, not trusted: every match must start with what was asked.
        matches = [m.digest for m in found.matches if m.digest.startswith(f"sha256:{hex_part}")]
        what = "artifact digest" if artifacts_only else "digest"
        if not matches:
            raise RegistryNotFoundError(f"no {what} in {self.url} starts with sha256:{hex_part}",
                                        hint="check the digest; list the registry's artifacts with GET /v1/artifacts")
        if len(matches) > 1 or found.more:
            listed = ", ".join(matches) + (", ..." if found.more else "")
            raise AmbiguousDigestError(f"sha256:{hex_part} is the start of several {what}s in {self.url}: {listed}")
        return checked_digest(matches[0])

    # --- the log -------------------------------------------------------------------------

    def log_key(self) -> LogKey:
        """``GET /v1/log/key``: origin, public key PEM, key id, note verifier key, tree size."""
        return self._http.document(LogKey, "/v1/log/key", "the log key")[1]

    def checkpoint(self, tree_size: int | None = None, *, witnessed: int | None = None) -> bytes:
        """The signed checkpoint note, latest, at ``tree_size``, or the newest cosigned by at least
        ``witnessed`` witnesses, byte for byte as served (unchecked: see ``signed_head``)."""
        params = {} if tree_size is None else {"tree_size": tree_size}
        if witnessed is not None:
            params["witnessed"] = witnessed
        return self._http.request(
            "GET", "/v1/log/checkpoint", params=params, limit=self.limits.max_note_bytes, what="a checkpoint"
        )[1]

    def signed_head(self, key: RegistryKey, tree_size: int | None = None) -> tuple[Checkpoint, bytes]:
        """The checkpoint (latest, or at ``tree_size``) verified with ``key`` and against the
        remembered one (``CheckpointMemory``): (checkpoint, note bytes as served).

        With a witness policy on ``key`` the latest is the newest *witnessed* checkpoint
        (``witnessed_head``), and one at ``tree_size`` must be signed by the log and either meet the
        policy itself or be proved (consistency proof) a prefix of the newest witnessed one.
        """
        if key.policy is not None:
            return self._witnessed_signed_head(key, tree_size)
        note = self.checkpoint(tree_size)
        head = key.verify(note, self.url + "/v1/log/checkpoint")
        if tree_size is not None and head.size != tree_size:
            raise EvidenceError(f"{self.url} answered for its checkpoint at size {tree_size} with size {head.size}")
        self.remember(key, head, note, latest=tree_size is None)
        return head, note

    def _witnessed_signed_head(self, key: RegistryKey, tree_size: int | None) -> tuple[Checkpoint, bytes]:
        witnessed, witnessed_note = self.witnessed_head(key)
        if tree_size is None or tree_size == witnessed.size:
            return witnessed, witnessed_note
        url = self.url + "/v1/log/checkpoint"
        note = self.checkpoint(tree_size)
        head = key.verify_signed(note, url) if tree_size < witnessed.size else key.verify(note, url)
        if head.size != tree_size:
            raise EvidenceError(f"{self.url} answered for its checkpoint at size {tree_size} with size {head.size}")
        if head.size < witnessed.size:
            # Signed by the log, and a prefix of a tree the witnesses vouch for: as good as witnessed.
            self.verify_extends(head, witnessed)
        self.remember(key, head, note, latest=False)
        return head, note

    def witnessed_head(self, key: RegistryKey, *, min_size: int = 0) -> tuple[Checkpoint, bytes]:
        """The newest checkpoint meeting ``key``'s witness policy, of at least ``min_size`` entries.

        Asks ``/v1/log/checkpoint?witnessed=K`` (K: the fewest cosignatures the quorum can be met
        with) until the answer is at least ``min_size`` and meets the policy, for at most
        ``witness_wait`` seconds; then ``UnwitnessedCheckpointError`` saying what it got. The
        checkpoint is checked against the remembered one and remembered (as a past head: the
        registry may hold newer, not yet witnessed ones).
        """
        policy = key.policy
        if policy is None:
            raise RegistryClientError("witnessed_head needs a key with a witness policy", hint="this is a bug in kvgraft")
        url = self.url + "/v1/log/checkpoint"
        deadline = time.monotonic() + self.witness_wait
        pause = _WITNESS_POLL_FIRST
        while True:
            try:
                note = self.checkpoint(witnessed=policy.min_cosignatures())
                head = key.verify(note, url)
                if head.size >= min_size:
                    self.remember(key, head, note, latest=False)
                    return head, note
                why = (
                    f"the newest checkpoint cosigned as {policy.source} requires is at tree size {head.size}, and "
                    f"entry {min_size - 1} needs one of at least {min_size}"
                )
            except RegistryNotFoundError as e:
                why = f"it holds no checkpoint cosigned by {policy.min_cosignatures()} witness(es) ({e.message})"
            except UnwitnessedCheckpointError as e:
                why = e.message
            if time.monotonic() + pause > deadline:
                raise UnwitnessedCheckpointError(
                    f"{self.url} serves no checkpoint that meets the witness policy's quorum, {policy.describe()}, "
                    f"after waiting {self.witness_wait:g} s: {why}"
                )
            time.sleep(pause)
            pause = min(pause * 2, _WITNESS_POLL_MAX)

    def remember(self, key: RegistryKey, head: Checkpoint, note: bytes, *, latest: bool) -> None:
        """Check a verified checkpoint against the remembered one and remember it when newer.

        ``latest``: the registry served it as its current head (a smaller size than remembered
        is then a rollback); otherwise it is a past head, which must be proved a prefix.
        """
        if self.memory is not None:
            self.memory.check(self, key, head, note, latest=latest)

    def inclusion_proof(self, index: int, tree_size: int | None = None) -> InclusionProof:
        """The inclusion proof (``log_index``, ``tree_size``, ``hashes``) of entry ``index``."""
        params: dict[str, int] = {"index": index}
        if tree_size is not None:
            params["tree_size"] = tree_size
        return self._http.document(InclusionProof, "/v1/log/proof/inclusion", "the inclusion proof", params=params)[1]

    def consistency_proof(self, old: int, new: int | None = None) -> ConsistencyProof:
        """The consistency proof (``old_size``, ``new_size``, ``hashes``) between two tree sizes (new: latest)."""
        params: dict[str, int] = {"old": old}
        if new is not None:
            params["new"] = new
        return self._http.document(ConsistencyProof, "/v1/log/proof/consistency", "the consistency proof", params=params)[1]

    def verify_extends(self, old: Checkpoint, new: Checkpoint) -> None:
        """Fetch and verify the consistency proof that ``new`` extends ``old`` (raises ``EvidenceError``)."""
        prove_extends(self, old, new)

    # --- blobs ---------------------------------------------------------------------------

    def blob_size(self, digest: str) -> int | None:
        """The stored blob's size (``HEAD``), or None when the registry does not hold it."""
        digest = checked_digest(digest)
        with self._http.stream("HEAD", f"/v1/blobs/{digest}", expect=(200, 404)) as (response, _):
            if response.status_code == 404:
                return None
            length = response.headers.get("content-length", "")
        if not (length.isascii() and length.isdigit()):
            raise malformed(f"{self.url}/v1/blobs/{digest}", "HEAD sent no Content-Length")
        return int(length)

    def put_blob(self, digest: str, chunks: Iterable[bytes], size: int) -> bool:
        """Upload ``size`` bytes streamed from ``chunks`` as blob ``digest``; True when new.

        Content-Length is sent so that an oversized blob is refused before any byte goes. The
        upload's deadline is the timeout plus ``size`` at ``limits.min_rate``. The answer must be
        a ``BlobStored`` for ``digest``.
        """
        digest = checked_digest(digest)
        path = f"/v1/blobs/{digest}"
        status, body = self._http.request(
            "PUT",
            path,
            expect=(200, 201),
            content=chunks,
            limit=self.limits.max_problem_bytes,
            headers={"Content-Length": str(size), "Content-Type": "application/octet-stream"},
            seconds=self.limits.blob_seconds(size),
        )
        url = self.url + path
        stored = parse_wire(BlobStored, parse_json_answer(body, url, self.limits), url, "the blob answer")
        if stored.digest != digest:
            raise malformed(url, f"the upload of {digest} was answered for blob {stored.digest}")
        return status == 201

    @contextlib.contextmanager
    def open_blob(self, digest: str) -> Iterator[tuple[int | None, Iterator[bytes]]]:
        """Stream blob ``digest``: yields (Content-Length or None, an iterator of chunks).

        The chunks are the bytes as served, unchecked: hash them (``download_blob`` does). They
        never add up to more than the Content-Length, which must be within ``max_blob_bytes``;
        the transfer's deadline is the timeout plus that length at ``min_rate``.
        """
        digest = checked_digest(digest)
        url = f"/v1/blobs/{digest}"
        # Identity, so that Content-Length is the blob's size, which bounds what is written.
        with self._http.stream("GET", url, headers={"Accept-Encoding": "identity"}) as (response, deadline):
            raw_length = response.headers.get("content-length", "")
            length = int(raw_length) if raw_length.isascii() and raw_length.isdigit() else None
            if response.headers.get("content-encoding", "identity").lower() != "identity":
                raise malformed(
                    self.url + url, f"the blob came {response.headers['content-encoding']}-encoded, not as its bytes"
                )
            if length is not None and length > self.limits.max_blob_bytes:
                raise ResponseTooLargeError(
                    f"{self.url}{url} announced a blob of {length} bytes, more than the limit of {self.limits.max_blob_bytes}",
                    hint="raise --max-blob-bytes if the blob is really that large",
                )
            deadline.extend_to(self.limits.blob_seconds(length or 0))
            cap = self.limits.max_blob_bytes if length is None else length

            def chunks() -> Iterator[bytes]:
                got = 0
                try:
                    for chunk in response.iter_bytes(CHUNK):
                        got += len(chunk)
                        if got > cap:
                            raise ResponseTooLargeError(f"{self.url}{url} sent more than the {cap} bytes it announced")
                        check_deadline(self.url + url)
                        yield chunk
                except httpx.TimeoutException as e:
                    raise RegistryUnavailableError(
                        f"reading blob {digest} from {self.url} did not complete within its deadline of "
                        f"{deadline.seconds:.0f} s ({e})",
                        hint="the registry is too slow or stalls; retry, or raise --timeout or lower --min-rate",
                    ) from e
                except httpx.HTTPError as e:
                    # Raised inside whatever consumes the chunks (maybe another registry's
                    # upload): name this registry as the one that failed.
                    raise RegistryUnavailableError(f"reading blob {digest} from {self.url} failed: {e}") from e

            yield length, chunks()

    def download_blob(
        self, digest: str, dest: Path, *, progress: Progress | None = None, space_dir: Path | None = None
    ) -> int:
        """Stream blob ``digest`` into the new file ``dest``, hashing as it goes; return its size.

        Raises ``BlobDigestError`` (and removes ``dest``) when the bytes hash to another digest.
        The registry must announce the size (Content-Length); nothing past it is written, and a
        blob that does not fit in the free space of ``dest``'s filesystem is refused before a
        byte is written (``DiskFullError``, naming ``space_dir``, default ``dest.parent``).
        """
        digest = checked_digest(digest)
        where = space_dir or dest.parent
        h = hashlib.sha256()
        size = 0
        # Created first and exclusively: on failure only a file this call made is removed.
        try:
            f = dest.open("xb")
        except OSError as e:
            raise local_write_error(e, dest, where) from e
        try:
            with f, self.open_blob(digest) as (length, chunks):
                if length is None:
                    raise malformed(f"{self.url}/v1/blobs/{digest}", "the blob came without a Content-Length")
                free = free_bytes(dest.parent)
                if free is not None and free < length:
                    raise DiskFullError(f"blob {digest} needs {length} bytes in {where}, which has {free} bytes free")
                try:
                    for chunk in chunks:
                        h.update(chunk)
                        f.write(chunk)
                        size += len(chunk)
                        if progress is not None:
                            progress.update(len(chunk))
                    f.flush()
                    os.fsync(f.fileno())
                except OSError as e:
                    raise local_write_error(e, dest, where, needed=length) from e
            got = "sha256:" + h.hexdigest()
            if got != digest:
                raise BlobDigestError(f"{self.url} served {size} bytes for blob {digest} that hash to {got}")
        except BaseException:
            dest.unlink(missing_ok=True)
            raise
        return size

    # --- entries, artifacts, records -------------------------------------------------------

    def post_entry(self, envelope: bytes, *, token: str | None = None) -> tuple[EntryDocument, bool]:
        """``POST /v1/entries`` with the envelope bytes as given; (the entry document, created)."""
        status, doc = self._http.document(
            EntryDocument,
            "/v1/entries",
            "the publish answer",
            method="POST",
            expect=(200, 201),
            token=token,
            content=envelope,
            headers={"Content-Type": "application/json"},
        )
        return doc, status == 201

    def entry(self, ref: int | str) -> EntryDocument:
        """The entry (by log index or envelope digest), its inclusion proof and the latest checkpoint."""
        return self._http.document(EntryDocument, f"/v1/entries/{ref}", "the entry document")[1]

    def envelope(self, ref: int | str) -> bytes:
        """An entry's envelope bytes exactly as stored (unchecked: see ``hash_leaf``)."""
        return self._http.request(
            "GET", f"/v1/entries/{ref}/envelope", limit=self.limits.max_envelope_bytes, what="an envelope"
        )[1]

    def artifact(self, digest: str, *, signer: str | None = None) -> ArtifactDocument:
        """``GET /v1/artifacts/sha256:HEX``: the artifact by its tensors' digest, as the first entry
        signed by key id ``signer`` claims it (default: the first entry logged)."""
        path = f"/v1/artifacts/{checked_digest(digest, 'artifact digest')}"
        params = {} if signer is None else {"signer": signer}
        return self._http.document(ArtifactDocument, path, "the artifact document", params=params)[1]

    def _pages(self, path: str, params: dict[str, Any], *, below: int | None = None) -> Iterator[dict[str, Any]]:
        """Every item of a paged listing, in log order, up to (not including) log index ``below``.

        Each page is read as a ``Listing`` (items with a ``log_index``, a cursor). The listing must
        advance: each cursor new, each item's ``log_index`` larger than the last, within
        ``max_pages`` pages and ``max_items`` items; else ``ListingError``.
        """
        url = self.url + path
        cursor: str | None = None
        seen: set[str] = set()
        last = -1
        items_read = 0
        for page_number in range(1, self.limits.max_pages + 1):
            query = {k: v for k, v in params.items() if v is not None} | {"limit": PAGE_LIMIT}
            if cursor is not None:
                query["cursor"] = cursor
            raw = parse_json_answer(self._http.request("GET", path, params=query, what="a JSON answer")[1], url, self.limits)
            page = parse_wire(Listing, raw, url, "the page")
            next_cursor = page.next_cursor
            if next_cursor is not None:
                if not page.items:
                    raise malformed(url, "a page with a cursor is empty")
                if next_cursor in seen or next_cursor == cursor:
                    raise ListingError(
                        f"{url} sent the cursor {next_cursor[:40]!r} again on page {page_number}: the listing would never end"
                    )
                seen.add(next_cursor)
            for item, doc in zip(page.items, raw["items"], strict=True):
                index = item.log_index
                if index <= last:
                    raise ListingError(
                        f"{url} listed log index {index} after {last} on page {page_number}: a listing must advance in log order"
                    )
                last = index
                if below is not None and index >= below:
                    return
                items_read += 1
                if items_read > self.limits.max_items:
                    raise ListingError(
                        f"{url} listed more than {self.limits.max_items} items; stopped",
                        hint="narrow the listing, or name the entries you want",
                    )
                yield doc
            if next_cursor is None:
                return
            cursor = next_cursor
        raise ListingError(f"{url} is still listing after {self.limits.max_pages} pages; stopped")

    def iter_entries(self, *, below: int | None = None) -> Iterator[dict[str, Any]]:
        """Every entry's metadata, in log order (``GET /v1/entries``, all pages), up to log index ``below``.

        Each item is as served; read it with ``kvgraft.schemas.EntryMeta`` (``mirror`` does)."""
        return self._pages("/v1/entries", {}, below=below)

    def list_artifacts(
        self,
        *,
        model: str | None = None,
        profile: str | None = None,
        parent: str | None = None,
        publisher: str | None = None,
        q: str | None = None,
    ) -> Iterator[dict[str, Any]]:
        """Artifacts in log order, filtered as ``GET /v1/artifacts`` filters (all pages); each item
        as served (an ``ArtifactSummary``)."""
        return self._pages(
            "/v1/artifacts", {"model": model, "profile": profile, "parent": parent, "publisher": publisher, "q": q}
        )

    def list_records(
        self, *, artifact: str | None = None, kind: str | None = None, publisher: str | None = None
    ) -> Iterator[dict[str, Any]]:
        """Records in log order, filtered as ``GET /v1/records`` filters (all pages); each item as
        served (an ``EntryMeta``)."""
        return self._pages("/v1/records", {"artifact": artifact, "type": kind, "publisher": publisher})
