"""HTTP conditional and range requests (RFC 9110 sections 13 and 14), for immutable blobs.

Blobs never change, so the entity tag is the digest itself and is always strong.
"""

from __future__ import annotations

import re

from .errors import RangeNotSatisfiableError

#: More ranges than this in one request are ignored (the whole blob is served): RFC 9110
#: section 14.2 lets a server ignore a Range that asks for many small or overlapping pieces.
MAX_RANGES = 16

_SPEC = re.compile(r"(\d{1,19})?-(\d{1,19})?", re.ASCII)


def parse_range(header: str | None, size: int) -> list[tuple[int, int]] | None:
    """The byte ranges a ``Range`` header asks of a ``size``-byte blob, as inclusive pairs.

    Returns None when the whole blob should be served instead: no header, another unit, a
    syntax error (RFC 9110 section 14.2: ignore it), or more than ``MAX_RANGES`` ranges. Raises
    ``RangeNotSatisfiableError`` when the header is valid but no range overlaps the blob.
    Unsatisfiable ranges among satisfiable ones are dropped; the rest are clipped to the blob.
    """
    if header is None:
        return None
    unit, sep, specs = header.partition("=")
    if not sep or unit.strip().lower() != "bytes":
        return None
    parts = [p.strip() for p in specs.split(",")]
    if not parts or len(parts) > MAX_RANGES:
        return None
    wanted: list[tuple[int | None, int | None]] = []
    for part in parts:
        m = _SPEC.fullmatch(part)
        if m is None or (m.group(1) is None and m.group(2) is None):
            return None
        first = int(m.group(1)) if m.group(1) is not None else None
        last = int(m.group(2)) if m.group(2) is not None else None
        if first is not None and last is not None and last < first:
            return None
        wanted.append((first, last))
    ranges: list[tuple[int, int]] = []
    for first, last in wanted:
        if first is None:
            # A suffix: the last `last` bytes (the syntax check above ensured it is there).
            suffix = last or 0
            if suffix == 0 or size == 0:
                continue
            ranges.append((max(0, size - suffix), size - 1))
        elif first < size:
            ranges.append((first, size - 1 if last is None else min(last, size - 1)))
    if not ranges:
        raise RangeNotSatisfiableError(f"no range of {header!r} overlaps the blob's {size} bytes", size=size)
    return ranges


def _tags(header: str) -> list[str]:
    # Entity tags are quoted strings that may contain commas only in theory; split on commas
    # outside quotes to be safe.
    tags: list[str] = []
    current: list[str] = []
    quoted = False
    for ch in header:
        if ch == '"':
            quoted = not quoted
        if ch == "," and not quoted:
            tags.append("".join(current).strip())
            current = []
        else:
            current.append(ch)
    tags.append("".join(current).strip())
    return [t for t in tags if t]


def none_match(header: str | None, etag: str) -> bool:
    """Whether ``If-None-Match`` matches ``etag`` (weak comparison, RFC 9110 section 13.1.2)."""
    if header is None:
        return False
    tags = _tags(header)
    if "*" in tags:
        return True
    return any(t.removeprefix("W/") == etag for t in tags)


def if_range_allows(header: str | None, etag: str) -> bool:
    """Whether an ``If-Range`` precondition lets the Range apply (strong comparison; dates never)."""
    return header is None or header.strip() == etag
