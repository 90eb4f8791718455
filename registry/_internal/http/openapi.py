"""The registry's OpenAPI document (``/schema/openapi.json``): Litestar's, completed.

Litestar derives the paths, operations and response models from the handlers' signatures and
return types (the wire models, exported by ``kvgraft.schemas``). What a signature cannot say is
added here, once per document, from the same settings the server enforces:

- component schemas straight from the pydantic wire models (Litestar's conversion drops string
  patterns and writes 2^63-1 as a float), plus ``Problem`` and the DSSE envelope;
- the bearer ``securitySchemes``, required on the write routes and, when ``reads_require_token``
  is set, on the reads too;
- an ``application/problem+json`` response for every error status a route answers, and as the
  ``default`` response of every operation;
- the request bodies the handlers stream themselves (blob bytes, the envelope);
- the digest pattern on path and query digests, ``limit`` bounds (1..max_page_limit), tree size
  and index bounds (0..2^63-1), and the search query's maximum length;
- the exact media types of the non-JSON answers (blob bytes, checkpoint notes, 206/304).

The handlers validate every parameter themselves and answer 4xx problems for what the document
forbids, so the document is a description of the server, not a second validator in front of it.
"""

from __future__ import annotations

import copy
from typing import Any

from litestar import Request
from litestar.openapi import OpenAPIConfig
from litestar.openapi.plugins import JsonRenderPlugin
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from kvgraft.schemas import (
    DIGEST_PATTERN,
    MAX_TREE_SIZE,
    ArtifactDocument,
    ArtifactPage,
    BlobStored,
    ConsistencyProof,
    DsseEnvelope,
    EntryDocument,
    EntryPage,
    InclusionProof,
    LogKey,
    PostedEnvelope,
    Problem,
    PublisherList,
)

from ..entries import KINDS, RECORD_KINDS
from ..log.cosignatures import MAX_WITNESSES
from ..settings import RegistrySettings

PROBLEM_JSON = "application/problem+json"
_REF = "#/components/schemas/{model}"
_PROBLEM_REF = {"$ref": "#/components/schemas/Problem"}

#: Every model whose schema is a component.
_MODELS: tuple[type[BaseModel], ...] = (
    Problem, BlobStored, InclusionProof, ConsistencyProof, LogKey, EntryDocument,
    EntryPage, ArtifactDocument, ArtifactPage, PublisherList, DsseEnvelope, PostedEnvelope,
)

_STATUS_TEXT = {
    400: "The request is malformed (a parameter, digest, cursor or body)",
    401: "No valid bearer token",
    403: "The token is revoked or not bound to the signing key",
    404: "No such blob, entry, artifact or checkpoint",
    405: "The method is not allowed on this path",
    409: "The entry names blobs or entries this registry does not hold",
    413: "The body is larger than this registry accepts",
    416: "No requested range overlaps the blob",
    422: "The envelope's signature or statement is not acceptable",
    429: "Too many requests for this token",
    431: "The request's headers are too large or too many",
    500: "The registry failed (the server log has the details)",
    503: "The registry's storage or database is unavailable, or its publish queue is full (Retry-After)",
    507: "The registry's disk is full; nothing was stored",
}

_COMMON = (400, 404, 405, 431, 500, 503)
_AUTH = (401, 403, 429)
_WRITE = (*_AUTH, 413, 507)

_INT64 = {"type": "integer", "minimum": 0, "maximum": MAX_TREE_SIZE}
_DIGEST = {"type": "string", "pattern": DIGEST_PATTERN}


def _component_schemas() -> dict[str, Any]:
    _, top = models_json_schema([(m, "serialization") for m in _MODELS], ref_template=_REF)
    return dict(top.get("$defs", {}))


def _posted_envelope(settings: RegistrySettings) -> dict[str, Any]:
    """The request body's schema: PostedEnvelope with the registry's signature limit."""
    return {
        "allOf": [{"$ref": _REF.format(model="PostedEnvelope")}],
        "properties": {"signatures": {"maxItems": settings.max_signatures}},
    }


def _problem_response(status: int | str) -> dict[str, Any]:
    text = _STATUS_TEXT.get(status, "A problem document (RFC 9457)") if isinstance(status, int) else "A problem document (RFC 9457)"
    return {"description": text, "content": {PROBLEM_JSON: {"schema": _PROBLEM_REF}}}


def _json(ref: str, description: str, headers: dict[str, Any] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"description": description, "content": {"application/json": {"schema": {"$ref": _REF.format(model=ref)}}}}
    if headers:
        out["headers"] = headers
    return out


def _header(description: str) -> dict[str, Any]:
    return {"description": description, "schema": {"type": "string"}}


_BLOB_HEADERS = {"ETag": _header('"sha256:<hex>" of the blob'), "Content-Length": _header("bytes in the body")}
_BINARY = {"schema": {"type": "string", "format": "binary"}}


def _parameter_schema(name: str, settings: RegistrySettings) -> dict[str, Any] | None:
    """The schema of a query parameter by name (None: keep Litestar's, minus its null branch)."""
    if name == "limit":
        return {"type": "integer", "minimum": 1, "maximum": settings.max_page_limit}
    if name in ("tree_size", "index", "old", "new"):
        return dict(_INT64)
    if name == "witnessed":
        # How many witness cosignatures the checkpoint must carry (cosignatures.py).
        return {"type": "integer", "minimum": 0, "maximum": MAX_WITNESSES}
    if name == "q":
        # The word limit is counted after NFKC casefolding (search.py), which no JSON schema can
        # state (one character can fold to two words); the description says it, schemathesis.toml too.
        return {
            "type": "string", "maxLength": settings.max_query_length,
            "description": f"whole words to search the source text for; at most {settings.max_search_terms} "
            "distinct words after NFKC casefolding (more is 400 query-too-large)",
        }
    if name == "parent":
        return {"type": "string", "pattern": r"^(none|sha256:[0-9a-f]{64})$"}
    if name == "artifact":
        return dict(_DIGEST)
    if name == "cursor":
        # documents.encode_cursor: the decimal log index the page continues after; empty is the first page.
        return {"type": "string", "pattern": r"^(|0|[1-9][0-9]{0,18})$"}
    if name == "type":
        return {"type": "string", "enum": [*RECORD_KINDS, *(uri for uri, kind in KINDS.items() if kind in RECORD_KINDS)]}
    return {"type": "string"}


def _fix_parameters(path: str, op: dict[str, Any], settings: RegistrySettings) -> None:
    for param in op.get("parameters", []):
        name, where = param.get("name"), param.get("in")
        if where == "path":
            if name == "ref":
                param["schema"] = {"type": "string", "pattern": r"^([0-9]{1,19}|sha256:[0-9a-f]{64})$"}
                param["description"] = "a log index or the envelope's digest"
            elif name == "digest":
                param["schema"] = dict(_DIGEST)
        elif where == "query":
            schema = _parameter_schema(name, settings)
            if schema is not None:
                param["schema"] = schema
            # Litestar marks optional query parameters nullable; a query string has no null.
            param.pop("allowEmptyValue", None)


def _success_responses(path: str, method: str, op: dict[str, Any]) -> None:
    responses = op.setdefault("responses", {})
    key = (path, method)
    if key == ("/v1/blobs/{digest}", "get"):
        responses.clear()
        responses["200"] = {"description": "The blob's bytes", "headers": _BLOB_HEADERS, "content": {"application/octet-stream": _BINARY}}
        responses["206"] = {
            "description": "The requested byte range(s); several as multipart/byteranges",
            "headers": _BLOB_HEADERS,
            "content": {"application/octet-stream": _BINARY, "multipart/byteranges": _BINARY},
        }
        responses["304"] = {"description": "Not modified (If-None-Match matched the ETag)"}
    elif key == ("/v1/blobs/{digest}", "head"):
        responses.clear()
        responses["200"] = {"description": "The blob's size and ETag, no body", "headers": _BLOB_HEADERS}
        responses["304"] = {"description": "Not modified (If-None-Match matched the ETag)"}
    elif key == ("/v1/blobs/{digest}", "put"):
        responses.clear()
        location = {"Location": _header("/v1/blobs/sha256:<hex>"), "ETag": _header('"sha256:<hex>"')}
        responses["201"] = _json("BlobStored", "Stored", location)
        responses["200"] = _json("BlobStored", "Already stored", location)
    elif key == ("/v1/entries", "post"):
        responses.clear()
        location = {"Location": _header("/v1/entries/<log index>")}
        responses["201"] = _json("EntryDocument", "Logged: the entry, its inclusion proof and the new checkpoint", location)
        responses["200"] = _json("EntryDocument", "These exact bytes were already logged", location)
    elif key == ("/v1/entries/{ref}/envelope", "get"):
        responses.clear()
        responses["200"] = _json("DsseEnvelope", "The envelope exactly as posted", {"ETag": _header('"sha256:<hex>"')})
        responses["304"] = {"description": "Not modified (If-None-Match matched the ETag)"}
    elif key == ("/v1/log/checkpoint", "get"):
        responses.clear()
        responses["200"] = {"description": "A C2SP signed checkpoint note", "content": {"text/plain": {"schema": {"type": "string"}}}}


def _error_statuses(path: str, method: str, write: bool, reads_need_token: bool) -> list[int]:
    statuses = list(_COMMON)
    if write:
        statuses += _WRITE
        if path == "/v1/entries":
            statuses += [409, 422]
    elif reads_need_token:
        statuses += _AUTH
    if path == "/v1/blobs/{digest}" and method == "get":
        statuses.append(416)
    return sorted(set(statuses))


def complete_document(document: dict[str, Any], settings: RegistrySettings) -> dict[str, Any]:
    """A copy of Litestar's OpenAPI ``document`` with everything the module docstring lists."""
    doc = copy.deepcopy(document)
    components = doc.setdefault("components", {})
    components.setdefault("schemas", {}).update(_component_schemas())
    components["securitySchemes"] = {
        "bearer": {
            "type": "http",
            "scheme": "bearer",
            "description": "a publisher token from 'kvgraft token create' (tok_...); reads need one only "
            "where the registry runs with --reads-require-token",
        }
    }
    for path, item in doc.get("paths", {}).items():
        for method, op in item.items():
            if not isinstance(op, dict) or method not in ("get", "head", "put", "post", "delete", "patch"):
                continue
            write = method in ("put", "post")
            _fix_parameters(path, op, settings)
            _success_responses(path, method, op)
            responses = op["responses"]
            for status in _error_statuses(path, method, write, settings.reads_require_token):
                responses[str(status)] = _problem_response(status)
            responses["default"] = _problem_response("default")
            if write or settings.reads_require_token:
                op["security"] = [{"bearer": []}]
            if (path, method) == ("/v1/blobs/{digest}", "put"):
                op["requestBody"] = {
                    "required": True,
                    "description": "the bytes whose sha256 is the digest in the path",
                    "content": {"application/octet-stream": _BINARY},
                }
            elif (path, method) == ("/v1/entries", "post"):
                op["requestBody"] = {
                    "required": True,
                    "description": "a DSSE envelope (the .dsse.json file as the signer wrote it), at most "
                    f"{settings.max_envelope_bytes} bytes",
                    "content": {"application/json": {"schema": _posted_envelope(settings)}},
                }
    return doc


class RegistryJsonPlugin(JsonRenderPlugin):
    """Serves the completed document as JSON at ``/schema/openapi.json`` (computed once)."""

    def __init__(self, settings: RegistrySettings) -> None:
        super().__init__(path="/openapi.json")
        self._settings = settings
        self._document: dict[str, Any] | None = None

    def render(self, request: Request[Any, Any, Any], openapi_schema: dict[str, Any]) -> bytes:
        if self._document is None:
            self._document = complete_document(openapi_schema, self._settings)
        return self.render_json(request, self._document)


def registry_openapi_config(settings: RegistrySettings, *, version: str) -> OpenAPIConfig:
    """The app's OpenAPI configuration: the document only (no browser UI: the CSP forbids its CDN scripts)."""
    return OpenAPIConfig(
        title="kvgraft registry",
        version=version,
        description="Signed KV artifacts and records, content-addressed blobs, and a transparency log.",
        path="/schema",
        render_plugins=[RegistryJsonPlugin(settings)],
    )
