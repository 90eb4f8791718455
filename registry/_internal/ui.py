"""The provenance browser: HTML pages under ``/`` rendered from ``kvgraft.web`` templates.

Handlers read through the registry service (its queries and locks) plus the few read-only
queries the pages need that the API does not have (newest-first listings, counts, facets),
all here. Signatures are re-verified on every page view with ``kvgraft.verifier`` against the
publisher's registered keys: a page never repeats the registry's earlier judgement unchecked.
Pages work without JavaScript; every value from an entry reaches the browser escaped.
"""

from __future__ import annotations

import base64
import binascii
import functools
import hashlib
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import quote, urlencode

import anyio.to_thread
from litestar import Request, Response, Router, get
from litestar.connection import ASGIConnection
from litestar.exceptions import HTTPException
from litestar.params import FromPath, FromQuery
from litestar.response import Redirect
from litestar.static_files import create_static_files_router

import kvgraft
from kvgraft.schemas import (
    DocumentError,
    EvaluationStatement,
    ExactnessStatement,
    KvArtifactStatement,
    PreRegistrationStatement,
    ReplayStatement,
    Statement,
    parse_json,
    parse_statement,
)
from kvgraft.verifier import (
    LOGITS_DIR,
    RECORD_FILE,
    Dataset,
    TrustedKeys,
    VerificationError,
    b64decode_any,
    harness_hashes,
    load_dataset,
    parse_envelope,
    verify_envelope,
)
from kvgraft.web import STATIC_DIR, LineageNode, PlotSeries, kl_plot_svg, lineage_svg, render_page, short_digest

from .blobs import parse_digest_ref
from .entries import RECORD_KINDS, kind_of_filter
from .errors import ArtifactNotFoundError, BadRequestError, EntryNotFoundError, NotFoundError, RegistryError
from .service import Registry

logger = logging.getLogger("kvgraft.registry")

T = TypeVar("T")

PAGE_SIZE = 50
RECENT = 12
#: Ancestors drawn before the chain is shortened to "root, n more, ..., parent".
_DRAWN_ANCESTORS = 3
_DRAWN_CHILDREN = 6
_PREVIEW = 160
_MAX_ANCESTORS = 10_000
_MAX_CHILDREN = 1_000
#: The datasets shipped with kvgraft: an evaluation over one of them shows its questions.
DATASETS_DIR = Path(__file__).resolve().parents[2] / "data" / "datasets"

_NAV = (("/", "Overview"), ("/artifacts", "Artifacts"), ("/records", "Records"), ("/log", "Log"), ("/publishers", "Publishers"))


# --- plumbing ----------------------------------------------------------------------------------


def _registry(connection: ASGIConnection[Any, Any, Any, Any]) -> Registry:
    registry: Registry = connection.app.state.registry
    return registry


async def _run(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    return await anyio.to_thread.run_sync(functools.partial(fn, *args, **kwargs))


async def _guard(connection: ASGIConnection[Any, Any, Any, Any], _: Any) -> None:
    # The same rule as the API's reads: public unless the operator requires a token.
    registry = _registry(connection)
    if registry.settings.reads_require_token:
        await _run(registry.authenticate, connection.headers.get("authorization"))


def _base_url(request: Request[Any, Any, Any]) -> str:
    return str(request.base_url).rstrip("/")


def _html(request: Request[Any, Any, Any], template: str, *, status: int = 200, **context: Any) -> Response[str]:
    registry: Registry | None = getattr(request.app.state, "registry", None)
    page = render_page(
        template,
        nav=_NAV,
        path=request.url.path,
        search_q=context.pop("search_q", ""),
        version=kvgraft.__version__,
        origin=registry.log.origin if registry else "",
        log_size=registry.log.size if registry else 0,
        **context,
    )
    return Response(content=page, status_code=status, media_type="text/html")


def _html_error(request: Request[Any, Any, Any], exc: Exception) -> Response[str]:
    if isinstance(exc, RegistryError):
        status, title, message, hint = exc.status_code, exc.title, exc.message, exc.hint
    elif isinstance(exc, HTTPException):
        status, title, message, hint = exc.status_code, "Request refused", str(exc.detail), "check the address and its parameters"
    else:
        logger.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        status, title = 500, "Internal error"
        message, hint = "the registry failed to render this page", "retry; if it persists, the server log has the details"
    if status >= 500 and isinstance(exc, RegistryError):
        logger.error("%s %s failed: %s", request.method, request.url.path, exc, exc_info=exc)
    headers = exc.headers() if isinstance(exc, RegistryError) else {}
    response = _html(request, "error.html", status=status, title=title, message=message, hint=hint)
    response.headers.update(headers)
    return response


def _query(registry: Registry, sql: str, params: list[Any] | None = None) -> list[tuple[Any, ...]]:
    return registry.db.query(sql, params or [])


def _url(path: str, **params: Any) -> str:
    kept = {k: v for k, v in params.items() if v not in (None, "")}
    return path + ("?" + urlencode(kept) if kept else "")


def _before(before: int | None) -> int:
    if before is None:
        return 2**62
    if before < 0:
        raise BadRequestError(f"before={before} is not a log index", hint="follow the page links, or start from the first page")
    return before


# --- signatures --------------------------------------------------------------------------------


@dataclass(frozen=True)
class SignatureStatus:
    """The outcome of re-verifying a stored envelope against its publisher's registered keys."""

    publisher: str
    verified: bool
    signers: list[dict[str, str]]
    claimed_keyids: list[str]
    message: str
    hint: str = ""
    registered_keyids: list[str] = field(default_factory=list)


def signature_status(registry: Registry, envelope_bytes: bytes, publisher: str) -> SignatureStatus:
    """Verify ``envelope_bytes`` now with the keys registered for ``publisher``; say who signed or why not."""
    keys = [key for key, owner in registry.accounts.registered_keys().values() if owner == publisher]
    registered = [k.keyid for k in keys]
    try:
        envelope = parse_envelope(envelope_bytes, source="the stored envelope")
    except VerificationError as e:
        return SignatureStatus(publisher, False, [], [], e.message, e.hint, registered)
    claimed = [s.keyid for s in envelope.signatures if s.keyid]
    if not keys:
        return SignatureStatus(
            publisher, False, [], claimed, f"publisher {publisher!r} has no registered key to verify with",
            "the operator can list keys with 'kvgraft key list'", registered,
        )
    try:
        verified = verify_envelope(envelope, TrustedKeys(tuple(keys)), threshold=1)
    except VerificationError as e:
        return SignatureStatus(publisher, False, [], claimed, e.message, e.hint, registered)
    signers = [{"name": publisher, "keyid": k.keyid} for k in verified.signers]
    names = ", ".join(short_digest(k.keyid, 16) for k in verified.signers)
    message = f"Ed25519 signature over the DSSE payload verified just now with {publisher}'s registered key {names}"
    return SignatureStatus(publisher, True, signers, claimed, message, "", registered)


def _statement(envelope_bytes: bytes) -> Statement:
    try:
        doc = parse_json(envelope_bytes, what="stored envelope")
        payload = b64decode_any(doc["payload"], what="stored payload")
        return parse_statement(payload, what="stored statement")
    except (DocumentError, VerificationError, KeyError, TypeError) as e:
        raise RegistryError(f"a stored envelope cannot be decoded: {e}") from e


def _payload_json(envelope_bytes: bytes) -> dict[str, Any]:
    # Listings only: a cheap decode without model validation (the detail page validates).
    try:
        doc = json.loads(envelope_bytes)
        value = json.loads(base64.b64decode(doc["payload"]))
    except (ValueError, KeyError, TypeError, binascii.Error):
        return {}
    return value if isinstance(value, dict) else {}


# --- proofs, downloads, commands ---------------------------------------------------------------


def _proof_context(registry: Registry, entry: dict[str, Any]) -> dict[str, Any]:
    head = registry.head
    index = int(entry["log_index"])
    return {
        "index": index,
        "leaf_hash": entry["leaf_hash"],
        "proof": registry.inclusion_proof(index, head.size),
        "tree_size": head.size,
        "root_hash": head.root_hash.hex(),
        "checkpoint": head.note.decode("utf-8"),
    }


def _log_commands(base: str, entry: dict[str, Any], tree_size: int, envelope_path: str) -> str:
    index = entry["log_index"]
    return "\n".join(
        [
            f"curl -fsS -o registry.pub {base}/log/registry-key.pem",
            f"curl -fsS '{base}/v1/log/checkpoint?tree_size={tree_size}' > checkpoint",
            f"curl -fsS '{base}/v1/log/proof/inclusion?index={index}&tree_size={tree_size}' > inclusion.json",
            f"kvgraft-verify log --checkpoint checkpoint --registry-key registry.pub --inclusion inclusion.json {envelope_path}",
        ]
    )


def _fetch_lines(base: str, entry: dict[str, Any], directory: str, envelope_name: str) -> list[str]:
    lines = [f"mkdir -p {directory}"]
    subdirs = sorted({s["name"].rsplit("/", 1)[0] for s in entry["subjects"] if "/" in s["name"]})
    if subdirs:
        lines[0] = "mkdir -p " + " ".join(f"{directory}/{d}" for d in subdirs)
    for s in entry["subjects"]:
        lines.append(f"curl -fsS -o {directory}/{s['name']} {base}/v1/blobs/{s['digest']}")
    lines.append(f"curl -fsS -o {directory}/{envelope_name} {base}{entry['envelope_url']}")
    lines.append(f"curl -fsS -o trusted-keys.json {base}/publishers/{quote(entry['publisher'])}/trusted-keys.json   # or your own copy")
    return lines


def _downloads(entry: dict[str, Any], tree_size: int) -> list[tuple[str, str]]:
    index = entry["log_index"]
    out = [("envelope (the exact logged bytes)", entry["envelope_url"])]
    out += [(f"subject {s['name']}", f"/v1/blobs/{s['digest']}") for s in entry["subjects"]]
    out += [
        (f"inclusion proof at size {tree_size}", f"/v1/log/proof/inclusion?index={index}&tree_size={tree_size}"),
        (f"checkpoint at size {tree_size}", f"/v1/log/checkpoint?tree_size={tree_size}"),
        ("registry log key (PEM)", "/log/registry-key.pem"),
        ("entry metadata (JSON)", f"/v1/entries/{index}"),
    ]
    return out


# --- overview ----------------------------------------------------------------------------------


def _entry_rows(registry: Registry, where: str, params: list[Any], limit: int) -> list[dict[str, Any]]:
    rows = _query(
        registry,
        "SELECT log_index, digest, kind, publisher, integrated_at, artifact_digest, model_name, profile_name, parent, "
        f"position_start, position_end, left(source_text, {_PREVIEW + 1}), predicate_type, "
        # A record's envelope comes along for its one-line summary; artifacts are described by columns.
        "CASE WHEN kind = 'artifact' THEN NULL ELSE envelope END "
        f"FROM entries WHERE {where} ORDER BY log_index DESC LIMIT {int(limit)}",
        params,
    )
    out = []
    for r in rows:
        text = r[11]
        if text is not None and len(text) > _PREVIEW:
            text = text[:_PREVIEW] + "\u2026"
        out.append(
            {
                "log_index": int(r[0]), "digest": r[1], "kind": r[2], "publisher": r[3], "integrated_at": r[4],
                "artifact_digest": r[5], "model": r[6], "profile": r[7], "parent": r[8],
                "positions": None if r[9] is None else (int(r[9]), int(r[10])), "text": text, "predicate_type": r[12],
            }
        )
        if r[13] is not None:
            out[-1]["summary"] = _record_summary(r[2], _payload_json(bytes(r[13])))
    return out


def overview_context(registry: Registry) -> dict[str, Any]:
    """Counts, the latest checkpoint and the most recent entries."""
    with registry.db.lock:
        counts: dict[str, int] = {}
        publishers = keys = 0
        for kind, n in _query(
            registry,
            "SELECT kind, count(*) FROM entries GROUP BY kind UNION ALL "
            "SELECT '.publishers', count(*) FROM publishers UNION ALL SELECT '.keys', count(*) FROM publisher_keys",
        ):
            if kind == ".publishers":
                publishers = int(n)
            elif kind == ".keys":
                keys = int(n)
            else:
                counts[kind] = int(n)
        recent = _entry_rows(registry, "TRUE", [], RECENT)
        head = registry.head
    records = sum(int(counts.get(k, 0)) for k in RECORD_KINDS)
    return {
        "counts": {k: int(v) for k, v in counts.items()},
        "artifacts": int(counts.get("artifact", 0)),
        "records": records,
        "publishers": int(publishers),
        "keys": int(keys),
        "head": {"size": head.size, "root_hash": head.root_hash.hex(), "note": head.note.decode("utf-8")},
        "recent": recent,
        "record_kinds": RECORD_KINDS,
    }


@get("/", guards=[_guard], include_in_schema=False)
async def overview(request: Request[Any, Any, Any]) -> Response[str]:
    """The overview: counts, the latest checkpoint, recent entries."""
    return _html(request, "overview.html", **await _run(overview_context, _registry(request)))


# --- artifacts ---------------------------------------------------------------------------------


def artifacts_context(
    registry: Registry,
    *,
    q: str | None,
    model: str | None,
    profile: str | None,
    publisher: str | None,
    parent: str | None,
    before: int | None,
) -> dict[str, Any]:
    """One page of artifacts, newest first, filtered as ``GET /v1/artifacts`` filters."""
    where = ["kind = 'artifact'"]
    params: list[Any] = []
    for column, value in (("model_name", model), ("profile_name", profile), ("publisher", publisher)):
        if value:
            where.append(f"{column} = ?")
            params.append(value)
    if parent:
        if parent == "none":
            where.append("parent IS NULL")
        else:
            parse_digest_ref(parent, what="parent")
            where.append("parent = ?")
            params.append(parent)
    for term in (q or "").split():
        where.append("contains(lower(source_text), ?)")
        params.append(term.lower())
    condition = " AND ".join(where)
    with registry.db.lock:
        total = int(_query(registry, f"SELECT count(*) FROM entries WHERE {condition}", params)[0][0])
        rows = _entry_rows(registry, condition + " AND log_index < ?", [*params, _before(before)], PAGE_SIZE + 1)
        lists = _query(
            registry,
            "SELECT list(DISTINCT model_name ORDER BY model_name), list(DISTINCT profile_name ORDER BY profile_name), "
            "list(DISTINCT publisher ORDER BY publisher) FROM entries WHERE kind = 'artifact'",
        )[0]
        facets = {name: list(values or []) for name, values in zip(("models", "profiles", "publishers"), lists, strict=True)}
    filters = {"q": q, "model": model, "profile": profile, "publisher": publisher, "parent": parent}
    more = len(rows) > PAGE_SIZE
    rows = rows[:PAGE_SIZE]
    return {
        "items": rows,
        "total": total,
        "filters": filters,
        "facets": facets,
        "search_q": q or "",
        "next_url": _url("/artifacts", **filters, before=rows[-1]["log_index"]) if more else None,
        "first_url": _url("/artifacts", **filters) if before is not None else None,
    }


@get("/artifacts", guards=[_guard], include_in_schema=False)
async def artifacts(
    request: Request[Any, Any, Any],
    q: FromQuery[str | None] = None,
    model: FromQuery[str | None] = None,
    profile: FromQuery[str | None] = None,
    publisher: FromQuery[str | None] = None,
    parent: FromQuery[str | None] = None,
    before: FromQuery[int | None] = None,
) -> Response[str]:
    """Artifacts, newest first: search the source text, filter by model, profile, publisher, parent."""
    context = await _run(
        artifacts_context, _registry(request), q=q, model=model, profile=profile, publisher=publisher, parent=parent, before=before
    )
    return _html(request, "artifacts.html", **context)


def _node(item: dict[str, Any], role: str) -> LineageNode:
    if item.get("log_index") is None:
        return LineageNode(short_digest(item["digest"], 10), "no entry in this log", None, "missing")
    start, end = item["positions"]
    return LineageNode(short_digest(item["digest"], 10), f"entry {item['log_index']} \u00b7 pos {start}\u2013{end}",
                       f"/artifacts/{item['digest']}", role)


def _lineage(artifact: dict[str, Any], parents: list[dict[str, Any]], children: list[dict[str, Any]]) -> dict[str, Any]:
    chain_items = list(reversed(parents))  # root first
    chain: list[LineageNode] = []
    if len(chain_items) > _DRAWN_ANCESTORS:
        # The root, a marker for those in between, and the nearest parents.
        hidden = len(chain_items) - _DRAWN_ANCESTORS
        chain.append(_node(chain_items[0], "ancestor"))
        chain.append(LineageNode(f"\u2026 {hidden} more", "ancestors", None, "more"))
        chain += [_node(p, "ancestor") for p in chain_items[-(_DRAWN_ANCESTORS - 1):]]
    else:
        chain = [_node(p, "ancestor") for p in chain_items]
    start, end = artifact["positions"]
    current = LineageNode(short_digest(artifact["digest"], 10), f"this \u00b7 pos {start}\u2013{end}", None, "current")
    drawn_children = [_node(c, "child") for c in children[:_DRAWN_CHILDREN]]
    if len(children) > _DRAWN_CHILDREN:
        drawn_children.append(
            LineageNode(f"+ {len(children) - _DRAWN_CHILDREN} more", "children", f"/artifacts?parent={artifact['digest']}", "more")
        )
    return {"svg": lineage_svg(chain, current, drawn_children), "parents": parents, "children": children}


# Ancestors in one recursive query (nearest first), each artifact described by its first entry,
# as the registry's own lineage does; the depth cap stops a cycle from running away.
_ANCESTORS_SQL = f"""
WITH RECURSIVE firsts AS (
    SELECT artifact_digest, min(log_index) AS log_index, arg_min(parent, log_index) AS parent,
           arg_min(position_start, log_index) AS position_start, arg_min(position_end, log_index) AS position_end
    FROM entries WHERE kind = 'artifact' GROUP BY artifact_digest
), chain(digest, depth) AS (
    SELECT CAST(? AS VARCHAR), 0
    UNION ALL
    SELECT f.parent, c.depth + 1 FROM chain c JOIN firsts f ON f.artifact_digest = c.digest
    WHERE f.parent IS NOT NULL AND c.depth < {_MAX_ANCESTORS}
)
SELECT c.digest, f.log_index, f.position_start, f.position_end
FROM chain c LEFT JOIN firsts f ON f.artifact_digest = c.digest WHERE c.depth > 0 ORDER BY c.depth
"""

_RECORD_KINDS_SQL = "(" + ", ".join(f"'{k}'" for k in RECORD_KINDS) + ")"


def _entry_dict(r: tuple[Any, ...], subjects: list[dict[str, str]]) -> dict[str, Any]:
    # Columns of _ENTRY_SQL, shaped like the API's entry metadata (the fields the pages use).
    return {
        "log_index": int(r[0]), "digest": r[1], "leaf_hash": bytes(r[2]).hex(), "kind": r[3], "publisher": r[4],
        "keyids": list(r[5]), "integrated_at": r[6], "size": int(r[7]), "predicate_type": r[8], "subjects": subjects,
        "envelope_url": f"/v1/entries/{r[1]}/envelope",
        "artifact": None if r[9] is None else {"digest": r[9], "positions": (int(r[10]), int(r[11]))},
    }


_ENTRY_SQL = (
    "SELECT log_index, digest, leaf_hash, kind, publisher, keyids, integrated_at, octet_length(envelope), predicate_type, "
    "artifact_digest, position_start, position_end, envelope FROM entries"
)


def _subjects_of(registry: Registry, index: int) -> list[dict[str, str]]:
    rows = _query(registry, "SELECT name, digest FROM entry_subjects WHERE log_index = ? ORDER BY name", [index])
    return [{"name": n, "digest": d} for n, d in rows]


def artifact_context(registry: Registry, digest: str, base: str) -> dict[str, Any]:
    """An artifact page: statement fields, re-verified signature, lineage, proof, downloads, commands."""
    parse_digest_ref(digest, what="artifact digest")
    with registry.db.lock:
        rows = _query(registry, _ENTRY_SQL + " WHERE artifact_digest = ? AND kind = 'artifact' ORDER BY log_index", [digest])
        if not rows:
            raise ArtifactNotFoundError(f"no KV artifact with tensors {digest} is in this registry")
        first = rows[0]
        entry = _entry_dict(first, _subjects_of(registry, int(first[0])))
        envelope_bytes = bytes(first[12])
        parents = [
            {"digest": d, "log_index": None if i is None else int(i), "positions": None if i is None else (int(a), int(b))}
            for d, i, a, b in _query(registry, _ANCESTORS_SQL, [digest])
        ]
        children = [
            {"digest": d, "log_index": int(i), "publisher": p, "positions": (int(a), int(b))}
            for i, d, p, a, b in _query(
                registry,
                "SELECT log_index, artifact_digest, publisher, position_start, position_end FROM entries "
                f"WHERE kind = 'artifact' AND parent = ? ORDER BY log_index LIMIT {_MAX_CHILDREN}",
                [digest],
            )
        ]
        records = [
            {"log_index": int(i), "digest": d, "kind": k, "publisher": p, "integrated_at": t}
            for i, d, k, p, t in _query(
                registry,
                f"SELECT log_index, digest, kind, publisher, integrated_at FROM entries WHERE kind IN {_RECORD_KINDS_SQL} "
                f"AND log_index IN (SELECT log_index FROM entry_refs WHERE ref = ?) ORDER BY log_index LIMIT {PAGE_SIZE}",
                [digest],
            )
        ]
        proof = _proof_context(registry, entry)
        signature = signature_status(registry, envelope_bytes, entry["publisher"])
    statement = _statement(envelope_bytes)
    if not isinstance(statement, KvArtifactStatement):
        raise RegistryError(f"entry {entry['log_index']} is indexed as an artifact but holds a {statement.predicate_type} statement")
    p = statement.predicate
    artifact = {"digest": digest, "positions": (p.positions.start, p.positions.end), "tokens": p.positions.end - p.positions.start}
    directory = "art"
    fetch = _fetch_lines(base, entry, directory, "statement.dsse.json")
    verify = [
        f"kvgraft-verify envelope {directory}/statement.dsse.json --trusted-keys trusted-keys.json --artifact-dir {directory}",
        _log_commands(base, entry, proof["tree_size"], f"{directory}/statement.dsse.json"),
    ]
    return {
        "artifact": artifact,
        "other_entries": [{"log_index": int(r[0]), "digest": r[1], "publisher": r[4]} for r in rows[1:]],
        "entry": entry,
        "statement": statement,
        "p": p,
        "signature": signature,
        "lineage": _lineage(artifact, parents, children),
        "records": records,
        "proof": proof,
        "downloads": _downloads(entry, proof["tree_size"]),
        "verify_command": "\n".join([*fetch, *verify]),
        "pull_command": f"kvgraft pull --registry {base} {digest} --out {directory} --trusted-keys trusted-keys.json",
    }


@get("/artifacts/{digest:str}", guards=[_guard], include_in_schema=False)
async def artifact(request: Request[Any, Any, Any], digest: FromPath[str]) -> Response[str]:
    """One artifact, with who signed it and what proves it."""
    return _html(request, "artifact.html", **await _run(artifact_context, _registry(request), digest, _base_url(request)))


# --- records -----------------------------------------------------------------------------------


def _record_summary(kind: str, payload: dict[str, Any]) -> str:
    p = payload.get("predicate") or {}
    try:
        if kind == "exactness":
            s = p["summary"]
            level = p.get("level", "")
            shift = f" shift {p['shift']}" if p.get("shift") else ""
            return f"{p['model']['name']} {level}{shift}: {s['bitwise_equal']}/{s['samples']} bit-equal, max KL {s['max_kl_divergence']:.3g}"
        if kind == "evaluation":
            a = p["aggregates"]
            return f"{p['model']['name']} on {p['dataset']['name']}: {a['correct']}/{a['items']} correct"
        if kind == "pre-registration":
            return f"{p['model']['name']} on {p['dataset']['name']}: {len(p['expected_output_hashes'])} expected outputs"
        if kind == "replay":
            ref = p["pre_registration"]
            return f"answers entry {ref['log_index']}: {'reproduced' if p['reproduced'] else 'NOT reproduced'}"
    except (KeyError, TypeError, ValueError):
        return "(summary unreadable; open the record)"
    return ""


def records_context(registry: Registry, *, kind: str | None, publisher: str | None, artifact: str | None, before: int | None) -> dict[str, Any]:
    """One page of records, newest first."""
    where = ["kind IN (" + ", ".join(f"'{k}'" for k in RECORD_KINDS) + ")"]
    params: list[Any] = []
    resolved = None
    if kind:
        resolved = kind_of_filter(kind)
        if resolved == "artifact":
            raise BadRequestError("artifacts are not records", hint="browse artifacts at /artifacts")
        where.append("kind = ?")
        params.append(resolved)
    if publisher:
        where.append("publisher = ?")
        params.append(publisher)
    if artifact:
        parse_digest_ref(artifact, what="artifact")
        where.append("log_index IN (SELECT log_index FROM entry_refs WHERE ref = ?)")
        params.append(artifact)
    condition = " AND ".join(where)
    with registry.db.lock:
        total = int(_query(registry, f"SELECT count(*) FROM entries WHERE {condition}", params)[0][0])
        rows = _query(
            registry,
            f"SELECT log_index, digest, kind, publisher, integrated_at, envelope FROM entries WHERE {condition} "
            f"AND log_index < ? ORDER BY log_index DESC LIMIT {PAGE_SIZE + 1}",
            [*params, _before(before)],
        )
        publishers = [r[0] for r in _query(registry, "SELECT name FROM publishers ORDER BY name")]
    items = [
        {"log_index": int(r[0]), "digest": r[1], "kind": r[2], "publisher": r[3], "integrated_at": r[4],
         "summary": _record_summary(r[2], _payload_json(bytes(r[5])))}
        for r in rows[:PAGE_SIZE]
    ]
    filters = {"type": resolved, "publisher": publisher, "artifact": artifact}
    return {
        "items": items,
        "total": total,
        "filters": filters,
        "kinds": RECORD_KINDS,
        "publishers": publishers,
        "next_url": _url("/records", **filters, before=items[-1]["log_index"]) if len(rows) > PAGE_SIZE else None,
        "first_url": _url("/records", **filters) if before is not None else None,
    }


@get("/records", guards=[_guard], include_in_schema=False)
async def records(
    request: Request[Any, Any, Any],
    kind: FromQuery[str | None] = None,
    publisher: FromQuery[str | None] = None,
    artifact: FromQuery[str | None] = None,
    before: FromQuery[int | None] = None,
) -> Response[str]:
    """Records (exactness, evaluation, pre-registration, replay), newest first."""
    # The API names this filter "type"; "kind" is accepted too.
    chosen = request.query_params.get("type") or kind
    context = await _run(records_context, _registry(request), kind=chosen, publisher=publisher, artifact=artifact, before=before)
    return _html(request, "records.html", **context)


@functools.cache
def _shipped_datasets() -> dict[str, Path]:
    out: dict[str, Path] = {}
    for path in sorted(DATASETS_DIR.glob("*.jsonl")) if DATASETS_DIR.is_dir() else []:
        out["sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()] = path
    return out


@functools.lru_cache(maxsize=4)
def _dataset(digest: str) -> Dataset | None:
    path = _shipped_datasets().get(digest)
    if path is None:
        return None
    try:
        return load_dataset(path)
    except VerificationError as e:
        logger.warning("shipped dataset %s cannot be read: %s", path, e)
        return None


def _exactness_context(registry: Registry, entry: dict[str, Any], statement: ExactnessStatement) -> dict[str, Any]:
    p = statement.predicate
    samples = list(p.samples)
    # Other exactness records over the same prefix artifacts at another level (a shifted run
    # beside an own-position one, or the reverse): their figures go beside these.
    rows = _query(
        registry,
        "SELECT DISTINCT e.log_index, e.envelope FROM entry_refs r JOIN entries e ON e.log_index = r.log_index "
        "WHERE r.role = 'prefix_artifact' AND e.kind = 'exactness' AND e.log_index <> ? AND r.ref IN "
        "(SELECT ref FROM entry_refs WHERE log_index = ? AND role = 'prefix_artifact') ORDER BY e.log_index LIMIT 6",
        [entry["log_index"], entry["log_index"]],
    )
    companions = []
    for index, envelope in rows:
        try:
            other = _statement(bytes(envelope))
        except RegistryError:
            continue
        if not isinstance(other, ExactnessStatement):
            continue
        op = other.predicate
        if (op.level, op.shift) == (p.level, p.shift):
            continue
        by_prefix = {s.prefix_artifact: s for s in op.samples}
        companions.append({"log_index": int(index), "level": op.level, "shift": op.shift, "by_prefix": by_prefix,
                           "label": f"{op.level}" + (f" (shift {op.shift})" if op.shift else "") + f", entry {index}"})
    companions = companions[:2]
    level = p.level + (f" (shift {p.shift})" if p.shift else "")
    label = level + ", this record"
    series = [PlotSeries(label, "s0", [(s.index, s.kl_divergence) for s in samples])]
    for n, c in enumerate(companions, start=1):
        pts = [(s.index, c["by_prefix"][s.prefix_artifact].kl_divergence) for s in samples if s.prefix_artifact in c["by_prefix"]]
        series.append(PlotSeries(c["label"], f"s{n}", pts))
    recomputed = {
        "samples": len(samples),
        "bitwise_equal": sum(s.bitwise_equal for s in samples),
        "argmax_agree_all": sum(s.argmax_agreement == 1.0 for s in samples),
        "max_kl_divergence": max((s.kl_divergence for s in samples), default=0.0),
        "mean_argmax_agreement": (sum(s.argmax_agreement for s in samples) / len(samples)) if samples else 0.0,
    }
    claimed = p.summary.model_dump()
    return {
        "p": p,
        "samples": samples,
        "companions": companions,
        "plot": kl_plot_svg(series),
        "summary_rows": [(k, claimed[k], recomputed[k], _same(claimed[k], recomputed[k])) for k in recomputed],
        "summary_ok": all(_same(claimed[k], recomputed[k]) for k in recomputed),
        "label": label,
        "level": level,
    }


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return abs(float(a) - float(b)) <= 1e-9 * max(1.0, abs(float(a)))
    return bool(a == b)


def _evaluation_context(statement: EvaluationStatement) -> dict[str, Any]:
    p = statement.predicate
    dataset = _dataset(p.dataset.digest)
    items = []
    for item in p.items:
        question = None
        doc_matches = None
        if dataset is not None and 0 <= item.doc_id < len(dataset):
            question = dataset.question(item.doc_id)
            # The harness's doc hash: says whether the signed item is about this very document.
            doc_matches = harness_hashes(dataset.docs[item.doc_id], "", "").doc_hash == item.doc_hash
        items.append({"item": item, "question": question, "doc_matches": doc_matches})
    n = len(p.items)
    correct = sum(i.correct for i in p.items)
    recomputed = {
        "items": n,
        "correct": correct,
        "accuracy": correct / n if n else 0.0,
        "prompt_tokens": sum(i.prompt_tokens for i in p.items),
        "decode_tokens": sum(i.decode_tokens for i in p.items),
    }
    claimed = p.aggregates.model_dump()
    return {
        "p": p,
        "items": items,
        "dataset_known": dataset is not None,
        "doc_mismatches": sum(1 for row in items if row["doc_matches"] is False),
        "dataset_file": _shipped_datasets().get(p.dataset.digest),
        "aggregate_rows": [(k, claimed[k], recomputed[k], _same(claimed[k], recomputed[k])) for k in recomputed],
        "all_match": all(_same(claimed[k], recomputed[k]) for k in recomputed),
    }


def record_context(registry: Registry, digest: str, base: str) -> dict[str, Any]:
    """A record page by its entry (envelope) digest; artifacts redirect to their own page."""
    parse_digest_ref(digest, what="entry digest")
    with registry.db.lock:
        rows = _query(registry, _ENTRY_SQL + " WHERE digest = ?", [digest])
        if not rows:
            raise EntryNotFoundError(f"no entry has digest {digest}")
        entry = _entry_dict(rows[0], _subjects_of(registry, int(rows[0][0])))
        envelope_bytes = bytes(rows[0][12])
        signature = signature_status(registry, envelope_bytes, entry["publisher"])
        if entry["artifact"] is not None:
            return {"kind": "artifact", "entry": entry}
    statement = _statement(envelope_bytes)
    proof = _proof_context(registry, entry)
    directory = "rec"
    fetch = _fetch_lines(base, entry, directory, RECORD_FILE)
    context: dict[str, Any] = {"kind": entry["kind"], "special": {}}
    envelope_path = f"{directory}/{RECORD_FILE}"
    if isinstance(statement, ExactnessStatement):
        context["special"] = _exactness_context(registry, entry, statement)
        check = f"kvgraft-verify exactness {directory} --trusted-keys trusted-keys.json"
    elif isinstance(statement, EvaluationStatement):
        context["special"] = _evaluation_context(statement)
        file = context["special"]["dataset_file"]
        dataset = f"data/datasets/{file.name}" if file else "DATASET.jsonl"
        check = f"kvgraft-verify eval {directory} --dataset {dataset} --trusted-keys trusted-keys.json"
    else:
        check = f"kvgraft-verify envelope {envelope_path} --trusted-keys trusted-keys.json --artifact-dir {directory}"
    if isinstance(statement, ReplayStatement):
        context["special"] = {"pre": statement.predicate.pre_registration}
    elif isinstance(statement, PreRegistrationStatement):
        context["special"] = {"settings": statement.predicate.settings}
    context.update(
        entry=entry,
        statement=statement,
        statement_json=statement.model_dump(mode="json", by_alias=True),
        signature=signature,
        proof=proof,
        downloads=_downloads(entry, proof["tree_size"]),
        verify_command="\n".join([*fetch, check, _log_commands(base, entry, proof["tree_size"], envelope_path)]),
        logits_dir=LOGITS_DIR,
    )
    return context


@get("/records/{digest:str}", guards=[_guard], include_in_schema=False)
async def record(request: Request[Any, Any, Any], digest: FromPath[str]) -> Response[Any]:
    """One record by its entry digest: its figures, re-verified signature and log proof."""
    registry = _registry(request)
    context = await _run(record_context, registry, digest, _base_url(request))
    if context["kind"] == "artifact":
        return Redirect(path=f"/artifacts/{context['entry']['artifact']['digest']}")
    return _html(request, "record.html", **context)


@get("/entries/{ref:str}", guards=[_guard], include_in_schema=False)
async def entry_redirect(request: Request[Any, Any, Any], ref: FromPath[str]) -> Redirect:
    """An entry by log index or digest: redirected to its artifact or record page."""
    doc = await _run(_registry(request).entry, ref)
    entry = doc["entry"]
    if entry["artifact"] is not None:
        return Redirect(path=f"/artifacts/{entry['artifact']['digest']}")
    return Redirect(path=f"/records/{entry['digest']}")


# --- the log -----------------------------------------------------------------------------------


def log_context(registry: Registry, *, old: int | None, new: int | None, before: int | None, base: str) -> dict[str, Any]:
    """Checkpoints newest first, and a consistency proof between two tree sizes."""
    with registry.db.lock:
        head = registry.head
        rows = _query(
            registry,
            "SELECT tree_size, root_hash, created_at FROM checkpoints WHERE tree_size < ? ORDER BY tree_size DESC "
            f"LIMIT {PAGE_SIZE + 1}",
            [_before(before)],
        )
        size = head.size
        new_size = size if new is None else new
        old_size = (new_size // 2 if new_size >= 2 else 0) if old is None else old
        if not 0 <= old_size <= new_size <= size:
            raise BadRequestError(
                f"a consistency proof needs 0 <= old <= new <= {size}; got old={old_size}, new={new_size}",
                hint=f"pick two tree sizes between 0 and the latest checkpoint's ({size})",
            )
        proof = registry.consistency_proof(old_size, new_size)
        roots = dict(_query(registry, "SELECT tree_size, root_hash FROM checkpoints WHERE tree_size IN (?, ?)", [old_size, new_size]))
        log_key = registry.log_key()
    checkpoints = [{"size": int(r[0]), "root_hash": bytes(r[1]).hex(), "created_at": r[2]} for r in rows[:PAGE_SIZE]]
    commands = "\n".join(
        [
            f"curl -fsS -o registry.pub {base}/log/registry-key.pem",
            f"curl -fsS '{base}/v1/log/checkpoint?tree_size={old_size}' > checkpoint-old",
            f"curl -fsS '{base}/v1/log/checkpoint?tree_size={new_size}' > checkpoint-new",
            f"curl -fsS '{base}/v1/log/proof/consistency?old={old_size}&new={new_size}' > consistency.json",
            "kvgraft-verify log --checkpoint checkpoint-new --registry-key registry.pub --consistency consistency.json checkpoint-old",
        ]
    )
    return {
        "head": {"size": size, "root_hash": head.root_hash.hex(), "note": head.note.decode("utf-8")},
        "checkpoints": checkpoints,
        "next_url": _url("/log", old=old, new=new, before=checkpoints[-1]["size"]) if len(rows) > PAGE_SIZE else None,
        "first_url": _url("/log", old=old, new=new) if before is not None else None,
        "old": old_size,
        "new": new_size,
        "old_root": bytes(roots[old_size]).hex() if old_size in roots else None,
        "new_root": bytes(roots[new_size]).hex() if new_size in roots else None,
        "consistency": proof,
        "commands": commands,
        "log_key": log_key,
    }


@get("/log", guards=[_guard], include_in_schema=False)
async def log_page(
    request: Request[Any, Any, Any],
    old: FromQuery[int | None] = None,
    new: FromQuery[int | None] = None,
    before: FromQuery[int | None] = None,
) -> Response[str]:
    """The transparency log: checkpoints and a consistency view between two tree sizes."""
    context = await _run(log_context, _registry(request), old=old, new=new, before=before, base=_base_url(request))
    return _html(request, "log.html", **context)


@get("/log/registry-key.pem", guards=[_guard], include_in_schema=False)
async def registry_key_pem(request: Request[Any, Any, Any]) -> Response[str]:
    """The registry's log public key as PEM, what ``kvgraft-verify log --registry-key`` reads
    (the same key as ``GET /v1/log/key``, without needing a JSON tool to extract it)."""
    key = await _run(_registry(request).log_key)
    return Response(content=key["public_key_pem"], media_type="application/x-pem-file")


# --- publishers --------------------------------------------------------------------------------


def publishers_context(registry: Registry) -> dict[str, Any]:
    """Every publisher with its keys and how many entries of each kind it published."""
    with registry.db.lock:
        publishers = registry.publishers()
        counts: dict[str, dict[str, int]] = {}
        for name, kind, n in _query(registry, "SELECT publisher, kind, count(*) FROM entries GROUP BY publisher, kind"):
            counts.setdefault(name, {})[kind] = int(n)
    return {"publishers": publishers, "counts": counts}


@get("/publishers", guards=[_guard], include_in_schema=False)
async def publishers(request: Request[Any, Any, Any]) -> Response[str]:
    """Publishers and their registered keys."""
    return _html(request, "publishers.html", **await _run(publishers_context, _registry(request)))


def trusted_keys_document(registry: Registry, name: str) -> dict[str, Any]:
    """A trusted-keys file (docs/trusted-keys.md) holding ``name``'s registered keys."""
    keys = tuple(key for key, owner in registry.accounts.registered_keys().values() if owner == name)
    if not keys:
        raise NotFoundError(f"no publisher named {name!r} has a registered key here", hint="see /publishers")
    return TrustedKeys(keys).to_json()


@get("/publishers/{name:str}/trusted-keys.json", guards=[_guard], include_in_schema=False)
async def publisher_trusted_keys(request: Request[Any, Any, Any], name: FromPath[str]) -> Response[dict[str, Any]]:
    """A publisher's registered keys as a trusted-keys file, for ``kvgraft-verify --trusted-keys``."""
    document = await _run(trusted_keys_document, _registry(request), name)
    return Response(
        content=document,
        media_type="application/json",
        headers={"Content-Disposition": f'attachment; filename="{quote(name)}-trusted-keys.json"'},
    )


# --- mounting ----------------------------------------------------------------------------------


def ui_router() -> Router:
    """The UI's pages, HTML error pages for them, and ``/static`` (the bundled CSS and JS)."""
    pages = Router(
        path="/",
        route_handlers=[
            overview, artifacts, artifact, records, record, entry_redirect, log_page, registry_key_pem, publishers,
            publisher_trusted_keys,
        ],
        exception_handlers={RegistryError: _html_error, HTTPException: _html_error, Exception: _html_error},
    )
    return pages


def static_router() -> Router:
    """``/static``: the UI's stylesheet and script, from ``kvgraft.web``."""
    return create_static_files_router(path="/static", directories=[STATIC_DIR], include_in_schema=False)
