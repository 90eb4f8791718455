"""The API's documents built from the read model's rows (``queries.EntryRow``): entries, artifacts,
pages and their cursors.

Pure functions of rows, no database: the reader (reader.py) and the publish path (service.py) build
every entry document here, so an entry answered to its publisher and read back later are the same.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from kvgraft.schemas import DocumentError, parse_json, payload_unverified
from kvgraft.verifier import MalformedInputError

from .errors import BadRequestError, RegistryError
from .queries import EntryRow, Listing

#: Characters of an artifact's source text a listing shows.
TEXT_PREVIEW = 200


@dataclass(frozen=True)
class Page:
    """One page of a listing, and the cursor of the next (None at the end)."""

    items: list[dict[str, Any]]
    next_cursor: str | None


#: A cursor is the decimal log index the next page continues after: any such number is a valid
#: cursor (the page after it may be empty), so the API's schema can say exactly what it accepts.
_CURSOR = re.compile(r"(?:0|[1-9][0-9]{0,18})", re.ASCII)


def encode_cursor(log_index: int) -> str:
    """The cursor meaning "after entry ``log_index``" (stable: the log only grows): its decimal."""
    return str(log_index)


def decode_cursor(cursor: str | None) -> int:
    """The log index a cursor continues after (-1 for the first page, no cursor or an empty one)."""
    if cursor is None or cursor == "":
        return -1
    if _CURSOR.fullmatch(cursor) is None:
        raise BadRequestError(
            f"cursor {cursor[:40]!r} is not one this registry issued",
            hint="pass next_cursor from the previous page unchanged, or no cursor for the first page",
        )
    return int(cursor)


def other_claims(rows: list[EntryRow], chosen: EntryRow) -> list[dict[str, Any]]:
    """Every entry of an artifact but ``chosen``, in log order: each a claim by its own signers."""
    return [
        {"log_index": r.log_index, "digest": r.digest, "publisher": r.publisher, "keyids": list(r.keyids)}
        for r in rows if r.log_index != chosen.log_index
    ]


def statement_json(envelope_bytes: bytes) -> Any:
    """The statement of a stored envelope, as JSON (its signature was verified when it was stored)."""
    try:
        # Verified when it was stored; decoded here for the listing's fields only.
        return parse_json(payload_unverified(envelope_bytes, what="stored envelope"), what="stored statement")
    except (DocumentError, MalformedInputError, KeyError, TypeError) as e:
        raise RegistryError(f"a stored envelope cannot be decoded: {e}") from e


def text_preview(text: str | None) -> str | None:
    """``text`` cut to ``TEXT_PREVIEW`` characters, an ellipsis last when it was cut."""
    if text is None or len(text) <= TEXT_PREVIEW:
        return text
    return text[: TEXT_PREVIEW - 1] + "\u2026"


def artifact_block(r: EntryRow, *, full_text: bool = False) -> dict[str, Any] | None:
    """An entry's ``artifact`` block (None for a record): its text whole, or a preview."""
    a = r.artifact
    if a is None:
        return None
    block: dict[str, Any] = {
        "digest": a.digest,
        "model": {"name": a.model_name, "weights_digest": a.model_weights_digest, "config_digest": a.model_config_digest},
        "profile": a.profile_name,
        "parent": a.parent,
        "chain_key": a.chain_key,
        "positions": [a.position_start, a.position_end],
        "tokens": a.position_end - a.position_start,
        "text_digest": a.source_text_digest,
    }
    if full_text:
        block["text"] = a.source_text
    else:
        block["text_preview"] = text_preview(a.source_text)
    return block


def entry_meta(r: EntryRow, subjects: list[dict[str, str]]) -> dict[str, Any]:
    """An entry's metadata document (``schemas`` wire model ``EntryMeta``) with its ``subjects``."""
    return {
        "log_index": r.log_index,
        "digest": r.digest,
        "leaf_hash": r.leaf_hash.hex(),
        "payload_type": r.payload_type,
        "predicate_type": r.predicate_type,
        "kind": r.kind,
        "publisher": r.publisher,
        "keyids": list(r.keyids),
        "integrated_at": r.integrated_at,
        "size": r.size,
        "subjects": subjects,
        "envelope_url": f"/v1/entries/{r.digest}/envelope",
        "artifact": artifact_block(r),
    }


def artifact_summary(r: EntryRow, *, full_text: bool = False) -> dict[str, Any]:
    """One artifact of a listing: its block with the entry that logged it."""
    block = artifact_block(r, full_text=full_text) or {}
    return {
        **block,
        "log_index": r.log_index,
        "entry_digest": r.digest,
        "publisher": r.publisher,
        "keyids": list(r.keyids),
        "integrated_at": r.integrated_at,
    }


def page_of(items: list[dict[str, Any]], listing: Listing[EntryRow]) -> Page:
    """A page of documents, with the cursor after its last entry when more follow."""
    return Page(items, encode_cursor(listing.rows[-1].log_index) if listing.more else None)
