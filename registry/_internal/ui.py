"""The provenance browser: HTML pages under ``/`` rendered from ``kvgraft.web`` templates.

Handlers read through the registry service (its queries and locks) plus the few read-only
queries the pages need that the API does not have (newest-first listings, counts, facets),
all here. Signatures are re-verified by this server with ``kvgraft.verifier`` against the
publisher's registered keys: a page never repeats the registry's earlier judgement unchecked.
Verification runs outside the database lock and its outcome is remembered per envelope
digest, publisher and set of registered key ids (entries are immutable; a new key changes
the cache key), in a bounded LRU of ``settings.verify_cache_entries``; an envelope with more
than ``settings.max_signatures`` signatures is reported unverified without being checked.
Lineage walks stop at ``settings.max_lineage_depth`` ancestors or at a cycle, and say so.
Pages work without JavaScript; every value from an entry reaches the browser escaped, with
control, bidi and zero-width characters shown as escapes (``kvgraft.web.visible``). The
commands a page shows are built word by word (``kvgraft.web.shell_word``) against the
registry's configured public URL, else its bind address, else ``$REGISTRY``: never the
request's ``Host`` header.
"""

from __future__ import annotations

import base64
import binascii
import functools
import hashlib
import json
import logging
import math
import re
import threading
import weakref
from collections import OrderedDict
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
    TrustedKey,
    TrustedKeys,
    VerificationError,
    b64decode_any,
    harness_hashes,
    load_dataset,
    parse_envelope,
    parse_public_key,
    trusted_key,
    verify_envelope,
)
from kvgraft.web import (
    REGISTRY_VARIABLE,
    STATIC_DIR,
    LineageNode,
    PlotSeries,
    command,
    kl_plot_svg,
    lineage_svg,
    render_page,
    shell_word,
    short_digest,
    url_word,
)

from .blobs import parse_digest_ref
from .entries import RECORD_KINDS, kind_of_filter
from .errors import ArtifactNotFoundError, BadRequestError, EntryNotFoundError, NotFoundError, RegistryError
from .search import search_condition
from .service import Registry

logger = logging.getLogger("kvgraft.registry")

T = TypeVar("T")

PAGE_SIZE = 50
RECENT = 12
#: Ancestors drawn before the chain is shortened to "root, n more, ..., parent".
_DRAWN_ANCESTORS = 3
_DRAWN_CHILDREN = 6
_PREVIEW = 160
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


def command_base(registry: Registry) -> str | None:
    """The registry address a page's commands use: the configured public URL, else the bind address.

    ``None`` when the server knows neither (an app embedded without ``kvgraft serve``): the
    commands then read ``$REGISTRY``. Never the request's ``Host`` header, which any client sets.
    """
    for url in (registry.settings.public_url, registry.settings.admin_url):
        if url:
            return url.rstrip("/")
    return None


def command_note(registry: Registry) -> str:
    """One sentence under the commands: which registry address they use, and how to change it."""
    if registry.settings.public_url:
        return f"The commands fetch from this registry's public address, {registry.settings.public_url.rstrip('/')}."
    if registry.settings.admin_url:
        return (
            f"The commands fetch from the address this server listens on, {registry.settings.admin_url.rstrip('/')}; "
            "from another machine, replace it with the registry's public address (operators: set public_url)."
        )
    return (
        f"This server does not know its public address: set {REGISTRY_VARIABLE} to it before pasting "
        f"({REGISTRY_VARIABLE}=https://registry.example); operators set the registry's public_url."
    )


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
        # A server fault may name files; a page never shows where the data lives.
        message, hint = _without_paths(message), _without_paths(hint)
    headers = exc.headers() if isinstance(exc, RegistryError) else {}
    response = _html(request, "error.html", status=status, title=title, message=message, hint=hint)
    response.headers.update(headers)
    return response


#: An absolute filesystem path (two or more segments), not preceded by a URL scheme or host.
_ABSOLUTE_PATH = re.compile(r"(?<![\w:/.\-])/(?:[^\s/'\":),;]+/)+[^\s/'\":),;]*")


def _without_paths(text: str) -> str:
    """``text`` with absolute filesystem paths replaced by ``<path>`` (for 5xx pages only)."""
    return _ABSOLUTE_PATH.sub("<path>", text)


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
    # Past every log index (DuckDB's BIGINT would refuse a larger parameter): the first page.
    return min(before, 2**62)


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


#: A publisher's registered keys as read under the lock: (key id, PEM) pairs, sorted by key id.
KeyRows = tuple[tuple[str, str], ...]


def publisher_key_rows(registry: Registry, publisher: str) -> KeyRows:
    """The registered keys of ``publisher`` (one short query; take ``registry.db.lock`` around it or not)."""
    rows = _query(
        registry, "SELECT keyid, public_key_pem FROM publisher_keys WHERE publisher = ? ORDER BY keyid", [publisher]
    )
    return tuple((str(k), str(pem)) for k, pem in rows)


class VerifyCache:
    """Signature outcomes by (envelope digest, publisher, registered key ids): a bounded, thread-safe LRU.

    Safe to keep because a stored envelope never changes (its digest names its bytes) and the
    outcome depends on nothing else but the publisher's key set, which is part of the key.
    """

    def __init__(self, entries: int) -> None:
        self.entries = entries
        self._items: OrderedDict[tuple[str, str, tuple[str, ...]], SignatureStatus] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: tuple[str, str, tuple[str, ...]]) -> SignatureStatus | None:
        with self._lock:
            found = self._items.get(key)
            if found is not None:
                self._items.move_to_end(key)
            return found

    def put(self, key: tuple[str, str, tuple[str, ...]], status: SignatureStatus) -> None:
        with self._lock:
            self._items[key] = status
            self._items.move_to_end(key)
            while len(self._items) > self.entries:
                self._items.popitem(last=False)

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)


_CACHES: weakref.WeakKeyDictionary[Registry, VerifyCache] = weakref.WeakKeyDictionary()
_CACHES_LOCK = threading.Lock()


def verify_cache(registry: Registry) -> VerifyCache:
    """The signature cache of ``registry`` (one per open registry, sized by its settings)."""
    with _CACHES_LOCK:
        cache = _CACHES.get(registry)
        if cache is None:
            cache = _CACHES[registry] = VerifyCache(registry.settings.verify_cache_entries)
        return cache


def signature_status(registry: Registry, envelope_bytes: bytes, publisher: str) -> SignatureStatus:
    """Verify ``envelope_bytes`` with the keys registered for ``publisher``; say who signed or why not.

    Reads the keys in one short query, then verifies without holding the database lock.
    """
    with registry.db.lock:
        rows = publisher_key_rows(registry, publisher)
    return verified_status(registry, envelope_bytes, publisher, rows)


def verified_status(registry: Registry, envelope_bytes: bytes, publisher: str, key_rows: KeyRows) -> SignatureStatus:
    """The outcome for ``envelope_bytes`` and ``key_rows``, from the cache or computed now.

    Call it outside ``registry.db.lock``: a miss parses and verifies the envelope.
    """
    key = (hashlib.sha256(envelope_bytes).hexdigest(), publisher, tuple(k for k, _ in key_rows))
    cache = verify_cache(registry)
    found = cache.get(key)
    if found is None:
        found = _verify_now(envelope_bytes, publisher, key_rows, registry.settings.max_signatures)
        cache.put(key, found)
    return found


def _count_signatures(envelope_bytes: bytes) -> int | None:
    # The number of entries in the envelope's "signatures" list, before any model is built.
    try:
        doc = parse_json(envelope_bytes, what="the stored envelope")
    except (DocumentError, RecursionError):
        return None
    signatures = doc.get("signatures") if isinstance(doc, dict) else None
    return len(signatures) if isinstance(signatures, list) else None


def _verify_now(envelope_bytes: bytes, publisher: str, key_rows: KeyRows, max_signatures: int) -> SignatureStatus:
    registered = [k for k, _ in key_rows]
    count = _count_signatures(envelope_bytes)
    if count is not None and count > max_signatures:
        return SignatureStatus(
            publisher, False, [], [],
            f"not verified: too many signatures ({count}; this registry checks at most {max_signatures} per envelope)",
            "an envelope kvgraft signs carries one signature; treat this entry as unsigned", registered,
        )
    try:
        envelope = parse_envelope(envelope_bytes, source="the stored envelope")
    except VerificationError as e:
        return SignatureStatus(publisher, False, [], [], e.message, e.hint, registered)
    except RecursionError:
        message = "the stored envelope is nested too deeply to read"
        return SignatureStatus(publisher, False, [], [], message, "", registered)
    claimed = [sig.keyid for sig in envelope.signatures if sig.keyid]
    keys: list[TrustedKey] = []
    for keyid, pem in key_rows:
        try:
            public = parse_public_key(pem.encode("ascii"), source=f"key {keyid}")
            keys.append(trusted_key(f"{publisher}/{keyid[:16]}", public))
        except (VerificationError, UnicodeEncodeError):
            logger.warning("registered key %s of %r cannot be read; left out of verification", keyid, publisher)
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
    message = (
        f"Ed25519 signature over the DSSE payload verified by this server with {publisher}'s registered key {names}"
    )
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
    except (ValueError, KeyError, TypeError, binascii.Error, RecursionError):
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


def _log_commands(base: str | None, entry: dict[str, Any], tree_size: int, envelope_path: str) -> str:
    index = int(entry["log_index"])
    q = shell_word
    return "\n".join(
        [
            command("curl", "-fsS", "-o", "registry.pub", url_word(base, "/log/registry-key.pem")),
            command(
                "curl", "-fsS", url_word(base, f"/v1/log/checkpoint?tree_size={int(tree_size)}"), ">", "checkpoint"
            ),
            command(
                "curl", "-fsS", url_word(base, f"/v1/log/proof/inclusion?index={index}&tree_size={int(tree_size)}"),
                ">", "inclusion.json",
            ),
            command(
                "kvgraft-verify", "log", "--checkpoint", "checkpoint", "--registry-key", "registry.pub", "--inclusion",
                "inclusion.json", q(envelope_path),
            ),
        ]
    )


def _fetch_lines(base: str | None, entry: dict[str, Any], directory: str, envelope_name: str) -> list[str]:
    """``mkdir`` and ``curl`` lines that fetch an entry's subjects and envelope into ``directory``.

    Subject names, digests and the publisher come from a stranger's statement: each is one
    shell word (``shell_word``), in paths and in URLs alike.
    """
    q = shell_word
    subdirs = sorted({s["name"].rsplit("/", 1)[0] for s in entry["subjects"] if "/" in s["name"]})
    made = [q(f"{directory}/{d}") for d in subdirs] if subdirs else [q(directory)]
    lines = [command("mkdir", "-p", *made)]
    for s in entry["subjects"]:
        blob_url = url_word(base, f"/v1/blobs/{quote(s['digest'], safe=':')}")
        lines.append(command("curl", "-fsS", "-o", q(f"{directory}/{s['name']}"), blob_url))
    envelope_url = url_word(base, entry["envelope_url"])
    lines.append(command("curl", "-fsS", "-o", q(f"{directory}/{envelope_name}"), envelope_url))
    keys_url = f"/publishers/{quote(entry['publisher'], safe='')}/trusted-keys.json"
    lines.append(command("curl", "-fsS", "-o", "trusted-keys.json", url_word(base, keys_url), "  # or your own copy"))
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
    # The API's search, bounded the same way (refused before the database lock is taken).
    settings = registry.settings
    found = search_condition(q, max_terms=settings.max_search_terms, max_length=settings.max_query_length)
    if found is not None:
        where.append(found[0])
        params.extend(found[1])
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


def _cut_note(cut: str | None, limit: int | None, shown: int) -> str | None:
    if cut == "cycle":
        return (f"The parent chain loops back on itself after {shown} ancestor{'' if shown == 1 else 's'}: "
                "an artifact is its own ancestor, so this lineage can never reach a root.")
    if cut == "depth":
        return (f"The parent chain goes on past the {limit} nearest ancestors; this registry walks no further "
                "(its max_lineage_depth setting).")
    return None


def _lineage(
    artifact: dict[str, Any],
    parents: list[dict[str, Any]],
    children: list[dict[str, Any]],
    *,
    cut: str | None = None,
    limit: int | None = None,
) -> dict[str, Any]:
    """The lineage drawing and lists; ``cut`` (from ``ancestors``) marks a walk stopped early."""
    chain_items = list(reversed(parents))  # root first (or the farthest ancestor walked)
    chain: list[LineageNode] = []
    if cut is not None:
        marker = "\u2026 cycle" if cut == "cycle" else "\u2026 more"
        chain.append(LineageNode(marker, "walk stopped here", None, "more"))
    if len(chain_items) > _DRAWN_ANCESTORS:
        # The root, a marker for those in between, and the nearest parents.
        hidden = len(chain_items) - _DRAWN_ANCESTORS
        chain.append(_node(chain_items[0], "ancestor"))
        chain.append(LineageNode(f"\u2026 {hidden} more", "ancestors", None, "more"))
        chain += [_node(p, "ancestor") for p in chain_items[-(_DRAWN_ANCESTORS - 1):]]
    else:
        chain += [_node(p, "ancestor") for p in chain_items]
    start, end = artifact["positions"]
    current = LineageNode(short_digest(artifact["digest"], 10), f"this \u00b7 pos {start}\u2013{end}", None, "current")
    drawn_children = [_node(c, "child") for c in children[:_DRAWN_CHILDREN]]
    if len(children) > _DRAWN_CHILDREN:
        drawn_children.append(
            LineageNode(f"+ {len(children) - _DRAWN_CHILDREN} more", "children", f"/artifacts?parent={artifact['digest']}", "more")
        )
    return {
        "svg": lineage_svg(chain, current, drawn_children),
        "parents": parents,
        "children": children,
        "cut": cut,
        "cut_note": _cut_note(cut, limit, len(parents)),
    }


# Ancestors in one recursive query (nearest first), each artifact described by its first entry,
# as the registry's own lineage does. The walk stops one step past the depth limit (so that a
# cut is known) and at the first digest seen twice (a cycle, possible in old data).
_ANCESTORS_SQL = """
WITH RECURSIVE firsts AS (
    SELECT artifact_digest, min(log_index) AS log_index, arg_min(parent, log_index) AS parent,
           arg_min(position_start, log_index) AS position_start, arg_min(position_end, log_index) AS position_end
    FROM entries WHERE kind = 'artifact' GROUP BY artifact_digest
), chain(digest, depth, seen, repeated) AS (
    SELECT CAST(? AS VARCHAR), 0, [CAST(? AS VARCHAR)], false
    UNION ALL
    SELECT f.parent, c.depth + 1, list_append(c.seen, f.parent), list_contains(c.seen, f.parent)
    FROM chain c JOIN firsts f ON f.artifact_digest = c.digest
    WHERE f.parent IS NOT NULL AND NOT c.repeated AND c.depth <= ?
)
SELECT c.digest, f.log_index, f.position_start, f.position_end, c.repeated
FROM chain c LEFT JOIN firsts f ON f.artifact_digest = c.digest WHERE c.depth > 0 ORDER BY c.depth
"""


def ancestors(registry: Registry, digest: str, limit: int) -> tuple[list[dict[str, Any]], str | None]:
    """At most ``limit`` ancestors of ``digest``, nearest first, and why the walk stopped early.

    The reason is ``None`` (the root was reached, or a parent has no entry here), ``"depth"``
    (the chain goes on past ``limit``) or ``"cycle"`` (a parent repeats an artifact of the
    chain; the repeated one is not listed). Run it under ``registry.db.lock``.
    """
    rows = _query(registry, _ANCESTORS_SQL, [digest, digest, int(limit)])
    out: list[dict[str, Any]] = []
    for d, i, a, b, repeated in rows:
        if repeated:
            return out, "cycle"
        if len(out) == limit:
            return out, "depth"
        positions = None if i is None else (int(a), int(b))
        out.append({"digest": d, "log_index": None if i is None else int(i), "positions": positions})
    return out, None


_RECORD_KINDS_SQL = "(" + ", ".join(f"'{k}'" for k in RECORD_KINDS) + ")"


def _entry_dict(r: tuple[Any, ...], subjects: list[dict[str, str]]) -> dict[str, Any]:
    # Columns of _ENTRY_SQL, shaped like the API's entry metadata (the fields the pages use).
    return {
        "log_index": int(r[0]), "digest": r[1], "leaf_hash": bytes(r[2]).hex(), "kind": r[3], "publisher": r[4],
        "keyids": list(r[5]), "integrated_at": r[6], "size": int(r[7]), "predicate_type": r[8], "subjects": subjects,
        "envelope_url": f"/v1/entries/{quote(r[1], safe=':')}/envelope",
        "artifact": None if r[9] is None else {"digest": r[9], "positions": (int(r[10]), int(r[11]))},
    }


_ENTRY_SQL = (
    "SELECT log_index, digest, leaf_hash, kind, publisher, keyids, integrated_at, octet_length(envelope), predicate_type, "
    "artifact_digest, position_start, position_end, envelope FROM entries"
)


def _subjects_of(registry: Registry, index: int) -> list[dict[str, str]]:
    rows = _query(registry, "SELECT name, digest FROM entry_subjects WHERE log_index = ? ORDER BY name", [index])
    return [{"name": n, "digest": d} for n, d in rows]


def artifact_context(registry: Registry, digest: str, base: str | None) -> dict[str, Any]:
    """An artifact page: statement fields, re-verified signature, lineage, proof, downloads, commands.

    ``base`` is the registry address the commands use (``command_base``). The database lock is
    held only to read rows; the signature is verified after it is released. The context's
    ``template`` is ``artifact.html``, or ``record.html`` in its raw form when the stored
    statement no longer reads as a KV artifact statement (old data).
    """
    parse_digest_ref(digest, what="artifact digest")
    with registry.db.lock:
        rows = _query(registry, _ENTRY_SQL + " WHERE artifact_digest = ? AND kind = 'artifact' ORDER BY log_index", [digest])
        if not rows:
            raise ArtifactNotFoundError(f"no KV artifact with tensors {digest} is in this registry")
        first = rows[0]
        entry = _entry_dict(first, _subjects_of(registry, int(first[0])))
        envelope_bytes = bytes(first[12])
        parents, cut = ancestors(registry, digest, registry.settings.max_lineage_depth)
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
        key_rows = publisher_key_rows(registry, entry["publisher"])
    # Outside the lock: a slow envelope stalls only this page, never the registry.
    signature = verified_status(registry, envelope_bytes, entry["publisher"], key_rows)
    directory = "art"
    envelope_path = f"{directory}/statement.dsse.json"
    fetch = _fetch_lines(base, entry, directory, "statement.dsse.json")
    verify = [
        command(
            "kvgraft-verify", "envelope", shell_word(envelope_path), "--trusted-keys", "trusted-keys.json",
            "--artifact-dir", shell_word(directory),
        ),
        _log_commands(base, entry, proof["tree_size"], envelope_path),
    ]
    statement, statement_json, problem = _read_statement(envelope_bytes)
    if statement is not None and not isinstance(statement, KvArtifactStatement):
        problem = (
            f"entry {entry['log_index']} is indexed as an artifact but holds a {statement.predicate_type} statement"
        )
    common = {
        "entry": entry,
        "signature": signature,
        "proof": proof,
        "downloads": _downloads(entry, proof["tree_size"]),
        "verify_command": "\n".join([*fetch, *verify]),
        "command_note": command_note(registry),
    }
    if problem is not None or not isinstance(statement, KvArtifactStatement):
        return {**common, "template": "record.html", "kind": "artifact", "special": {}, "statement": None,
                "statement_json": statement_json, "raw_error": problem or "the statement cannot be read",
                "logits_dir": LOGITS_DIR}
    p = statement.predicate
    artifact = {
        "digest": digest, "positions": (p.positions.start, p.positions.end), "tokens": p.positions.end - p.positions.start
    }
    return {
        **common,
        "template": "artifact.html",
        "artifact": artifact,
        "other_entries": [{"log_index": int(r[0]), "digest": r[1], "publisher": r[4]} for r in rows[1:]],
        "statement": statement,
        "p": p,
        "lineage": _lineage(artifact, parents, children, cut=cut, limit=registry.settings.max_lineage_depth),
        "records": records,
        "pull_command": command(
            "kvgraft", "pull", "--registry", _registry_word(base), shell_word(digest), "--out", shell_word(directory),
            "--trusted-keys", "trusted-keys.json",
        ),
    }


def _registry_word(base: str | None) -> str:
    return f'"${REGISTRY_VARIABLE}"' if base is None else shell_word(base)


def _read_statement(envelope_bytes: bytes) -> tuple[Statement | None, Any, str | None]:
    """The stored statement typed, its JSON for display, and why it could not be typed (or None).

    Entries were checked when published, but a page must render old data too: an envelope
    whose statement no longer parses is shown raw with the reason, never as an error page.
    """
    try:
        return _statement(envelope_bytes), None, None
    except RegistryError as e:
        problem = e.message
    except RecursionError:
        problem = "the stored statement is nested too deeply to read"
    try:
        doc = json.loads(envelope_bytes)
        raw: Any = json.loads(base64.b64decode(doc["payload"]))
    except (ValueError, KeyError, TypeError, binascii.Error, RecursionError):
        raw = None
    return None, raw, problem


@get("/artifacts/{digest:str}", guards=[_guard], include_in_schema=False)
async def artifact(request: Request[Any, Any, Any], digest: FromPath[str]) -> Response[str]:
    """One artifact, with who signed it and what proves it."""
    registry = _registry(request)
    context = await _run(artifact_context, registry, digest, command_base(registry))
    return _html(request, context.pop("template"), **context)


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
    except (KeyError, TypeError, ValueError, ArithmeticError):
        # ArithmeticError: a number no float holds (an int beyond 1.8e308) in a format.
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
        "mean_argmax_agreement": _mean([s.argmax_agreement for s in samples]),
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


def _finite_float(value: Any) -> float | None:
    try:
        f = float(value)
    except (OverflowError, TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def _same(a: Any, b: Any) -> bool:
    """Whether a claimed figure equals the recomputed one (floats within 1e-9 relative); total."""
    if isinstance(a, float) or isinstance(b, float):
        fa, fb = _finite_float(a), _finite_float(b)
        if fa is None or fb is None:
            # Beyond float range or not finite: only the very same value is the same.
            return bool(a == b)
        return abs(fa - fb) <= 1e-9 * max(1.0, abs(fa))
    return bool(a == b)


def _mean(values: list[Any]) -> Any:
    # A mean of signed numbers, which may be ints no float holds: then an int mean.
    if not values:
        return 0.0
    total = sum(values)
    try:
        return total / len(values)
    except OverflowError:
        return total // len(values)


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


def record_context(registry: Registry, digest: str, base: str | None) -> dict[str, Any]:
    """A record page by its entry (envelope) digest; artifacts redirect to their own page.

    ``base`` is the registry address the commands use (``command_base``). Rows are read under
    the database lock, the signature is verified after it. A statement that no longer parses
    (old data) is shown raw with the reason (``raw_error``) instead of an error page.
    """
    parse_digest_ref(digest, what="entry digest")
    with registry.db.lock:
        rows = _query(registry, _ENTRY_SQL + " WHERE digest = ?", [digest])
        if not rows:
            raise EntryNotFoundError(f"no entry has digest {digest}")
        entry = _entry_dict(rows[0], _subjects_of(registry, int(rows[0][0])))
        if entry["artifact"] is not None:
            return {"kind": "artifact", "entry": entry}
        envelope_bytes = bytes(rows[0][12])
        key_rows = publisher_key_rows(registry, entry["publisher"])
        proof = _proof_context(registry, entry)
    signature = verified_status(registry, envelope_bytes, entry["publisher"], key_rows)
    statement, raw_json, problem = _read_statement(envelope_bytes)
    directory = "rec"
    q = shell_word
    fetch = _fetch_lines(base, entry, directory, RECORD_FILE)
    context: dict[str, Any] = {"kind": entry["kind"], "special": {}, "raw_error": problem}
    envelope_path = f"{directory}/{RECORD_FILE}"
    keys = ("--trusted-keys", "trusted-keys.json")
    if isinstance(statement, ExactnessStatement):
        # Its one query takes the lock itself; the companions' statements are parsed without it.
        context["special"] = _exactness_context(registry, entry, statement)
        check = command("kvgraft-verify", "exactness", q(directory), *keys)
    elif isinstance(statement, EvaluationStatement):
        context["special"] = _evaluation_context(statement)
        file = context["special"]["dataset_file"]
        dataset = f"data/datasets/{file.name}" if file else "DATASET.jsonl"
        check = command("kvgraft-verify", "eval", q(directory), "--dataset", q(dataset), *keys)
    else:
        check = command("kvgraft-verify", "envelope", q(envelope_path), *keys, "--artifact-dir", q(directory))
    if isinstance(statement, ReplayStatement):
        context["special"] = {"pre": statement.predicate.pre_registration}
    elif isinstance(statement, PreRegistrationStatement):
        context["special"] = {"settings": statement.predicate.settings}
    context.update(
        entry=entry,
        statement=statement,
        statement_json=raw_json if statement is None else statement.model_dump(mode="json", by_alias=True),
        signature=signature,
        proof=proof,
        downloads=_downloads(entry, proof["tree_size"]),
        verify_command="\n".join([*fetch, check, _log_commands(base, entry, proof["tree_size"], envelope_path)]),
        command_note=command_note(registry),
        logits_dir=LOGITS_DIR,
    )
    return context


@get("/records/{digest:str}", guards=[_guard], include_in_schema=False)
async def record(request: Request[Any, Any, Any], digest: FromPath[str]) -> Response[Any]:
    """One record by its entry digest: its figures, re-verified signature and log proof."""
    registry = _registry(request)
    context = await _run(record_context, registry, digest, command_base(registry))
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


def log_context(
    registry: Registry, *, old: int | None, new: int | None, before: int | None, base: str | None
) -> dict[str, Any]:
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
    old_size, new_size = int(old_size), int(new_size)
    commands = "\n".join(
        [
            command("curl", "-fsS", "-o", "registry.pub", url_word(base, "/log/registry-key.pem")),
            command("curl", "-fsS", url_word(base, f"/v1/log/checkpoint?tree_size={old_size}"), ">", "checkpoint-old"),
            command("curl", "-fsS", url_word(base, f"/v1/log/checkpoint?tree_size={new_size}"), ">", "checkpoint-new"),
            command("curl", "-fsS", url_word(base, f"/v1/log/proof/consistency?old={old_size}&new={new_size}"), ">",
                    "consistency.json"),
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
        "command_note": command_note(registry),
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
    registry = _registry(request)
    context = await _run(log_context, registry, old=old, new=new, before=before, base=command_base(registry))
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
