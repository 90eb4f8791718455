"""The Litestar app: routes, RFC 9457 problem responses, and the lifespan that owns the registry.

Handlers are thin: they parse the request, run the blocking registry call in a worker thread
(DuckDB and file I/O never run on the event loop), and shape the response. Blob bodies stream
both ways in fixed-size chunks.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import hmac
import json
import logging
import os
import re
import secrets
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Annotated, Any, TypeVar

import anyio
import anyio.to_thread
from litestar import Litestar, Request, Response, get, head, post, put
from litestar.connection import ASGIConnection
from litestar.exceptions import HTTPException
from litestar.handlers.base import BaseRouteHandler
from litestar.params import FromPath, FromQuery, QueryParameter
from litestar.response import Stream
from pydantic import BaseModel

import kvgraft
from kvgraft.schemas import (
    MAX_TREE_SIZE,
    ArtifactDocument,
    ArtifactPage,
    BlobStored,
    ConsistencyProof,
    DigestMatches,
    EntryDocument,
    EntryPage,
    InclusionProof,
    LogKey,
    PublisherList,
    dump_wire,
)

from .. import queries
from ..accounts import TokenInfo
from ..blobs.store import WHOLE_READ_BYTES, parse_digest_ref
from ..datadir import AdminHandle, remove_admin_handle, write_admin_handle
from ..documents import Page
from ..entries import json_depth_within, kind_of_filter
from ..errors import (
    AdminAuthError,
    BadRequestError,
    DocumentTooDeepError,
    PayloadTooLargeError,
    RegistryError,
)
from ..log.cosignatures import MAX_WITNESSES
from ..publishing import Published
from ..ranges import if_range_allows, none_match, parse_range
from ..readcache import EnvelopeCache
from ..service import Registry
from ..settings import RegistrySettings
from ..tiles import CHECKPOINT_CACHE, IMMUTABLE, TILES_PREFIX, tile_resource
from .openapi import registry_openapi_config
from .problems import HttpEdge, http_error, internal_error, read_limited, registry_error
from .security import add_security_headers
from .ui import static_router, ui_router

logger = logging.getLogger("kvgraft.registry")

#: Admin secrets start with this, so one is never mistaken for a publisher token.
ADMIN_SECRET_PREFIX = "kvgadm_"

T = TypeVar("T")


# --- helpers -----------------------------------------------------------------------------------


def _registry(connection: ASGIConnection[Any, Any, Any, Any]) -> Registry:
    registry: Registry = connection.app.state.registry
    return registry


async def _run(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    return await anyio.to_thread.run_sync(functools.partial(fn, *args, **kwargs))


async def _authenticate(request: Request[Any, Any, Any]) -> TokenInfo:
    return await _run(_registry(request).authenticate, request.headers.get("authorization"))


async def read_guard(connection: ASGIConnection[Any, Any, Any, Any], _: BaseRouteHandler) -> None:
    """Reads are public unless ``reads_require_token`` is set."""
    registry = _registry(connection)
    if registry.settings.reads_require_token:
        await _run(registry.authenticate, connection.headers.get("authorization"))


#: A whole number in a query string: ASCII digits only ('³'.isdigit() is true in Python), no sign.
_DECIMAL = re.compile(r"[0-9]{1,1000}", re.ASCII)
#: Any integer, for a parameter whose out-of-range values are answered 404 (a checkpoint at a size
#: that never was); bounded in length so int() stays cheap.
_INTEGER = re.compile(r"-?[0-9]{1,1000}", re.ASCII)


def _int_query(value: str | None, name: str, *, low: int = 0, high: int | None = MAX_TREE_SIZE) -> int | None:
    """The integer query parameter ``name`` (None when absent), within ``low..high``, or a 400.

    ``high=None``: any integer, unchecked (the caller answers out-of-range values itself).
    Parsed here rather than by Litestar, whose ``int | None`` reads the text ``null`` as absent.
    """
    if value is None:
        return None
    if high is None:
        if _INTEGER.fullmatch(value) is None:
            raise BadRequestError(
                f"query {name}: {value[:40]!r} is not a whole number", hint=f"pass {name} as decimal ASCII digits"
            )
        return int(value)
    if _DECIMAL.fullmatch(value) is None:
        raise BadRequestError(
            f"query {name}: {value[:40]!r} is not a whole number", hint=f"pass {name} as decimal ASCII digits"
        )
    number = int(value)
    if not low <= number <= high:
        raise BadRequestError(f"query {name}: {number} is not between {low} and {high}")
    return number


def _required_int(value: str, name: str) -> int:
    number = _int_query(value, name)
    if number is None:  # pragma: no cover (Litestar answers 400 for a missing required parameter)
        raise BadRequestError(f"query {name} is required")
    return number


def _limit(registry: Registry, text: str | None) -> int:
    settings = registry.settings
    if text is None:
        return settings.default_page_limit
    limit = _int_query(text, "limit", high=1 << 64)
    if limit is None:  # pragma: no cover (text is not None)
        return settings.default_page_limit
    if not 1 <= limit <= settings.max_page_limit:
        raise BadRequestError(f"limit {limit} must be between 1 and {settings.max_page_limit}")
    return limit


def _page(page: Page, **extra: Any) -> dict[str, Any]:
    return {"items": page.items, "next_cursor": page.next_cursor, **extra}


_M = TypeVar("_M", bound=BaseModel)


def _wire(model: type[_M], document: Any) -> _M:
    """The service's ``document`` as the wire model ``model`` (the type the handler declares)."""
    return model.model_validate(document)


def _blob_hex(digest: str) -> str:
    # The path parameter keeps its leading '/', and may hold further '/' or '..': all refused.
    return parse_digest_ref(digest[1:] if digest.startswith("/") else digest, what="blob digest")


# --- blobs -------------------------------------------------------------------------------------


@put("/v1/blobs/{digest:path}", request_max_body_size=None, status_code=201, summary="Upload a blob")
async def put_blob(request: Request[Any, Any, Any], digest: FromPath[str]) -> Response[BlobStored]:
    """Upload the bytes whose sha256 is ``digest``, streamed; 201 when new, 200 when already stored.

    Needs a bearer token. Bytes that hash to another digest are refused (400) and not kept.
    """
    registry = _registry(request)
    await _authenticate(request)
    hex_digest = _blob_hex(digest)
    limit = registry.settings.max_blob_bytes
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLargeError(f"the blob is {declared} bytes; this registry accepts at most {limit}", extra={"limit": limit})
    size_hint = int(declared) if declared is not None else None
    created = await registry.blobs.receive(hex_digest, request.stream(), max_bytes=limit, declared_size=size_hint)
    size = await _run(registry.blobs.size, hex_digest)
    ref = "sha256:" + hex_digest
    return Response(
        content=BlobStored(digest=ref, size=size or 0, created=created),
        status_code=201 if created else 200,
        headers={"Location": f"/v1/blobs/{ref}", "ETag": f'"{ref}"'},
    )


def _blob_headers(hex_digest: str) -> dict[str, str]:
    return {"ETag": f'"sha256:{hex_digest}"', "Accept-Ranges": "bytes", "Cache-Control": IMMUTABLE}


async def _blob_size(registry: Registry, hex_digest: str) -> int:
    """The blob's size for an answer that sends none of its bytes (HEAD, 304) or only a range.

    A blob this process verified is answered from memory (no thread hop, no disk). Otherwise
    404 blob-quarantined for a blob moved aside as damaged, 404 blob-not-found when never stored;
    a small one is re-hashed first, so that rot is caught (and quarantined) before a byte goes out.
    """
    size = registry.blobs.verified_size(hex_digest)
    if size is not None:
        return size
    size = await _run(registry.blobs.require, hex_digest)
    if size <= registry.settings.verify_on_read_bytes:
        await _run(registry.blobs.verify, hex_digest)
    return size


@head("/v1/blobs/{digest:path}", guards=[read_guard], summary="Blob size and ETag")
async def head_blob(request: Request[Any, Any, Any], digest: FromPath[str]) -> Response[None]:
    """The headers GET would send: Content-Length, ETag, Accept-Ranges (404 when absent)."""
    registry = _registry(request)
    hex_digest = _blob_hex(digest)
    size = await _blob_size(registry, hex_digest)
    headers = _blob_headers(hex_digest)
    if none_match(request.headers.get("if-none-match"), headers["ETag"]):
        return Response(content=None, status_code=304, headers=headers)
    # Litestar requires a HEAD handler to be annotated Response[None], yet renders content=None
    # only for text and JSON media types: the empty bytes are the body it sends (none).
    return Response(content=b"", headers={**headers, "Content-Length": str(size)},  # type: ignore[arg-type]
                    media_type="application/octet-stream")


@get("/v1/blobs/{digest:path}", guards=[read_guard], summary="Download a blob")
async def get_blob(request: Request[Any, Any, Any], digest: FromPath[str]) -> Response[Any]:
    """Stream a blob. Honours If-None-Match (304), Range (206, several ranges as multipart/byteranges,
    416 when none overlaps) and If-Range."""
    registry = _registry(request)
    blobs = registry.blobs
    hex_digest = _blob_hex(digest)
    headers = _blob_headers(hex_digest)
    etag = headers["ETag"]
    if none_match(request.headers.get("if-none-match"), etag):
        await _blob_size(registry, hex_digest)  # 404 for a blob not (or no longer) here
        return Response(content=None, status_code=304, headers=headers)
    # A blob up to WHOLE_READ_BYTES: read once, hashed, sent in one piece (a range as a slice of
    # those verified bytes); rot raises here, before the status line goes out.
    size, whole = await blobs.fetch_whole(hex_digest, WHOLE_READ_BYTES)
    ranges = parse_range(request.headers.get("range"), size) if if_range_allows(request.headers.get("if-range"), etag) else None
    if whole is not None and (ranges is None or len(ranges) == 1):
        first, last = (0, size - 1) if ranges is None else ranges[0]
        part = {} if ranges is None else {"Content-Range": f"bytes {first}-{last}/{size}"}
        return Response(
            content=whole if ranges is None else whole[first : last + 1],
            status_code=200 if ranges is None else 206,
            headers={**headers, **part},
            media_type="application/octet-stream",
        )
    if whole is None and ranges is not None and size <= registry.settings.verify_on_read_bytes:
        # A range of a blob too large to read whole, yet small enough to re-hash on every read.
        await _run(blobs.verify, hex_digest)
    if ranges is None:
        # Hashed while streamed; on a mismatch the response is cut short before its last chunk.
        return Stream(
            blobs.read_checked(hex_digest, size),
            headers={**headers, "Content-Length": str(size)},
            media_type="application/octet-stream",
        )
    if len(ranges) == 1:
        first, last = ranges[0]
        return Stream(
            blobs.read(hex_digest, first, last + 1),
            status_code=206,
            headers={**headers, "Content-Length": str(last - first + 1), "Content-Range": f"bytes {first}-{last}/{size}"},
            media_type="application/octet-stream",
        )
    boundary = secrets.token_hex(16)
    heads = [
        (b"" if i == 0 else b"\r\n")
        + f"--{boundary}\r\nContent-Type: application/octet-stream\r\nContent-Range: bytes {a}-{b}/{size}\r\n\r\n".encode("ascii")
        for i, (a, b) in enumerate(ranges)
    ]
    tail = f"\r\n--{boundary}--\r\n".encode("ascii")
    length = sum(len(h) for h in heads) + sum(b - a + 1 for a, b in ranges) + len(tail)

    async def parts() -> AsyncIterator[bytes]:
        for part_head, (a, b) in zip(heads, ranges, strict=True):
            yield part_head
            if whole is not None:
                yield whole[a : b + 1]
                continue
            async for chunk in blobs.read(hex_digest, a, b + 1):
                yield chunk
        yield tail

    return Stream(
        parts(),
        status_code=206,
        headers={**headers, "Content-Length": str(length)},
        media_type=f"multipart/byteranges; boundary={boundary}",
    )


# --- entries -----------------------------------------------------------------------------------


@post("/v1/entries", request_max_body_size=None, status_code=201, summary="Publish a signed envelope")
async def post_entry(request: Request[Any, Any, Any]) -> Response[EntryDocument]:
    """Publish a DSSE envelope (the request body, stored byte for byte as the log leaf's data).

    Needs a bearer token bound to a key that signed it. 201 with the entry, its inclusion
    proof and the new checkpoint; 200 with the same when these exact bytes are already logged.
    """
    registry = _registry(request)
    # On its way to the sequencer from here: an open batch waits for it (up to batch_wait_ms).
    sequencer = registry.publisher.sequencer
    with sequencer.arriving() if sequencer is not None else contextlib.nullcontext():
        token = await _authenticate(request)
        body = await read_limited(request, registry.settings.max_envelope_bytes, "envelope")
        # Verified in a worker thread, concurrently with other publishes; then queued for the
        # sequencer, whose batch answers it once durable: no thread waits meanwhile.
        prepared = await _run(registry.publisher.prepare_publish, body, token)
        pending = prepared if isinstance(prepared, Published) else registry.publisher.submit(prepared)
    published = pending if isinstance(pending, Published) else await asyncio.wrap_future(pending)
    index = published.document["entry"]["log_index"]
    return Response(
        content=_wire(EntryDocument, published.document),
        status_code=201 if published.created else 200,
        headers={"Location": f"/v1/entries/{index}"},
    )


@get("/v1/entries", guards=[read_guard], summary="Entries in log order")
async def list_entries(
    request: Request[Any, Any, Any], cursor: FromQuery[str | None] = None, limit: FromQuery[str | None] = None
) -> EntryPage:
    """Every entry's metadata in log order, paginated (for mirrors and auditors)."""
    registry = _registry(request)
    page = await _run(registry.reader.list_entries, cursor, _limit(registry, limit))
    return _wire(EntryPage, _page(page))


@get("/v1/entries/{ref:str}", guards=[read_guard], summary="One entry")
async def get_entry(request: Request[Any, Any, Any], ref: FromPath[str]) -> EntryDocument:
    """An entry by log index or envelope digest: metadata, inclusion proof and the latest checkpoint."""
    return _wire(EntryDocument, await _run(_registry(request).reader.entry, ref))


@get("/v1/entries/{ref:str}/envelope", guards=[read_guard], summary="An entry's envelope bytes")
async def get_envelope(request: Request[Any, Any, Any], ref: FromPath[str]) -> Response[bytes]:
    """The envelope exactly as posted: the bytes the log leaf hashes."""
    # Entries never change once logged: one read from the database serves every later request
    # (and its 304) from memory, without a thread hop.
    cache: EnvelopeCache = request.app.state.envelopes
    found = cache.get(ref)
    if found is None:
        data, digest = await _run(_registry(request).reader.envelope, ref)
        found = cache.put(ref, digest, data)
    etag = f'"{found.digest}"'
    headers = {"ETag": etag, "Cache-Control": IMMUTABLE}
    if none_match(request.headers.get("if-none-match"), etag):
        return Response(content=b"", status_code=304, headers=headers)
    return Response(content=found.data, media_type="application/json", headers=headers)


# --- the log -----------------------------------------------------------------------------------


@get("/v1/log/checkpoint", guards=[read_guard], summary="The latest signed checkpoint")
async def get_checkpoint(
    request: Request[Any, Any, Any], tree_size: FromQuery[str | None] = None, witnessed: FromQuery[str | None] = None
) -> Response[bytes]:
    """The latest (or ``tree_size``'s) C2SP signed checkpoint note, as text, with the witness
    cosignature lines the registry holds for it; ``witnessed=K``: the newest one cosigned by at
    least K witnesses (404 when none is yet)."""
    # A size outside the log (negative, or past 2^63-1 too) names no checkpoint: 404, from the service.
    size = _int_query(tree_size, "tree_size", high=None)
    count = _int_query(witnessed, "witnessed", high=MAX_WITNESSES)
    registry = _registry(request)

    def read() -> tuple[bytes, int]:
        return registry.checkpoint(size, witnessed=count), registry.head.size

    note, latest = await _run(read)
    # The note at a tree size below the latest is fixed for good (a cache may keep it; witness
    # cosignations that arrive later are then only in fresh answers); the latest one moves on.
    old = size is not None and size < latest
    return Response(content=note, media_type="text/plain", headers={"Cache-Control": IMMUTABLE if old else CHECKPOINT_CACHE})


@get("/v1/log/key", guards=[read_guard], summary="The log's public key and origin")
async def get_log_key(request: Request[Any, Any, Any]) -> LogKey:
    """The registry's Ed25519 public key (PEM), key id, note verifier key and origin."""
    return _wire(LogKey, await _run(_registry(request).log_key))


@get("/v1/log/proof/inclusion", guards=[read_guard], summary="Inclusion proof")
async def get_inclusion(
    request: Request[Any, Any, Any], index: FromQuery[str], tree_size: FromQuery[str | None] = None
) -> InclusionProof:
    """``{"log_index", "tree_size", "hashes"}`` for entry ``index`` (tree size default: latest).

    404 when the log has no tree of ``tree_size`` yet, or the entry is not in it: what was asked
    for does not exist (as for a checkpoint), though the numbers themselves are well formed.
    """
    entry, size = _required_int(index, "index"), _int_query(tree_size, "tree_size")
    return _wire(InclusionProof, await _run(_registry(request).inclusion_proof, entry, size))


@get("/v1/log/proof/consistency", guards=[read_guard], summary="Consistency proof")
async def get_consistency(
    request: Request[Any, Any, Any], old: FromQuery[str], new: FromQuery[str | None] = None
) -> ConsistencyProof:
    """``{"old_size", "new_size", "hashes"}`` between two tree sizes (new default: latest).

    404 when the log has no tree of ``new`` yet, or ``old`` is larger than ``new`` (no such proof).
    """
    old_size, new_size = _required_int(old, "old"), _int_query(new, "new")
    return _wire(ConsistencyProof, await _run(_registry(request).consistency_proof, old_size, new_size))


# --- the log as c2sp.org/tlog-tiles (registry/_internal/tiles.py) --------------------------------
# Not in the OpenAPI document: c2sp.org/tlog-tiles is their contract, and OpenAPI cannot state a
# path parameter spanning several segments (x001/x234/067.p/5); docs/registry.md lists them.


@get(TILES_PREFIX + "/checkpoint", guards=[read_guard], include_in_schema=False)
async def get_tiles_checkpoint(request: Request[Any, Any, Any]) -> Response[bytes]:
    """The tiled log's checkpoint: the note GET /v1/log/checkpoint serves, as tlog-tiles types it."""
    note = await _run(_registry(request).checkpoint)
    # Litestar adds "; charset=utf-8" to text types: the spec's exact Content-Type.
    return Response(content=note, media_type="text/plain", headers={"Cache-Control": CHECKPOINT_CACHE})


@get(TILES_PREFIX + "/tile/{path:path}", guards=[read_guard], include_in_schema=False)
async def get_tile(request: Request[Any, Any, Any], path: FromPath[str]) -> Response[bytes]:
    """A hash tile or entry bundle (c2sp.org/tlog-tiles); 304 when If-None-Match has its ETag."""
    # The path as sent (ASGI raw_path, still percent-encoded), not ``path``: the router drops a
    # trailing slash and merges "//", which would make tile/0/000/ an alias of tile/0/000, and
    # tlog-tiles paths have one spelling (an encoded character is never part of it).
    raw = request.scope.get("raw_path")
    sent = raw.decode("latin-1") if isinstance(raw, bytes) else f"{TILES_PREFIX}/tile{path}"
    tail = sent.partition(TILES_PREFIX + "/tile/")[2]
    found = await _run(tile_resource, _registry(request), "tile/" + tail, request.headers.get("if-none-match"))
    headers = {"ETag": found.etag, "Cache-Control": found.cache_control}
    if found.body is None:
        return Response(content=b"", status_code=304, headers=headers)
    return Response(content=found.body, media_type="application/octet-stream", headers=headers)


# --- artifacts, records, publishers ------------------------------------------------------------


@get("/v1/artifacts", guards=[read_guard], summary="List artifacts")
async def list_artifacts(
    request: Request[Any, Any, Any],
    model: FromQuery[str | None] = None,
    profile: FromQuery[str | None] = None,
    parent: FromQuery[str | None] = None,
    publisher: FromQuery[str | None] = None,
    q: FromQuery[str | None] = None,
    cursor: FromQuery[str | None] = None,
    limit: FromQuery[str | None] = None,
) -> ArtifactPage:
    """KV artifacts in log order, filtered by model name, profile name, parent digest (``none``
    for roots), publisher and words of the source text (``q``, all must occur), paginated."""
    registry = _registry(request)
    if parent is not None and parent != "none":
        # Given but empty or malformed is a 400, as the schema says (the service skips an empty one).
        parse_digest_ref(parent, what="parent")
    page = await _run(
        registry.reader.list_artifacts,
        model=model, profile=profile, parent=parent, publisher=publisher, q=q, cursor=cursor, limit=_limit(registry, limit),
    )
    return _wire(ArtifactPage, _page(page))


@get("/v1/artifacts/{digest:str}", guards=[read_guard], summary="One artifact")
async def get_artifact(
    request: Request[Any, Any, Any], digest: FromPath[str], signer: FromQuery[str | None] = None
) -> ArtifactDocument:
    """An artifact by its tensors' digest: statement, envelope, entry, lineage, inclusion proof, checkpoint.

    The entry is the first signed by key ``signer`` (a key id) when given, else the first logged;
    ``other_entries`` lists every other claim on the same tensors, with its signers' key ids."""
    parse_digest_ref(digest, what="artifact digest")
    return _wire(ArtifactDocument, await _run(_registry(request).reader.artifact, digest, signer))


@get("/v1/records", guards=[read_guard], summary="List records")
async def list_records(
    request: Request[Any, Any, Any],
    artifact: FromQuery[str | None] = None,
    kind: Annotated[str | None, QueryParameter(name="type")] = None,
    publisher: FromQuery[str | None] = None,
    cursor: FromQuery[str | None] = None,
    limit: FromQuery[str | None] = None,
) -> EntryPage:
    """Records (exactness, evaluation, pre-registration, replay) in log order; ``artifact`` keeps
    those that name the artifact (as subject, sample prefix, library entry or parent)."""
    registry = _registry(request)
    if artifact is not None:
        parse_digest_ref(artifact, what="artifact")
    if kind is not None:
        kind_of_filter(kind)
    page = await _run(
        registry.reader.list_records, artifact=artifact, kind=kind, publisher=publisher, cursor=cursor, limit=_limit(registry, limit)
    )
    return _wire(EntryPage, _page(page))


@get("/v1/publishers", guards=[read_guard], summary="Publishers and their keys")
async def list_publishers(request: Request[Any, Any, Any]) -> PublisherList:
    """Every publisher with its registered key ids and public keys."""
    return _wire(PublisherList, {"publishers": await _run(_registry(request).reader.publishers)})


def _digest_matches(registry: Registry, prefix: str, artifacts_only: bool) -> dict[str, Any]:
    """``GET /v1/digests/{prefix}``'s document (``DigestMatches``), read under the database lock."""
    hex_part = queries.parse_digest_prefix(prefix)
    if hex_part is None:
        raise BadRequestError(f"{prefix[:80]!r} is not a short digest",
                              hint="pass sha256: and 4 to 64 lowercase hex digits (or the hex digits alone)")
    with registry.db.lock:
        found = queries.digest_prefix_matches(registry.db, hex_part, artifacts_only=artifacts_only)
    shown = found[: queries.MAX_PREFIX_MATCHES]
    return {"prefix": f"sha256:{hex_part}", "matches": [m._asdict() for m in shown], "more": len(found) > len(shown)}


@get("/v1/digests/{prefix:str}", guards=[read_guard], summary="Resolve a short digest")
async def get_digest_matches(
    request: Request[Any, Any, Any], prefix: FromPath[str], kind: FromQuery[str | None] = None
) -> DigestMatches:
    """The artifacts (tensor digests) and records (envelope digests) whose digest starts with
    ``prefix`` (4 to 64 hex digits, ``sha256:`` optional), at most 10; ``kind=artifact``: artifacts
    only. A unique prefix names its digest, as git resolves an abbreviated object name; ``kvgraft
    pull`` resolves short digests through it."""
    if kind not in (None, "artifact"):
        raise BadRequestError(f"kind={kind[:40]!r} is not a kind this lookup filters by", hint="pass kind=artifact, or leave it out")
    return _wire(DigestMatches, await _run(_digest_matches, _registry(request), prefix, kind == "artifact"))


# --- admin (local operator only: authenticated by the secret in DATA/admin.json) ---------------


def _admin(connection: ASGIConnection[Any, Any, Any, Any]) -> Registry:
    header = connection.headers.get("authorization") or ""
    scheme, _, secret = header.partition(" ")
    expected: bytes = connection.app.state.admin_secret_hash
    given = hashlib.sha256(secret.strip().encode("utf-8")).digest()
    if scheme.lower() != "bearer" or not hmac.compare_digest(given, expected):
        raise AdminAuthError("this admin request does not carry the running server's admin secret")
    return _registry(connection)


async def admin_guard(connection: ASGIConnection[Any, Any, Any, Any], _: BaseRouteHandler) -> None:
    """The admin secret, checked before Litestar reads or parses any body a stranger sent."""
    _admin(connection)


#: The most bytes an admin request body may hold (a publisher and a few PEM keys).
MAX_ADMIN_BODY_BYTES = 1024 * 1024


async def _admin_body(request: Request[Any, Any, Any]) -> dict[str, Any]:
    """The admin request's JSON object, depth-checked before parsing (msgspec recurses without bound)."""
    body = await request.body()
    limit = _registry(request).settings.max_json_depth
    if not json_depth_within(body, limit):
        raise DocumentTooDeepError(
            f"the request body nests deeper than {limit} levels (or its brackets do not balance)", extra={"limit": limit}
        )
    try:
        data = json.loads(body)
    except (ValueError, RecursionError) as e:
        raise BadRequestError("the request body is not JSON") from e
    if not isinstance(data, dict):
        raise BadRequestError("the request body must be a JSON object")
    return data


def _field(data: dict[str, Any], name: str, kind: type) -> Any:
    value = data.get(name)
    if not isinstance(value, kind):
        raise BadRequestError(f"the request body needs {name!r} as a {kind.__name__}")
    return value


@get("/v1/admin/keys", guards=[admin_guard], include_in_schema=False)
async def admin_list_keys(request: Request[Any, Any, Any]) -> dict[str, Any]:
    """Every registered key."""
    return {"keys": await _run(_admin(request).accounts.list_keys)}


@post("/v1/admin/keys", guards=[admin_guard], request_max_body_size=MAX_ADMIN_BODY_BYTES, include_in_schema=False)
async def admin_add_key(request: Request[Any, Any, Any]) -> Response[dict[str, Any]]:
    """Register a publisher key: ``{"publisher", "public_key_pem"}``."""
    registry = _admin(request)
    data = await _admin_body(request)
    result = await _run(registry.accounts.add_key, _field(data, "publisher", str), _field(data, "public_key_pem", str))
    return Response(content=result, status_code=201 if result["created"] else 200)


@get("/v1/admin/tokens", guards=[admin_guard], include_in_schema=False)
async def admin_list_tokens(request: Request[Any, Any, Any]) -> dict[str, Any]:
    """Every token (never the token itself)."""
    return {"tokens": await _run(_admin(request).accounts.list_tokens)}


@post("/v1/admin/tokens", guards=[admin_guard], request_max_body_size=MAX_ADMIN_BODY_BYTES, include_in_schema=False)
async def admin_create_token(request: Request[Any, Any, Any]) -> Response[dict[str, Any]]:
    """Make a token: ``{"publisher", "public_keys_pem": [...]}``; the response holds it, once."""
    registry = _admin(request)
    data = await _admin_body(request)
    pems = _field(data, "public_keys_pem", list)
    if not all(isinstance(p, str) for p in pems):
        raise BadRequestError("public_keys_pem must be a list of PEM strings")
    result = await _run(registry.accounts.create_token, _field(data, "publisher", str), pems)
    return Response(content=result, status_code=201)


@post("/v1/admin/tokens/{token_id:str}/revoke", guards=[admin_guard], include_in_schema=False, status_code=200)
async def admin_revoke_token(request: Request[Any, Any, Any], token_id: FromPath[str]) -> dict[str, Any]:
    """Revoke a token; it is refused from the next request on."""
    return await _run(_admin(request).accounts.revoke_token, token_id)


ROUTES = [
    put_blob, head_blob, get_blob,
    post_entry, list_entries, get_entry, get_envelope,
    get_checkpoint, get_log_key, get_inclusion, get_consistency,
    get_tiles_checkpoint, get_tile,
    list_artifacts, get_artifact, list_records, list_publishers, get_digest_matches,
    admin_list_keys, admin_add_key, admin_list_tokens, admin_create_token, admin_revoke_token,
]


def create_app(data_dir: Path, settings: RegistrySettings | None = None) -> Litestar:
    """The registry app serving ``data_dir``; its lifespan opens and closes the registry.

    On start it opens the DuckDB file (applying migrations), the blob store and the signing
    key, rebuilds and checks the log, and writes ``admin.json`` (0600) with a fresh admin
    secret; on shutdown it removes ``admin.json`` and closes everything.
    """
    settings = settings if settings is not None else RegistrySettings()

    @contextlib.asynccontextmanager
    async def lifespan(app: Litestar) -> AsyncIterator[None]:
        stack = contextlib.ExitStack()
        # Everything the registry runs (the sequencer, witnesses, the lease, the scrub) is built
        # and started by Registry.open, in a worker thread: it blocks on the database.
        registry = await anyio.to_thread.run_sync(stack.enter_context, Registry.open(data_dir, settings, serving=True))
        secret = ADMIN_SECRET_PREFIX + secrets.token_urlsafe(32)
        try:
            await _run(write_admin_handle, registry.data, AdminHandle(url=settings.admin_url, secret=secret, pid=os.getpid()))
            app.state.registry = registry
            # Both spellings of the data directory, longest first, so neither leaks into an answer.
            app.state.scrub_roots = sorted({str(data_dir), str(data_dir.resolve())}, key=len, reverse=True)
            app.state.admin_secret_hash = hashlib.sha256(secret.encode("utf-8")).digest()
            app.state.envelopes = EnvelopeCache()
            yield
        finally:
            with anyio.CancelScope(shield=True):
                await _run(remove_admin_handle, registry.data, secret)
                await anyio.to_thread.run_sync(stack.close)
            logger.info("registry %s closed", data_dir)

    app = Litestar(
        # The API under /v1 and /schema; the provenance browser under / and its assets under /static.
        route_handlers=[*ROUTES, ui_router(), static_router()],
        lifespan=[lifespan],
        # Security headers (CSP and friends) on every response, errors and 404s included.
        before_send=[add_security_headers],
        exception_handlers={RegistryError: registry_error, HTTPException: http_error, Exception: internal_error},
        # The app logs through "kvgraft.registry"; configuring the process's logging is the
        # caller's business (kvgraft serve does it), not the app's.
        logging_config=None,
        # Wire models serialise with only the keys the service set: the same bytes as its dicts.
        type_encoders={BaseModel: dump_wire},
        openapi_config=registry_openapi_config(settings, version=kvgraft.__version__),
    )
    # Around the router, inside Litestar's send wrapper: its answers get the security headers too.
    app.asgi_handler = HttpEdge(app, app.asgi_handler, settings)
    return app
