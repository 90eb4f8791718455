"""The provenance browser: HTML pages under ``/`` rendered from ``kvgraft.web`` templates.

This module holds the view contexts and their handlers only. Every read goes through the
registry's read model (``queries.py``: the same rows, filters and lineage walk as the API),
under ``registry.db.lock`` for as long as the rows take, no longer. Signatures are re-verified
by this server after that lock is released (``signatures.py``: against the publisher's
registered keys, cached per envelope digest and key set): a page never repeats the registry's
earlier judgement unchecked. Lineage walks stop at ``settings.max_lineage_depth`` ancestors or
at a cycle, and say so. Pages work without JavaScript; every value from an entry reaches the
browser escaped, with control, bidi and zero-width characters shown as escapes
(``kvgraft.web.visible``). The commands a page shows are built word by word
(``kvgraft.web.shell_word``) against the registry's configured public URL, else its bind
address, else ``$REGISTRY``: never the request's ``Host`` header.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Callable
from typing import Any, TypeVar
from urllib.parse import quote, urlencode

import anyio.to_thread
from litestar import Request, Response, Router, get
from litestar.connection import ASGIConnection
from litestar.exceptions import HTTPException
from litestar.file_system import BaseLocalFileSystem
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
    payload_unverified,
)
from kvgraft.verifier import (
    LOGITS_DIR,
    RECORD_FILE,
    TrustedKeys,
)
from kvgraft.web import (
    REGISTRY_VARIABLE,
    STATIC_DIR,
    command,
    lineage_view,
    record_summary,
    render_page,
    shell_word,
    url_word,
)

from .. import queries
from ..blobs.store import parse_digest_ref
from ..entries import RECORD_KINDS
from ..errors import ArtifactNotFoundError, BadRequestError, EntryNotFoundError, NotFoundError, RegistryError
from ..queries import ArtifactFilter, EntryRow, EntrySummary, Listing, RecordFilter, Seek, SubjectRow
from ..service import Registry
from .record_views import evaluation_context, exactness_context, related_records, stored_statement
from .security import scrub_paths
from .signatures import publisher_key_rows, verified_status

logger = logging.getLogger("kvgraft.registry")

T = TypeVar("T")

PAGE_SIZE = 50
RECENT = 12
_PREVIEW = 160

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
    elif isinstance(exc, HTTPException) and exc.status_code in (404, 405):
        # No page here (or not for this method): say which address, never a bare "Not Found".
        status, title = exc.status_code, "No such page"
        message = f"{request.method} {request.url.path[:200]} is not part of this registry"
        hint = "start from the overview, or search the artifacts by text, digest, publisher or model"
    elif isinstance(exc, HTTPException):
        status, title, message, hint = exc.status_code, "Request refused", str(exc.detail), "check the address and its parameters"
    else:
        logger.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        status, title = 500, "Internal error"
        message, hint = "the registry failed to render this page", "retry; if it persists, the server log has the details"
    if status >= 500 and isinstance(exc, RegistryError):
        logger.error("%s %s failed: %s", request.method, request.url.path, exc, exc_info=exc)
    # A page never shows where the data lives, and a server fault may name any file: the API's rule.
    roots = getattr(request.app.state, "scrub_roots", ())
    message = scrub_paths(message, roots, server_side=status >= 500)
    hint = scrub_paths(hint, roots, server_side=status >= 500) if hint is not None else None
    headers = exc.headers() if isinstance(exc, RegistryError) else {}
    response = _html(request, "error.html", status=status, title=title, message=message, hint=hint)
    response.headers.update(headers)
    return response


#: Where the machine interfaces live (the API, its OpenAPI schema, the log's tiles): an error
#: there is problem JSON. Every other path is the browser's: its errors are HTML pages.
_MACHINE_PREFIXES = ("/v1/", "/schema", "/tlog/")


def browser_error_page(request: Request[Any, Any, Any], exc: HTTPException) -> Response[str] | None:
    """The HTML error page for a refused request to a browser path (a page that does not exist,
    ``/publishers/NAME/x``, a method pages do not take); None for the machine interfaces."""
    path = request.scope.get("path", "")
    if path in ("/v1", "/tlog") or path.startswith(_MACHINE_PREFIXES):
        return None
    return _html_error(request, exc)


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


def _payload_raw(envelope_bytes: bytes) -> Any:
    """A stored envelope's payload as plain JSON, no signature checked and no model validated;
    None when it cannot be read."""
    try:
        return json.loads(payload_unverified(envelope_bytes, what="stored envelope"))
    except (DocumentError, ValueError, RecursionError):
        return None


def _payload_json(envelope_bytes: bytes) -> dict[str, Any]:
    # Listings only: a cheap decode without model validation (the detail page validates).
    value = _payload_raw(envelope_bytes)
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


def _listed(listing: Listing[EntrySummary], envelopes: dict[int, bytes]) -> list[dict[str, Any]]:
    """A listing's rows as the templates show them; a record (its envelope in ``envelopes``) gets its one-line summary."""
    out = []
    for r in listing.rows:
        text = r.text
        if text is not None and len(text) > _PREVIEW:
            text = text[:_PREVIEW] + "\u2026"
        start, end = r.position_start, r.position_end
        item: dict[str, Any] = {
            "log_index": r.log_index, "digest": r.digest, "kind": r.kind, "publisher": r.publisher,
            "integrated_at": r.integrated_at, "artifact_digest": r.artifact_digest, "model": r.model_name,
            "profile": r.profile_name, "parent": r.parent, "positions": None if start is None or end is None else (start, end),
            "text": text, "predicate_type": r.predicate_type,
        }
        if r.log_index in envelopes:
            item["summary"] = record_summary(r.kind, _payload_json(envelopes[r.log_index]))
        out.append(item)
    return out


def _listing(registry: Registry, where: queries.Where, seek: Seek) -> tuple[Listing[EntrySummary], dict[int, bytes]]:
    """A browser listing's page and its records' envelopes (artifacts are described by columns); under the lock."""
    listing = queries.summaries(registry.db, where, seek, text_chars=_PREVIEW + 1)
    return listing, queries.envelopes(registry.db, [r.log_index for r in listing.rows if r.kind != "artifact"])


def overview_context(registry: Registry) -> dict[str, Any]:
    """Counts, the latest checkpoint and the most recent entries."""
    with registry.db.lock:
        totals = queries.totals(registry.db)
        recent, envelopes = _listing(registry, queries.ALL, Seek(RECENT, before=_before(None)))
        head = registry.head
    counts = totals.kinds
    return {
        "counts": dict(counts),
        "artifacts": counts.get("artifact", 0),
        "records": sum(counts.get(k, 0) for k in RECORD_KINDS),
        "publishers": totals.publishers,
        "keys": totals.keys,
        "head": {"size": head.size, "root_hash": head.root_hash.hex(), "note": head.note.decode("utf-8")},
        "recent": _listed(recent, envelopes),
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
    """One page of artifacts, newest first, filtered as ``GET /v1/artifacts`` filters (``queries.ArtifactFilter``).

    The search box takes more than words: a digest or a short one (``redirect`` to the one page
    it names, or ``candidates`` when it names several), or a publisher's or a model's exact name
    (the listing filtered by it: ``searched_as``)."""
    searched_as, candidates = None, []
    if q and q.strip():
        term = q.strip()
        prefix = queries.parse_digest_prefix(term)
        # A hex word is a digest when it says so (sha256:) or is as long as git's abbreviations (7).
        if prefix is not None and (term.startswith("sha256:") or len(prefix) >= 7):
            with registry.db.lock:
                matches = queries.digest_prefix_matches(registry.db, prefix)
            if len(matches) == 1:
                return {"redirect": _match_url(matches[0])}
            candidates = [(_match_url(m), m.digest, f"{m.kind}, entry {m.log_index} by {m.publisher}")
                          for m in matches[: queries.MAX_PREFIX_MATCHES]]
            if candidates:
                q = None
        if q:
            with registry.db.lock:
                facets = queries.artifact_facets(registry.db)
            if publisher is None and term in facets.publishers:
                publisher, q, searched_as = term, None, f"publisher {term}"
            elif model is None and term in facets.models:
                model, q, searched_as = term, None, f"model {term}"
    # Checked and bounded before the database lock is taken, as the API's.
    where = ArtifactFilter(model=model, profile=profile, parent=parent, publisher=publisher, q=q).where(registry.settings)
    with registry.db.lock:
        total = queries.count(registry.db, where)
        listing, envelopes = _listing(registry, where, Seek(PAGE_SIZE, before=_before(before)))
        facets = queries.artifact_facets(registry.db)
    filters = {"q": q, "model": model, "profile": profile, "publisher": publisher, "parent": parent}
    rows = _listed(listing, envelopes)
    return {
        "items": rows,
        "total": total,
        "filters": filters,
        "facets": facets._asdict(),
        "search_q": q or "",
        "searched_as": searched_as,
        "candidates": candidates,
        "next_url": _url("/artifacts", **filters, before=rows[-1]["log_index"]) if listing.more else None,
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
) -> Response[Any]:
    """Artifacts, newest first: search the source text (or go to a digest, a publisher, a model), filter by model, profile, publisher, parent."""
    context = await _run(
        artifacts_context, _registry(request), q=q, model=model, profile=profile, publisher=publisher, parent=parent, before=before
    )
    if "redirect" in context:
        return Redirect(path=context["redirect"])
    return _html(request, "artifacts.html", **context)


def _ancestors(registry: Registry, digest: str, parent: str | None) -> tuple[list[dict[str, Any]], str | None]:
    """The lineage walk (``queries.ancestors``) as the page lists it, and why it stopped early (under the lock)."""
    walk = queries.ancestors(registry.db, digest, parent, registry.settings.max_lineage_depth)
    parents = []
    for a in walk.ancestors:
        known = a.entry.artifact if a.entry is not None else None
        parents.append({
            "digest": a.digest,
            "log_index": None if a.entry is None else a.entry.log_index,
            "positions": None if known is None else (known.position_start, known.position_end),
        })
    return parents, walk.cut


def _entry_dict(row: EntryRow, subjects: list[SubjectRow]) -> dict[str, Any]:
    # Shaped like the API's entry metadata (the fields the pages use).
    a = row.artifact
    return {
        "log_index": row.log_index, "digest": row.digest, "leaf_hash": row.leaf_hash.hex(), "kind": row.kind,
        "publisher": row.publisher, "keyids": list(row.keyids), "integrated_at": row.integrated_at, "size": row.size,
        "predicate_type": row.predicate_type, "subjects": [s._asdict() for s in subjects],
        "envelope_url": f"/v1/entries/{quote(row.digest, safe=':')}/envelope",
        "artifact": None if a is None else {"digest": a.digest, "positions": (a.position_start, a.position_end)},
    }


def _entry_page_rows(registry: Registry, row: EntryRow) -> tuple[dict[str, Any], bytes]:
    """An entry page's entry (with its subjects) and its envelope bytes as logged (under the lock)."""
    subjects = queries.subjects(registry.db, [row.log_index]).get(row.log_index, [])
    stored = queries.stored_envelope(registry.db, row.log_index)
    return _entry_dict(row, subjects), b"" if stored is None else stored.envelope


def artifact_context(registry: Registry, digest: str, base: str | None, signer: str | None = None) -> dict[str, Any]:
    """An artifact page: statement fields, re-verified signature, lineage, proof, downloads, commands.

    No entry owns a tensor digest: the page shows the first entry signed by key ``signer`` when
    given (``?signer=KEYID``), else the first logged, and names every other claim with a link to
    its own view (``other_entries``).

    ``base`` is the registry address the commands use (``command_base``). The database lock is
    held only to read rows; the signature is verified after it is released. The context's
    ``template`` is ``artifact.html``, or ``record.html`` in its raw form when the stored
    statement no longer reads as a KV artifact statement (old data).
    """
    parse_digest_ref(digest, what="artifact digest")
    signer = queries.check_signer(signer)
    refers = RecordFilter(artifact=digest).where(artifacts_hint="")
    with registry.db.lock:
        rows = queries.artifact_entries(registry.db, digest)
        first = queries.claim_by(rows, signer)
        if first is None or first.artifact is None:
            by = "" if signer is None or not rows else f" signed by key {signer}"
            raise ArtifactNotFoundError(f"no KV artifact with tensors {digest}{by} is in this registry")
        entry, envelope_bytes = _entry_page_rows(registry, first)
        parents, cut = _ancestors(registry, digest, first.artifact.parent)
        children = [
            {"digest": c.artifact.digest, "log_index": c.log_index, "publisher": c.publisher,
             "positions": (c.artifact.position_start, c.artifact.position_end)}
            for c in queries.children(registry.db, digest) if c.artifact is not None
        ]
        records = [
            {"log_index": r.log_index, "digest": r.digest, "kind": r.kind, "publisher": r.publisher,
             "integrated_at": r.integrated_at}
            for r in queries.entries(registry.db, refers, Seek(PAGE_SIZE)).rows
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
        "other_entries": [
            {"log_index": r.log_index, "digest": r.digest, "publisher": r.publisher, "keyids": list(r.keyids)}
            for r in rows if r.log_index != first.log_index
        ],
        "statement": statement,
        "p": p,
        "lineage": lineage_view(artifact, parents, children, cut=cut, limit=registry.settings.max_lineage_depth),
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
        return stored_statement(envelope_bytes), None, None
    except RegistryError as e:
        problem = e.message
    except RecursionError:
        problem = "the stored statement is nested too deeply to read"
    return None, _payload_raw(envelope_bytes), problem


def _match_url(match: queries.DigestMatch) -> str:
    return f"/{'artifacts' if match.kind == 'artifact' else 'records'}/{match.digest}"


def short_digest_target(registry: Registry, ref: str) -> Redirect | dict[str, Any] | None:
    """A short digest in a page's path, resolved as git resolves an abbreviated name: a redirect
    to the one artifact or record it names; the error page's context listing the candidates when
    it names several (``queries.digest_prefix_matches``); ``NotFoundError`` when it names none.
    None when ``ref`` is a full digest or no short digest at all (the page's own checks apply)."""
    prefix = queries.parse_digest_prefix(ref)
    if prefix is None or len(prefix) == 64:
        return None
    with registry.db.lock:
        matches = queries.digest_prefix_matches(registry.db, prefix)
    if not matches:
        raise NotFoundError(f"no artifact or record digest starts with sha256:{prefix}",
                            hint="check the digest, or search for the artifact's text at /artifacts")
    if len(matches) == 1:
        return Redirect(path=_match_url(matches[0]))
    more = " (and more)" if len(matches) > queries.MAX_PREFIX_MATCHES else ""
    return {
        "title": "Ambiguous short digest",
        "message": f"sha256:{prefix} is the start of {min(len(matches), queries.MAX_PREFIX_MATCHES)} digests{more}",
        "hint": "use more of the digest: one of those below, in full or as a longer unique prefix",
        "candidates": [(_match_url(m), m.digest, f"{m.kind}, entry {m.log_index} by {m.publisher}")
                       for m in matches[: queries.MAX_PREFIX_MATCHES]],
    }


@get("/artifacts/{digest:str}", guards=[_guard], include_in_schema=False)
async def artifact(
    request: Request[Any, Any, Any], digest: FromPath[str], signer: FromQuery[str | None] = None
) -> Response[Any]:
    """One artifact as one entry claims it (``?signer=KEYID``: the first that key signed), with who signed it and what proves it."""
    registry = _registry(request)
    short = await _run(short_digest_target, registry, digest)
    if short is not None:
        return short if isinstance(short, Redirect) else _html(request, "error.html", status=409, **short)
    context = await _run(artifact_context, registry, digest, command_base(registry), signer)
    return _html(request, context.pop("template"), **context)


# --- records -----------------------------------------------------------------------------------


def records_context(registry: Registry, *, kind: str | None, publisher: str | None, artifact: str | None, before: int | None) -> dict[str, Any]:
    """One page of records, newest first, filtered as ``GET /v1/records`` filters (``queries.RecordFilter``)."""
    chosen = RecordFilter(kind=kind, publisher=publisher, artifact=artifact)
    hint = "browse artifacts at /artifacts"
    where = chosen.where(artifacts_hint=hint)
    with registry.db.lock:
        total = queries.count(registry.db, where)
        listing, envelopes = _listing(registry, where, Seek(PAGE_SIZE, before=_before(before)))
        publishers = queries.publisher_names(registry.db)
    items = _listed(listing, envelopes)
    filters = {"type": chosen.resolved_kind(artifacts_hint=hint), "publisher": publisher, "artifact": artifact}
    return {
        "items": items,
        "total": total,
        "filters": filters,
        "kinds": RECORD_KINDS,
        "publishers": publishers,
        "next_url": _url("/records", **filters, before=items[-1]["log_index"]) if listing.more else None,
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


def record_context(registry: Registry, digest: str, base: str | None) -> dict[str, Any]:
    """A record page by its entry (envelope) digest; artifacts redirect to their own page.

    ``base`` is the registry address the commands use (``command_base``). Rows are read under
    the database lock, the signature is verified after it. A statement that no longer parses
    (old data) is shown raw with the reason (``raw_error``) instead of an error page.
    """
    parse_digest_ref(digest, what="entry digest")
    with registry.db.lock:
        row = queries.entry_by_digest(registry.db, digest)
        if row is None:
            raise EntryNotFoundError(f"no entry has digest {digest}")
        entry, envelope_bytes = _entry_page_rows(registry, row)
        if entry["artifact"] is not None:
            return {"kind": "artifact", "entry": entry}
        key_rows = publisher_key_rows(registry, entry["publisher"])
        proof = _proof_context(registry, entry)
        related = related_records(registry, entry)
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
        context["special"] = exactness_context(registry, entry, statement)
        check = command("kvgraft-verify", "exactness", q(directory), *keys)
    elif isinstance(statement, EvaluationStatement):
        context["special"] = evaluation_context(statement)
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
        related=related,
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
    short = await _run(short_digest_target, registry, digest)
    if short is not None:
        return short if isinstance(short, Redirect) else _html(request, "error.html", status=409, **short)
    context = await _run(record_context, registry, digest, command_base(registry))
    if context["kind"] == "artifact":
        return Redirect(path=f"/artifacts/{context['entry']['artifact']['digest']}")
    return _html(request, "record.html", **context)


@get("/entries/{ref:str}", guards=[_guard], include_in_schema=False)
async def entry_redirect(request: Request[Any, Any, Any], ref: FromPath[str]) -> Redirect:
    """An entry by log index or digest: redirected to its artifact or record page."""
    doc = await _run(_registry(request).reader.entry, ref)
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
        listing = queries.checkpoints(registry.db, _before(before), PAGE_SIZE)
        size = head.size
        new_size = size if new is None else new
        if old is None:
            # By default the newest checkpoint at or below half the new size: checkpoints are
            # signed per batch, so the commands below can fetch it (there is always one at 0).
            below_half = queries.checkpoints(registry.db, min(new_size, size) // 2 + 1, 1).rows
            old_size = below_half[0].tree_size if below_half else 0
        else:
            old_size = old
        if not 0 <= old_size <= new_size <= size:
            raise BadRequestError(
                f"a consistency proof needs 0 <= old <= new <= {size}; got old={old_size}, new={new_size}",
                hint=f"pick two tree sizes between 0 and the latest checkpoint's ({size})",
            )
        proof = registry.consistency_proof(old_size, new_size)
        roots = queries.checkpoint_roots(registry.db, [old_size, new_size])
        log_key = registry.log_key()
    checkpoints = [{"size": c.tree_size, "root_hash": c.root_hash.hex(), "created_at": c.created_at} for c in listing.rows]
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
        "next_url": _url("/log", old=old, new=new, before=checkpoints[-1]["size"]) if listing.more else None,
        "first_url": _url("/log", old=old, new=new) if before is not None else None,
        "old": old_size,
        "new": new_size,
        "old_root": roots[old_size].hex() if old_size in roots else None,
        "new_root": roots[new_size].hex() if new_size in roots else None,
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
        publishers = registry.reader.publishers()
        counts = queries.kinds_by_publisher(registry.db)
    return {"publishers": publishers, "counts": counts}


@get("/publishers", guards=[_guard], include_in_schema=False)
async def publishers(request: Request[Any, Any, Any]) -> Response[str]:
    """Publishers and their registered keys."""
    return _html(request, "publishers.html", **await _run(publishers_context, _registry(request)))


def publisher_context(registry: Registry, name: str) -> dict[str, Any]:
    """One publisher: its keys, its entry counts by kind and its most recent entries."""
    with registry.db.lock:
        found = [p for p in registry.reader.publishers() if p["name"] == name]
        if not found:
            raise NotFoundError(f"no publisher named {name[:200]!r} is registered here", hint="see every publisher at /publishers")
        counts = queries.kinds_by_publisher(registry.db).get(name, {})
        recent, envelopes = _listing(registry, queries.Where("publisher = ?", [name]), Seek(RECENT, before=_before(None)))
    return {"pub": found[0], "counts": counts, "recent": _listed(recent, envelopes)}


@get("/publishers/{name:str}", guards=[_guard], include_in_schema=False)
async def publisher(request: Request[Any, Any, Any], name: FromPath[str]) -> Response[str]:
    """One publisher's page: keys, counts and recent entries."""
    return _html(request, "publisher.html", **await _run(publisher_context, _registry(request), name))


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
            publisher, publisher_trusted_keys,
        ],
        exception_handlers={RegistryError: _html_error, HTTPException: _html_error, Exception: _html_error},
    )
    return pages


class _StaticFileSystem(BaseLocalFileSystem):
    """The local file system, where a name the OS cannot look up is simply absent.

    Litestar answers only ``FileNotFoundError`` with 404; a NUL byte (``ValueError``), a name past
    NAME_MAX (``ENAMETOOLONG``), a path through a file (``ENOTDIR``) or an unreadable file would be
    a 500 (or a 401 naming the absolute path): every one is a stranger's URL, so each is a 404.
    """

    async def info(self, path: Any, **kwargs: Any) -> Any:
        try:
            return await super().info(path, **kwargs)
        except FileNotFoundError:
            raise
        except (OSError, ValueError) as e:
            raise FileNotFoundError("no such static file") from e


def static_router() -> Router:
    """``/static``: the UI's stylesheet and script, from ``kvgraft.web``."""
    return create_static_files_router(
        path="/static", directories=[STATIC_DIR], file_system=_StaticFileSystem(), include_in_schema=False
    )
