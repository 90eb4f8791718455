"""Search over artifacts' source text: an inverted index of words, bounded per query.

The index is the ``search_terms`` table, one row per (word, entry): filled when an artifact
is published and, for entries logged before the table existed, by database migration 2. A
query is split into words the same way, and matches the entries that hold every one of
them: one lookup in the index for the whole query, whatever its number of words, so a
search costs the same under the database lock however it is worded.

Words are maximal runs of Unicode letters, digits and ``_`` after NFKC normalisation and
case folding: ``"Janet's ducks,"`` indexes ``janet``, ``s`` and ``ducks``. A query longer than
``RegistrySettings.max_query_length`` characters, or naming more than ``max_search_terms``
distinct words, is refused (400) before it reaches the database.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from .errors import QueryTooLargeError
from .storage.ddl import Migration, register

if TYPE_CHECKING:
    from .storage.db import Connection

_WORD = re.compile(r"\w+")

#: The table and its index; created by migration 2, registered below (ddl.py).
SEARCH_TABLE_DDL = (
    "CREATE TABLE search_terms (term VARCHAR NOT NULL, log_index BIGINT NOT NULL)",
    "CREATE INDEX search_terms_term ON search_terms (term)",
)


def terms_of(text: str | None) -> list[str]:
    """The distinct index words of ``text``, in first-occurrence order (empty for None)."""
    if not text:
        return []
    return list(dict.fromkeys(_WORD.findall(unicodedata.normalize("NFKC", text).casefold())))


def index_texts(conn: Connection, texts: Iterable[tuple[int, str | None]]) -> None:
    """Add the words of each (log index, text) to the index (inside the caller's transaction)."""
    terms: list[str] = []
    indices: list[int] = []
    for log_index, text in texts:
        words = terms_of(text)
        terms += words
        indices += [log_index] * len(words)
    if terms:
        # One statement for every word of every text: executemany would cost one round trip per word.
        conn.execute("INSERT INTO search_terms SELECT unnest(?::VARCHAR[]), unnest(?::BIGINT[])", [terms, indices])


def backfill(conn: Connection) -> None:
    """Index every stored artifact's source text (migration 2, for entries logged before the index)."""
    rows = conn.execute(
        "SELECT log_index, source_text FROM entries WHERE source_text IS NOT NULL ORDER BY log_index"
    ).fetchall()
    index_texts(conn, ((int(log_index), str(text)) for log_index, text in rows))


# Search by an index of words, not one substring scan of every text per query word.
MIGRATION = register(
    Migration(2, "search index of artifacts' source text words", SEARCH_TABLE_DDL, backfill=backfill, owner=__name__)
)


def query_terms(q: str | None, *, max_terms: int, max_length: int) -> list[str] | None:
    """The words a search ``q`` must match; None when ``q`` asks for no search (absent or blank).

    Raises ``QueryTooLargeError`` when ``q`` is longer than ``max_length`` characters or names
    more than ``max_terms`` distinct words. A query of only punctuation returns ``[]``, which
    matches nothing.
    """
    if q is None or not q.strip():
        return None
    if len(q) > max_length:
        raise QueryTooLargeError(
            f"the search query is {len(q)} characters long; this registry searches at most {max_length}",
            hint=f"search for a few words of the source text (at most {max_terms} words, {max_length} characters)",
            extra={"limit": max_length},
        )
    terms = terms_of(q)
    if len(terms) > max_terms:
        raise QueryTooLargeError(
            f"the search query names {len(terms)} distinct words; this registry searches for at most {max_terms}",
            hint=f"search for the {max_terms} most telling words of the source text",
            extra={"limit": max_terms},
        )
    return terms


def search_condition(
    q: str | None, *, max_terms: int, max_length: int, column: str = "log_index"
) -> tuple[str, list[Any]] | None:
    """A SQL condition on ``column`` (an entry's log index) keeping the entries whose text holds
    every word of ``q``, with its parameters; None when ``q`` asks for no search.

    The API (``GET /v1/artifacts?q=``) and the browser (``/artifacts?q=``) both filter with this,
    through ``queries.ArtifactFilter``.
    """
    terms = query_terms(q, max_terms=max_terms, max_length=max_length)
    if terms is None:
        return None
    if not terms:
        return "FALSE", []
    placeholders = ", ".join("?" for _ in terms)
    # One pass over the index rows of the query's words; an entry matches when it holds all.
    return (
        f"{column} IN (SELECT log_index FROM search_terms WHERE term IN ({placeholders}) "
        f"GROUP BY log_index HAVING count(DISTINCT term) = {len(terms)})",
        list(terms),
    )
