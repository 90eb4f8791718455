"""The registry client: publish, pull and mirror over the HTTP API, built on httpx.

Every answer the registry gives is checked here, never trusted: a published entry's leaf is
recomputed from the envelope bytes and its inclusion proof is verified against a checkpoint
signed by the registry key; a pulled artifact's blobs are hashed while they stream, its
statement's subjects must be exactly the downloaded files, and its envelope is proved to be in
the log before the directory appears; a mirror ends with the target's signed tree at the copied
size equal to the source's, and a consistency proof from there to the target's current size.

Blobs stream both ways in 1 MiB chunks, so memory stays flat in the blob size. The registry key
is either pinned (a PEM file) or fetched from ``/v1/log/key`` and reported as trust on first use.

This module needs httpx (the ``registry`` extra) but not litestar, duckdb, uvicorn or the
server's modules; ``kvgraft.registry.client_cli`` imports it only when a command runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import shutil
import tempfile
import urllib.parse
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import httpx
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

import kvgraft
from kvgraft.schemas import (
    KvArtifactStatement,
    SchemaError,
    Statement,
    hex_of,
    parse_sha256,
    parse_statement,
)
from kvgraft.verifier import (
    RECORD_FILE,
    BadSignatureError,
    Checkpoint,
    ThresholdNotMetError,
    TrustedKeys,
    UnknownKeyError,
    VerificationError,
    b64decode_any,
    hash_leaf,
    keyid_of,
    load_public_key,
    parse_envelope,
    parse_public_key,
    public_key_pem,
    verify_checkpoint,
    verify_consistency,
    verify_inclusion,
    verify_statement_envelope,
    verify_subjects,
)

#: Blobs move in chunks of this size, both ways: memory stays flat in the blob size.
CHUNK = 1 << 20
#: The engine's file names (not imported: the engine needs torch, the client must not).
KV_FILE = "kv.safetensors"
STATEMENT_FILE = "statement.dsse.json"
#: The registry's default envelope limit is 16 MiB; refuse to read a local "envelope" far past it.
MAX_ENVELOPE_BYTES = 64 << 20
#: The largest page the registry serves.
PAGE_LIMIT = 500
#: No real chain is this deep; a cycle cannot make publish or pull recurse forever.
MAX_CHAIN = 1_000

_HEX64 = frozenset("0123456789abcdef")


# --- errors ------------------------------------------------------------------------------------


class RegistryClientError(Exception):
    """Base class of every failure of the registry client; one line with a hint."""

    default_hint = "check the registry URL and the inputs named in the message"

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        self.message = message
        self.hint = hint if hint is not None else self.default_hint
        super().__init__(message)

    def __str__(self) -> str:
        return " ".join(f"{self.message} (hint: {self.hint})".split())


class RegistryUnavailableError(RegistryClientError):
    """The registry could not be reached, or the connection broke mid-transfer."""

    default_hint = "check that the registry URL is right and the server is running, then retry"


class RegistryResponseError(RegistryClientError):
    """The registry answered with an error (an RFC 9457 problem) or with a malformed document."""

    default_hint = "see the registry's message; the API is described in docs/registry.md"

    def __init__(
        self, message: str, *, hint: str | None = None, status: int | None = None, problem: dict[str, Any] | None = None
    ) -> None:
        super().__init__(message, hint=hint)
        self.status = status
        #: The problem document as served (empty when the body was not one).
        self.problem: dict[str, Any] = dict(problem or {})

    @property
    def problem_type(self) -> str:
        """The problem's ``type`` URI ("" when there was none)."""
        value = self.problem.get("type")
        return value if isinstance(value, str) else ""


class RegistryAuthError(RegistryResponseError):
    """401 or 403: no token, an unknown or revoked token, or a key the token is not bound to."""

    default_hint = "pass a valid --token bound to the key that signed the envelope"


class RegistryNotFoundError(RegistryResponseError):
    """404: the registry holds no such artifact, entry or blob."""

    default_hint = "check the digest; list what the registry holds with GET /v1/artifacts"


class LocalFilesError(RegistryClientError):
    """A local directory or file cannot be published or written (missing, unsafe, already there)."""

    default_hint = "pass an artifact directory (kv.safetensors + statement.dsse.json) or a record directory"


class ParentNotPublishedError(RegistryClientError):
    """An artifact's parent tensors are neither on the registry nor found locally."""

    default_hint = "publish the parent artifact first: kvgraft publish --registry URL PARENT_DIR"


class BlobDigestError(RegistryClientError):
    """Bytes that arrived (or were sent) hash to another digest than the one they were asked for."""

    default_hint = "the registry served altered bytes; nothing was kept. Report it to the registry's operator"


class EvidenceError(RegistryClientError):
    """The registry's evidence does not hold: a checkpoint signature, an inclusion or consistency
    proof, a leaf hash, or a statement that does not describe what was downloaded."""

    default_hint = "do not use what this registry served; report it to the registry's operator"


class EnvelopeSignatureError(RegistryClientError):
    """A pulled envelope's signatures do not satisfy the trusted keys."""

    default_hint = "check --trusted-keys: it must hold the publisher's public key (kvgraft keys trust)"


class MirrorDivergedError(RegistryClientError):
    """The target's log is not a prefix of the source's (or does not extend it): it is not a mirror."""

    default_hint = "mirror into an empty registry, or into one that only ever received this source's entries"


# --- progress ----------------------------------------------------------------------------------


class Progress(Protocol):
    """The part of a tqdm bar the client uses."""

    def update(self, n: float | None = 1) -> bool | None: ...

    def close(self) -> None: ...


class _NoProgress:
    def update(self, n: float | None = 1) -> bool | None:
        return None

    def close(self) -> None:
        return None


def _bar(enabled: bool, total: int | None, desc: str, unit: str = "B") -> Progress:
    """A tqdm bar on stderr, or a no-op when disabled, pointless (nothing to do) or tqdm is missing."""
    if not enabled or total == 0:
        return _NoProgress()
    try:
        import sys

        from tqdm import tqdm
    except ImportError:
        # tqdm comes with the engine's dependencies; the registry extra alone may lack it.
        return _NoProgress()
    bar: Progress = tqdm(
        total=total, desc=desc, unit=unit, unit_scale=unit == "B", unit_divisor=1024, file=sys.stderr, leave=False
    )
    return bar


@contextlib.contextmanager
def _progress(enabled: bool, total: int | None, desc: str, unit: str = "B") -> Iterator[Progress]:
    bar = _bar(enabled, total, desc, unit)
    try:
        yield bar
    finally:
        bar.close()


# --- small helpers -----------------------------------------------------------------------------


def _digest(value: str, what: str = "digest") -> str:
    try:
        return str(parse_sha256(value))
    except SchemaError as e:
        raise RegistryClientError(f"{what} {value[:80]!r} is not sha256:<64 lowercase hex>", hint="copy the digest exactly") from e


def _sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _malformed(url: str, what: str) -> RegistryResponseError:
    return RegistryResponseError(
        f"{url} sent a malformed answer: {what}",
        hint="is this a kvgraft registry of the same version? report it to the registry's operator",
    )


def _field(doc: Any, key: str, kind: type | tuple[type, ...], where: str, url: str) -> Any:
    # The registry is not trusted: a missing or mistyped member is its fault, said in one line.
    if not isinstance(doc, dict) or key not in doc:
        raise _malformed(url, f"{where} has no {key!r}")
    value = doc[key]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise _malformed(url, f"{where}.{key} is {type(value).__name__}")
    return value


def _safe_path(root: Path, name: str, what: str) -> Path:
    """``root / name`` for a subject name, refusing names that would leave ``root``."""
    parts = name.split("/")
    if not name or name.startswith("/") or "\\" in name or any(p in ("", ".", "..") for p in parts) or "\0" in name:
        raise LocalFilesError(
            f"{what} names subject {name[:80]!r}, which is not a plain relative path",
            hint="subject names are relative paths inside the directory (kv.safetensors, logits/<hex>.f32)",
        )
    return root.joinpath(*parts)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def kvgraft_home() -> Path:
    """``$KVGRAFT_HOME`` (default ``~/.cache/kvgraft``), as the engine defines it.

    Repeated here because the engine's module imports torch, which the client must not need.
    """
    return Path(os.environ.get("KVGRAFT_HOME") or Path.home() / ".cache" / "kvgraft")


# --- the HTTP client ---------------------------------------------------------------------------


class RegistryClient:
    """One registry, over one ``httpx.Client``; use it as a context manager so the connection
    pool is closed when the block ends.

    ``token`` is sent as ``Authorization: Bearer`` on every request (writes need it; reads need
    it only on registries started with ``--reads-require-token``).
    """

    def __init__(
        self,
        url: str,
        *,
        token: str | None = None,
        timeout: float = 60.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise RegistryClientError(f"{url!r} is not a registry URL", hint="pass http(s)://host:port, e.g. http://127.0.0.1:8000")
        self.url = url.rstrip("/")
        headers = {"User-Agent": f"kvgraft/{kvgraft.__version__}"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        self._http = httpx.Client(
            base_url=self.url,
            headers=headers,
            # The read timeout bounds each read, not a whole transfer: large blobs still stream.
            timeout=httpx.Timeout(timeout, connect=min(timeout, 10.0)),
            transport=transport,
            follow_redirects=False,
        )

    def __enter__(self) -> RegistryClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the connection pool."""
        self._http.close()

    # --- plumbing ------------------------------------------------------------------------

    def _error(self, response: httpx.Response) -> RegistryResponseError:
        problem: dict[str, Any] = {}
        with contextlib.suppress(ValueError, httpx.HTTPError):
            response.read()
            doc = response.json()
            if isinstance(doc, dict):
                problem = doc
        status = response.status_code
        where = f"{response.request.method} {response.request.url}"
        detail = problem.get("detail") if isinstance(problem.get("detail"), str) else None
        title = problem.get("title") if isinstance(problem.get("title"), str) else response.reason_phrase
        message = f"{where} answered {status} {title}" + (f": {detail}" if detail else "")
        missing = problem.get("missing")
        if isinstance(missing, list) and missing and not detail:
            message += f" (missing {', '.join(map(str, missing[:5]))})"
        hint = problem.get("hint") if isinstance(problem.get("hint"), str) else None
        cls = RegistryAuthError if status in (401, 403) else RegistryNotFoundError if status == 404 else RegistryResponseError
        return cls(message, hint=hint, status=status, problem=problem)

    def _request(
        self, method: str, path: str, *, expect: Sequence[int] = (200,), token: str | None = None, **kwargs: Any
    ) -> httpx.Response:
        headers = dict(kwargs.pop("headers", None) or {})
        if token:
            headers["Authorization"] = f"Bearer {token}"
        try:
            response = self._http.request(method, path, headers=headers, **kwargs)
        except httpx.HTTPError as e:
            raise RegistryUnavailableError(f"{method} {self.url}{path} failed: {str(e) or type(e).__name__}") from e
        if response.status_code not in expect:
            raise self._error(response)
        return response

    def _json(self, path: str, **kwargs: Any) -> dict[str, Any]:
        response = self._request("GET", path, **kwargs)
        try:
            doc = response.json()
        except ValueError as e:
            raise _malformed(self.url + path, "the body is not JSON") from e
        if not isinstance(doc, dict):
            raise _malformed(self.url + path, f"the body is a JSON {type(doc).__name__}, not an object")
        return doc

    # --- the log -------------------------------------------------------------------------

    def log_key(self) -> dict[str, Any]:
        """``GET /v1/log/key``: origin, public key PEM, key id, note verifier key, tree size."""
        return self._json("/v1/log/key")

    def checkpoint(self, tree_size: int | None = None) -> bytes:
        """The signed checkpoint note, latest or at ``tree_size``, byte for byte as served."""
        params = {} if tree_size is None else {"tree_size": tree_size}
        return self._request("GET", "/v1/log/checkpoint", params=params).content

    def inclusion_proof(self, index: int, tree_size: int | None = None) -> dict[str, Any]:
        """``{"log_index", "tree_size", "hashes"}`` for entry ``index``."""
        params: dict[str, int] = {"index": index}
        if tree_size is not None:
            params["tree_size"] = tree_size
        return self._json("/v1/log/proof/inclusion", params=params)

    def consistency_proof(self, old: int, new: int | None = None) -> dict[str, Any]:
        """``{"old_size", "new_size", "hashes"}`` between two tree sizes (new: latest)."""
        params: dict[str, int] = {"old": old}
        if new is not None:
            params["new"] = new
        return self._json("/v1/log/proof/consistency", params=params)

    # --- blobs ---------------------------------------------------------------------------

    def blob_size(self, digest: str) -> int | None:
        """The stored blob's size (``HEAD``), or None when the registry does not hold it."""
        digest = _digest(digest)
        response = self._request("HEAD", f"/v1/blobs/{digest}", expect=(200, 404))
        if response.status_code == 404:
            return None
        length = response.headers.get("content-length", "")
        if not length.isdigit():
            raise _malformed(f"{self.url}/v1/blobs/{digest}", "HEAD sent no Content-Length")
        return int(length)

    def put_blob(self, digest: str, chunks: Iterable[bytes], size: int) -> bool:
        """Upload ``size`` bytes streamed from ``chunks`` as blob ``digest``; True when new.

        Content-Length is sent so that an oversized blob is refused before any byte goes.
        """
        digest = _digest(digest)
        response = self._request(
            "PUT", f"/v1/blobs/{digest}", expect=(200, 201), content=chunks,
            headers={"Content-Length": str(size), "Content-Type": "application/octet-stream"},
        )
        return response.status_code == 201

    @contextlib.contextmanager
    def open_blob(self, digest: str) -> Iterator[tuple[int | None, Iterator[bytes]]]:
        """Stream blob ``digest``: yields (Content-Length or None, an iterator of chunks).

        The chunks are the bytes as served, unchecked: hash them (``download_blob`` does).
        """
        digest = _digest(digest)
        url = f"/v1/blobs/{digest}"
        try:
            with self._http.stream("GET", url) as response:
                if response.status_code != 200:
                    raise self._error(response)
                length = response.headers.get("content-length", "")

                def chunks() -> Iterator[bytes]:
                    try:
                        yield from response.iter_bytes(CHUNK)
                    except httpx.HTTPError as e:
                        # Raised inside whatever consumes the chunks (maybe another registry's
                        # upload): name this registry as the one that failed.
                        raise RegistryUnavailableError(f"reading blob {digest} from {self.url} failed: {e}") from e

                yield (int(length) if length.isdigit() else None), chunks()
        except httpx.HTTPError as e:
            raise RegistryUnavailableError(f"GET {self.url}{url} failed: {str(e) or type(e).__name__}") from e

    def download_blob(self, digest: str, dest: Path, *, progress: Progress | None = None) -> int:
        """Stream blob ``digest`` into the new file ``dest``, hashing as it goes; return its size.

        Raises ``BlobDigestError`` (and removes ``dest``) when the bytes hash to another digest.
        """
        digest = _digest(digest)
        h = hashlib.sha256()
        size = 0
        # Created first and exclusively: on failure only a file this call made is removed.
        try:
            f = dest.open("xb")
        except OSError as e:
            raise LocalFilesError(f"cannot create {dest}: {e.strerror}", hint="download into a new file") from e
        try:
            with f, self.open_blob(digest) as (_, chunks):
                for chunk in chunks:
                    h.update(chunk)
                    f.write(chunk)
                    size += len(chunk)
                    if progress is not None:
                        progress.update(len(chunk))
                f.flush()
                os.fsync(f.fileno())
            got = "sha256:" + h.hexdigest()
            if got != digest:
                raise BlobDigestError(f"{self.url} served {size} bytes for blob {digest} that hash to {got}")
        except BaseException:
            dest.unlink(missing_ok=True)
            raise
        return size

    # --- entries, artifacts, records -------------------------------------------------------

    def post_entry(self, envelope: bytes, *, token: str | None = None) -> tuple[dict[str, Any], bool]:
        """``POST /v1/entries`` with the envelope bytes as given; (document, created)."""
        response = self._request(
            "POST", "/v1/entries", expect=(200, 201), token=token, content=envelope,
            headers={"Content-Type": "application/json"},
        )
        try:
            doc = response.json()
        except ValueError as e:
            raise _malformed(self.url + "/v1/entries", "the body is not JSON") from e
        if not isinstance(doc, dict):
            raise _malformed(self.url + "/v1/entries", "the body is not a JSON object")
        return doc, response.status_code == 201

    def entry(self, ref: int | str) -> dict[str, Any]:
        """``{"entry", "inclusion_proof", "checkpoint"}`` by log index or envelope digest."""
        return self._json(f"/v1/entries/{ref}")

    def envelope(self, ref: int | str) -> bytes:
        """An entry's envelope bytes exactly as stored (unchecked: see ``hash_leaf``)."""
        return self._request("GET", f"/v1/entries/{ref}/envelope").content

    def artifact(self, digest: str) -> dict[str, Any]:
        """``GET /v1/artifacts/sha256:HEX``: the artifact by its tensors' digest."""
        return self._json(f"/v1/artifacts/{_digest(digest, 'artifact digest')}")

    def _pages(self, path: str, params: dict[str, Any]) -> Iterator[dict[str, Any]]:
        cursor: str | None = None
        while True:
            query = {k: v for k, v in params.items() if v is not None} | {"limit": PAGE_LIMIT}
            if cursor is not None:
                query["cursor"] = cursor
            page = self._json(path, params=query)
            items = _field(page, "items", list, "the page", self.url + path)
            yield from items
            cursor = page.get("next_cursor")
            if cursor is None:
                return
            if not isinstance(cursor, str) or not items:
                raise _malformed(self.url + path, "next_cursor is not a string, or a page with a cursor is empty")

    def iter_entries(self) -> Iterator[dict[str, Any]]:
        """Every entry's metadata, in log order (``GET /v1/entries``, all pages)."""
        return self._pages("/v1/entries", {})

    def list_artifacts(
        self,
        *,
        model: str | None = None,
        profile: str | None = None,
        parent: str | None = None,
        publisher: str | None = None,
        q: str | None = None,
    ) -> Iterator[dict[str, Any]]:
        """Artifacts in log order, filtered as ``GET /v1/artifacts`` filters (all pages)."""
        return self._pages("/v1/artifacts", {"model": model, "profile": profile, "parent": parent, "publisher": publisher, "q": q})

    def list_records(
        self, *, artifact: str | None = None, kind: str | None = None, publisher: str | None = None
    ) -> Iterator[dict[str, Any]]:
        """Records in log order, filtered as ``GET /v1/records`` filters (all pages)."""
        return self._pages("/v1/records", {"artifact": artifact, "type": kind, "publisher": publisher})


# --- the registry key --------------------------------------------------------------------------


@dataclass(frozen=True)
class RegistryKey:
    """The key a registry's checkpoints must be signed with, and how it came to be trusted."""

    public_key: Ed25519PublicKey
    #: The log's origin when known (fetched from the registry); None for a pinned PEM, whose
    #: checkpoints are checked under their own origin line (the signature decides).
    origin: str | None
    #: True for a PEM the caller passed; False for a key fetched from the registry itself.
    pinned: bool
    #: The PEM file, or the URL the key was fetched from.
    source: str

    @property
    def keyid(self) -> str:
        """The key's id (sha256 of its raw public key, hex)."""
        return str(keyid_of(self.public_key))

    @property
    def trust(self) -> str:
        """``pinned`` or ``trust-on-first-use``."""
        return "pinned" if self.pinned else "trust-on-first-use"

    def describe(self) -> str:
        """One phrase for the output."""
        if self.pinned:
            return f"registry key {self.keyid[:16]} (pinned: {self.source})"
        return (
            f"registry key {self.keyid[:16]} fetched from {self.source} (trust on first use: "
            "save its public_key_pem and pass --registry-key to pin it)"
        )

    def to_json(self) -> dict[str, Any]:
        """The key's identity for ``--json`` output."""
        return {
            "keyid": self.keyid, "origin": self.origin, "trust": self.trust, "source": self.source,
            "public_key_pem": public_key_pem(self.public_key).decode("ascii"),
        }

    def verify(self, note: bytes, url: str) -> Checkpoint:
        """Verify a signed checkpoint note served by ``url``; return the checkpoint."""
        # Without a known origin the note's own first line names the key; a note signed by
        # anything but this key fails whatever it claims.
        name = self.origin or note.split(b"\n", 1)[0].decode("utf-8", "replace")
        try:
            return verify_checkpoint(note, name, self.public_key, origin=self.origin)
        except VerificationError as e:
            raise EvidenceError(
                f"the checkpoint from {url} does not verify with {self.describe()}: {e.message}",
                hint="pass the right --registry-key; if it is right, the registry's log was tampered with",
            ) from e


def registry_key(client: RegistryClient, pem: Path | None) -> RegistryKey:
    """The registry key: the PEM file ``pem`` (pinned), else the registry's own (trust on first use)."""
    if pem is not None:
        try:
            return RegistryKey(load_public_key(pem), None, True, str(pem))
        except VerificationError as e:
            raise LocalFilesError(f"--registry-key: {e.message}", hint="pass the registry's registry-key.pub.pem") from e
    doc = client.log_key()
    url = client.url + "/v1/log/key"
    pem_text = _field(doc, "public_key_pem", str, "the log key", url)
    origin = _field(doc, "origin", str, "the log key", url)
    try:
        key = parse_public_key(pem_text.encode("ascii", "replace"), source=f"the public key from {url}")
    except VerificationError as e:
        raise _malformed(url, e.message) from e
    return RegistryKey(key, origin, False, url)


def _verify_entry_evidence(
    url: str, envelope: bytes, entry: dict[str, Any], proof: Any, note: Any, key: RegistryKey
) -> tuple[int, Checkpoint]:
    """Check that ``envelope`` is ``entry``, and is its leaf in the signed checkpoint ``note``.

    Returns (log index, checkpoint). Every registry claim is checked against the bytes.
    """
    digest = _field(entry, "digest", str, "the entry", url)
    index = _field(entry, "log_index", int, "the entry", url)
    if _sha256(envelope) != digest:
        raise EvidenceError(f"{url} says entry {index} has digest {digest}, but its envelope bytes hash to {_sha256(envelope)}")
    leaf = hash_leaf(envelope)
    leaf_hex = entry.get("leaf_hash")
    if leaf_hex is not None and leaf_hex != leaf.hex():
        raise EvidenceError(
            f"{url} says entry {index}'s leaf hash is {leaf_hex}, but SHA-256(0x00 || envelope) is {leaf.hex()}"
        )
    if not isinstance(note, str):
        raise _malformed(url, "the checkpoint is not a string")
    head = key.verify(note.encode("utf-8"), url)
    proof_index = _field(proof, "log_index", int, "the inclusion proof", url)
    proof_size = _field(proof, "tree_size", int, "the inclusion proof", url)
    hashes = _field(proof, "hashes", list, "the inclusion proof", url)
    if proof_index != index or proof_size != head.size:
        raise EvidenceError(
            f"{url}: the inclusion proof is for entry {proof_index} at tree size {proof_size}, "
            f"but the entry is {index} and the checkpoint is at size {head.size}"
        )
    try:
        path = [bytes.fromhex(h) if isinstance(h, str) and len(h) == 64 and set(h) <= _HEX64 else b"" for h in hashes]
        verify_inclusion(leaf, index, head.size, path, head.root_hash)
    except VerificationError as e:
        raise EvidenceError(f"{url}: entry {index} is not proved to be in the signed log: {e.message}") from e
    return index, head


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


def _statement_of(envelope: bytes, what: str) -> Statement:
    try:
        parsed = parse_envelope(envelope, source=what)
        return parse_statement(b64decode_any(parsed.payload, what=f"{what} payload"), what=f"statement in {what}")
    except VerificationError as e:
        raise LocalFilesError(e.message, hint="pass the .dsse.json file as the signer wrote it") from e
    except SchemaError as e:
        raise LocalFilesError(f"{what}: {e}", hint="pass the .dsse.json file as the signer wrote it") from e


def read_local(directory: Path) -> LocalEntry:
    """Read an artifact directory (``statement.dsse.json``) or a record directory (``record.dsse.json``)."""
    if not directory.is_dir():
        raise LocalFilesError(f"{directory} is not a directory")
    for name in (STATEMENT_FILE, RECORD_FILE):
        path = directory / name
        if path.is_file():
            break
    else:
        raise LocalFilesError(f"{directory} holds neither {STATEMENT_FILE} nor {RECORD_FILE}")
    try:
        if path.stat().st_size > MAX_ENVELOPE_BYTES:
            raise LocalFilesError(f"{path} is larger than {MAX_ENVELOPE_BYTES} bytes; it is not an envelope")
        envelope = path.read_bytes()
    except OSError as e:
        raise LocalFilesError(f"cannot read {path}: {e.strerror}") from e
    statement = _statement_of(envelope, str(path))
    if name == STATEMENT_FILE and not isinstance(statement, KvArtifactStatement):
        raise LocalFilesError(f"{path} holds a {statement.predicate_type} statement, not a KV artifact")
    subjects = []
    for s in statement.subject:
        subjects.append((s.name, "sha256:" + s.digest.sha256, _safe_path(directory, s.name, str(path))))
    if name == STATEMENT_FILE and KV_FILE not in {n for n, _, _ in subjects}:
        raise LocalFilesError(f"{path} names no {KV_FILE} subject")
    return LocalEntry(directory, path, envelope, statement, tuple(subjects))


def find_local_artifact(digest: str, near: Path) -> Path | None:
    """An artifact directory whose tensors have ``digest``: the local index, or a sibling of ``near``.

    The same places the engine's ``find_artifact`` looks. A candidate counts only when its
    statement names these tensors and its kv.safetensors hashes to them.
    """
    candidates: list[Path] = []
    with contextlib.suppress(OSError):
        candidates.append(Path((kvgraft_home() / "index" / hex_of(digest)).read_text().strip()))
    with contextlib.suppress(OSError):
        candidates += sorted(p for p in near.resolve().parent.iterdir() if p.is_dir())
    for c in candidates:
        with contextlib.suppress(LocalFilesError, OSError):
            local = read_local(c)
            if local.kind == "artifact" and local.artifact_digest == digest and _file_digest(c / KV_FILE) == digest:
                return c
    return None


def _file_digest(path: Path) -> str:
    with path.open("rb") as f:
        return "sha256:" + hashlib.file_digest(f, "sha256").hexdigest()


# --- publish -----------------------------------------------------------------------------------


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
            "registry": self.registry, "directory": str(self.directory), "kind": self.kind,
            "predicate_type": self.predicate_type, "artifact_digest": self.artifact_digest,
            "log_index": self.log_index, "entry_digest": self.entry_digest, "tree_size": self.tree_size,
            "root_hash": self.root_hash, "created": self.created,
            "blobs": {"uploaded": list(self.uploaded), "uploaded_bytes": self.uploaded_bytes, "skipped": list(self.skipped)},
            "registry_key": self.registry_key.to_json(),
            "parents": [p.to_json() for p in self.parents], "notes": list(self.notes),
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
        parent_result, note = _ensure_parent(client, local, key, publish_parents=publish_parents, progress=progress, depth=depth)
        if parent_result is not None:
            parents += [*parent_result.parents, parent_result]
        if note:
            notes.append(note)

    # One path per digest: two subjects with the same bytes are one blob.
    wanted = dict((d, p) for _, d, p in reversed(local.subjects))
    missing = [(d, p) for d, p in wanted.items() if client.blob_size(d) is None]
    skipped = tuple(d for d in wanted if d not in dict(missing))
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
    with _progress(progress, sum(sizes), f"publish {directory.name}") as bar:
        for (d, p), size in zip(missing, sizes, strict=True):
            _upload_file(client, d, p, size, bar)
            uploaded_bytes += size

    doc, created = client.post_entry(local.envelope)
    url = client.url + "/v1/entries"
    entry = _field(doc, "entry", dict, "the answer", url)
    index, head = _verify_entry_evidence(url, local.envelope, entry, doc.get("inclusion_proof"), doc.get("checkpoint"), key)
    return PublishResult(
        registry=client.url, directory=directory, kind=local.kind, predicate_type=local.statement.predicate_type,
        artifact_digest=local.artifact_digest, log_index=index, entry_digest=_sha256(local.envelope),
        tree_size=head.size, root_hash=head.root_hash.hex(), created=created, uploaded=tuple(d for d, _ in missing),
        uploaded_bytes=uploaded_bytes, skipped=skipped, registry_key=key, parents=tuple(parents), notes=tuple(notes),
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


# --- pull --------------------------------------------------------------------------------------


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
        if self.signature_checked:
            return "signature verified: signed by " + ", ".join(self.signers)
        return "signature NOT checked (no --trusted-keys given)"

    def to_json(self) -> dict[str, Any]:
        """A JSON object for ``--json`` output."""
        return {
            "registry": self.registry, "directory": str(self.directory), "artifact_digest": self.artifact_digest,
            "parent": self.parent, "positions": list(self.positions), "log_index": self.log_index, "entry_digest": self.entry_digest,
            "tree_size": self.tree_size, "root_hash": self.root_hash, "files": list(self.files), "size": self.size,
            "signature_checked": self.signature_checked, "signers": list(self.signers),
            "registry_key": self.registry_key.to_json(), "parents": [p.to_json() for p in self.parents],
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

    Everything is written to a temporary directory beside ``out`` and checked there: every
    blob's sha256 while it streams, the envelope's signature against ``trusted_keys`` (when
    given; otherwise the result says it was not checked), that the statement is about exactly
    these files, and that the envelope is in the log (inclusion proof against a checkpoint
    signed by the registry key). Only then is the directory renamed to ``out``; on any failure
    nothing appears at ``out`` and the temporary directory is removed. With ``with_parents``
    the parent chain is pulled too, into ``OUT.parent-1`` (the parent), ``OUT.parent-2``, ...
    beside ``out``, where the engine finds them; all of them appear, or none.
    """
    digest = _digest(digest, "artifact digest")
    if out.exists() or out.is_symlink():
        raise LocalFilesError(f"{out} already exists", hint="pull into a new directory")
    key = registry_key(client, registry_key_file)
    temps: list[Path] = []
    results: list[PullResult] = []
    placed: list[Path] = []
    try:
        current: str | None = digest
        while current is not None:
            if len(results) > MAX_CHAIN:
                raise EvidenceError(f"the parent chain of {digest} is longer than {MAX_CHAIN} (a cycle?)")
            target = out if not results else out.with_name(f"{out.name}.parent-{len(results)}")
            if target.exists() or target.is_symlink():
                raise LocalFilesError(f"{target} already exists", hint="pull into a new directory")
            target.parent.mkdir(parents=True, exist_ok=True)
            temps.append(Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.pull-")))
            result = _stage(client, current, temps[-1], target, key, trusted_keys, progress)
            if results:
                _check_link(client.url, results[-1], result)
            results.append(result)
            current = result.parent if with_parents else None
        # Root first, so that a child never appears without its parents.
        for tmp, result in zip(reversed(temps), reversed(results), strict=True):
            os.rename(tmp, result.directory)
            placed.append(result.directory)
        _fsync_dir(out.parent)
    except BaseException:
        for tmp in temps:
            shutil.rmtree(tmp, ignore_errors=True)
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


def _stage(
    client: RegistryClient,
    digest: str,
    tmp: Path,
    target: Path,
    key: RegistryKey,
    trusted: TrustedKeys | None,
    progress: bool,
) -> PullResult:
    url = f"{client.url}/v1/artifacts/{digest}"
    doc = client.artifact(digest)
    entry = _field(doc, "entry", dict, "the artifact document", url)
    entry_digest = _field(entry, "digest", str, "the entry", url)
    envelope = client.envelope(_digest(entry_digest, "entry digest"))
    index, head = _verify_entry_evidence(url, envelope, entry, doc.get("inclusion_proof"), doc.get("checkpoint"), key)

    # The statement is read from the logged envelope bytes, never from the server's decoded copy.
    signers: tuple[str, ...] = ()
    try:
        parsed = parse_envelope(envelope, source=f"the envelope of entry {index}")
        if trusted is not None:
            verified, statement = verify_statement_envelope(parsed, trusted)
            signers = tuple(k.name for k in verified.signers)
        else:
            statement = parse_statement(b64decode_any(parsed.payload, what="envelope payload"), what=f"statement of entry {index}")
    except (UnknownKeyError, BadSignatureError, ThresholdNotMetError) as e:
        raise EnvelopeSignatureError(f"artifact {digest} (entry {index} of {client.url}): {e.message}", hint=e.hint) from e
    except VerificationError as e:
        raise EvidenceError(f"the envelope of entry {index} of {client.url} is not usable: {e.message}") from e
    except SchemaError as e:
        raise EvidenceError(f"the statement of entry {index} of {client.url} is not valid: {e}") from e
    if not isinstance(statement, KvArtifactStatement):
        raise EvidenceError(f"entry {index} of {client.url} is a {statement.predicate_type} statement, not a KV artifact")
    subjects = {s.name: "sha256:" + s.digest.sha256 for s in statement.subject}
    if subjects.get(KV_FILE) != digest:
        raise EvidenceError(
            f"{client.url} answered for artifact {digest} with entry {index}, whose statement is about "
            f"{KV_FILE} {subjects.get(KV_FILE)}",
            hint="the registry served the wrong artifact; report it to the registry's operator",
        )

    files = []
    size = 0
    with _progress(progress, None, f"pull {target.name}") as bar:
        for name, subject_digest in subjects.items():
            path = _safe_path(tmp, name, f"entry {index}")
            path.parent.mkdir(parents=True, exist_ok=True)
            size += client.download_blob(subject_digest, path, progress=bar)
            files.append(name)
    envelope_path = tmp / STATEMENT_FILE
    if STATEMENT_FILE in subjects:
        raise EvidenceError(f"entry {index} names a subject {STATEMENT_FILE}, which would overwrite the envelope")
    with envelope_path.open("xb") as f:
        f.write(envelope)
        f.flush()
        os.fsync(f.fileno())
    try:
        verify_subjects(statement, tmp, exclude=[envelope_path])
    except VerificationError as e:
        raise EvidenceError(f"the files pulled for {digest} are not the statement's subjects: {e.message}") from e
    _fsync_dir(tmp)
    p = statement.predicate
    return PullResult(
        registry=client.url, directory=target, artifact_digest=digest, parent=str(p.parent) if p.parent else None,
        log_index=index, entry_digest=entry_digest, tree_size=head.size, root_hash=head.root_hash.hex(),
        files=tuple(sorted(files)), size=size, signers=signers, signature_checked=trusted is not None, registry_key=key,
        positions=(p.positions.start, p.positions.end),
    )


# --- mirror ------------------------------------------------------------------------------------


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
            "source": self.source, "target": self.target, "start_size": self.start_size, "copied_size": self.copied_size,
            "copied_entries": self.copied_entries, "blobs_copied": list(self.blobs_copied), "blobs_skipped": self.blobs_skipped,
            "bytes_copied": self.bytes_copied, "source_root": self.source_root,
            "target_root_at_copied": self.target_root_at_copied, "target_size": self.target_size,
            "target_root": self.target_root, "source_key": self.source_key.to_json(),
            "target_key": self.target_key.to_json(), "notes": list(self.notes),
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
    source's (checked by comparing signed roots) or ``MirrorDivergedError``. The source's size
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
    source_head = source_key.verify(source.checkpoint(), source.url)
    target_head = target_key.verify(target.checkpoint(), target.url)
    n = source_head.size
    start = target_head.size
    common = min(n, start)
    if common:
        # The target must hold exactly the source's first entries, else copying would misplace them.
        source_common = source_key.verify(source.checkpoint(common), source.url)
        target_common = target_key.verify(target.checkpoint(common), target.url)
        if source_common.size != common or target_common.size != common:
            raise EvidenceError(f"asked for checkpoints at size {common}, got sizes {source_common.size} and {target_common.size}")
        if source_common.root_hash != target_common.root_hash:
            raise MirrorDivergedError(
                f"the first {common} entries of {target.url} are not those of {source.url} "
                f"(roots {target_common.root_hash.hex()[:16]} and {source_common.root_hash.hex()[:16]} differ)"
            )
    notes = []
    if start > n:
        notes.append(f"the target already holds {start - n} entries past the source's {n}")

    copied = 0
    blobs_copied: list[str] = []
    blobs_skipped = 0
    bytes_copied = 0
    present: set[str] = set()
    tokens: list[str | None] = [None, *extra_tokens]
    entries = source.iter_entries() if start < n else iter(())
    with _progress(progress, max(n - start, 0), f"mirror {source.url} -> {target.url}", unit="entry") as bar:
        # Metadata is listed from the start (the API's cursors are opaque); only entries from
        # the target's size on are copied.
        for item in entries:
            index = _field(item, "log_index", int, "an entry", source.url + "/v1/entries")
            if index < start:
                continue
            if index >= n:
                break
            if index != start + copied:
                raise EvidenceError(f"{source.url} listed entry {index} where entry {start + copied} was due")
            envelope = _source_envelope(source, item, index)
            for blob in _blobs_of(item, source.url):
                if blob in present:
                    continue
                if target.blob_size(blob) is None:
                    bytes_copied += _copy_blob(source, target, blob)
                    blobs_copied.append(blob)
                else:
                    blobs_skipped += 1
                present.add(blob)
            doc = _post_with_tokens(target, envelope, tokens, index)
            entry = _field(doc, "entry", dict, "the answer", target.url + "/v1/entries")
            if entry.get("log_index") != index or entry.get("digest") != item["digest"]:
                raise MirrorDivergedError(
                    f"{target.url} logged source entry {index} ({item['digest']}) as entry {entry.get('log_index')}: "
                    "something else was published to the target meanwhile"
                )
            copied += 1
            bar.update(1)
    if start + copied < n:
        raise EvidenceError(f"{source.url} listed entries only up to {start + copied - 1}, but its checkpoint is at size {n}")

    # The proof, from signed checkpoints only.
    final = target_key.verify(target.checkpoint(), target.url)
    at_n = target_key.verify(target.checkpoint(n), target.url)
    if at_n.size != n:
        raise EvidenceError(f"{target.url} answered for its checkpoint at size {n} with size {at_n.size}")
    if at_n.root_hash != source_head.root_hash:
        raise MirrorDivergedError(
            f"after copying, {target.url} at size {n} has root {at_n.root_hash.hex()}, "
            f"but {source.url} at size {n} has root {source_head.root_hash.hex()}"
        )
    proof = target.consistency_proof(n, final.size)
    purl = target.url + "/v1/log/proof/consistency"
    if _field(proof, "old_size", int, "the consistency proof", purl) != n or _field(
        proof, "new_size", int, "the consistency proof", purl
    ) != final.size:
        raise EvidenceError(f"{purl}: the proof is not from size {n} to size {final.size}")
    hashes = _field(proof, "hashes", list, "the consistency proof", purl)
    try:
        path = [bytes.fromhex(h) if isinstance(h, str) and len(h) == 64 and set(h) <= _HEX64 else b"" for h in hashes]
        verify_consistency(n, final.size, source_head.root_hash, final.root_hash, path)
    except VerificationError as e:
        raise EvidenceError(f"{target.url}'s log at size {final.size} is not proved to extend the source's at size {n}: {e.message}") from e
    return MirrorResult(
        source=source.url, target=target.url, start_size=start, copied_size=n, copied_entries=copied,
        blobs_copied=tuple(blobs_copied), blobs_skipped=blobs_skipped, bytes_copied=bytes_copied,
        source_root=source_head.root_hash.hex(), target_root_at_copied=at_n.root_hash.hex(), target_size=final.size,
        target_root=final.root_hash.hex(), source_key=source_key, target_key=target_key, notes=tuple(notes),
    )


def _source_envelope(source: RegistryClient, item: dict[str, Any], index: int) -> bytes:
    url = f"{source.url}/v1/entries/{index}/envelope"
    digest = _field(item, "digest", str, f"entry {index}", source.url + "/v1/entries")
    leaf = _field(item, "leaf_hash", str, f"entry {index}", source.url + "/v1/entries")
    envelope = source.envelope(index)
    if _sha256(envelope) != digest or hash_leaf(envelope).hex() != leaf:
        raise EvidenceError(f"{url}: the envelope bytes hash to {_sha256(envelope)}, not the entry's digest {digest} and leaf")
    return envelope


def _blobs_of(item: dict[str, Any], url: str) -> list[str]:
    # What the target will require before it accepts the entry: every subject, and a child
    # artifact's parent tensors.
    subjects = _field(item, "subjects", list, "an entry", url)
    blobs = [_digest(_field(s, "digest", str, "a subject", url), "subject digest") for s in subjects]
    artifact = item.get("artifact")
    if isinstance(artifact, dict) and isinstance(artifact.get("parent"), str):
        blobs.append(_digest(artifact["parent"], "parent digest"))
    return list(dict.fromkeys(blobs))


def _copy_blob(source: RegistryClient, target: RegistryClient, digest: str) -> int:
    h = hashlib.sha256()
    sent = 0
    with source.open_blob(digest) as (length, chunks):
        if length is None:
            raise _malformed(f"{source.url}/v1/blobs/{digest}", "the blob came without a Content-Length")

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
                raise BlobDigestError(f"{source.url} served {sent} bytes for blob {digest} that hash to {got}; the target kept nothing") from e
            raise
    if "sha256:" + h.hexdigest() != digest:
        raise BlobDigestError(f"{source.url} served bytes for blob {digest} that hash to sha256:{h.hexdigest()}")
    return sent


def _post_with_tokens(target: RegistryClient, envelope: bytes, tokens: Sequence[str | None], index: int) -> dict[str, Any]:
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
                    status=e.status, problem=e.problem,
                ) from e
            raise
    raise RegistryClientError("no token to publish with", hint="pass --token")  # unreachable: tokens has one entry

