"""RFC 8785 (JCS) canonical JSON, and strict JSON parsing.

Signed payloads are the canonical bytes of a statement. Verifiers check signatures over the
bytes as received and never re-serialize; producers serialize exactly once, here.
"""

from __future__ import annotations

import json
import re
from typing import Any

import rfc8785
from pydantic import BaseModel

from .errors import CanonicalizationError, DocumentError

#: Nesting deeper than this is refused before parsing: no honest document needs it, and
#: Python's recursive decoder would otherwise fail with a RecursionError.
MAX_DEPTH = 64


#: RFC 8785 writes an integer as its decimal digits only within I-JSON's exact range.
_SAFE_INTEGER = 2**53 - 1


def canonical_json(value: Any) -> bytes:
    """Serialize a JSON value (dicts, lists, str, int, float, bool, None) per RFC 8785."""
    if type(value) is list and all(type(x) is int and -_SAFE_INTEGER <= x <= _SAFE_INTEGER for x in value):
        # A list of integers (a chain's token ids, hashed on every load): its canonical form is
        # the digits joined by commas, written here without the general serializer's per-value
        # work (4,096 ids: 0.9 ms against 2.6 ms). Equal to rfc8785.dumps, tested.
        return ("[" + ",".join(map(str, value)) + "]").encode("ascii")
    try:
        return rfc8785.dumps(value)
    except rfc8785.CanonicalizationError as e:
        raise CanonicalizationError(f"cannot write canonical JSON: {e}") from e
    except TypeError as e:
        raise CanonicalizationError(f"cannot write canonical JSON: {e}") from e


def canonical_model(model: BaseModel) -> bytes:
    """Serialize a model per RFC 8785, using its JSON field names (aliases)."""
    return canonical_json(model.model_dump(mode="json", by_alias=True))


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    for key, value in pairs:
        if key in seen:
            raise DocumentError(f"duplicate key {key!r} in JSON object")
        seen[key] = value
    return seen


def _reject_constant(name: str) -> Any:
    raise DocumentError(f"{name} is not valid JSON")


#: The characters that can change ``_depth_ok``'s state.
_DEPTH_SPECIAL = re.compile(r'["\\\[\]{}]')


def _depth_ok(text: str) -> bool:
    """Whether no array or object in ``text`` nests deeper than ``MAX_DEPTH``, brackets inside
    strings not counted. Visits only quotes, backslashes and brackets (a statement of 4,096
    token ids is mostly digits); the character after a backslash inside a string is skipped,
    whatever it is."""
    depth = 0
    in_string = False
    skip = -1
    for m in _DEPTH_SPECIAL.finditer(text):
        i = m.start()
        if i == skip:
            continue
        ch = text[i]
        if in_string:
            if ch == "\\":
                skip = i + 1
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            if depth > MAX_DEPTH:
                return False
        elif ch in "]}":
            depth -= 1
    return True


def parse_json(data: bytes | str, *, what: str = "document") -> Any:
    """Parse JSON strictly: UTF-8 only, no duplicate keys, no NaN/Infinity, bounded depth.

    Raises ``DocumentError`` naming ``what`` and the fault.
    """
    try:
        text = data.decode("utf-8") if isinstance(data, bytes) else data
    except UnicodeDecodeError as e:
        raise DocumentError(f"{what} is not UTF-8 text: {e.reason} at byte {e.start}") from e
    if not _depth_ok(text):
        raise DocumentError(f"{what} nests deeper than {MAX_DEPTH} levels")
    try:
        return json.loads(
            text, object_pairs_hook=_no_duplicate_keys, parse_constant=_reject_constant
        )
    except json.JSONDecodeError as e:
        raise DocumentError(f"{what} is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from e
    except DocumentError as e:
        raise DocumentError(f"{what}: {e}") from e
    except ValueError as e:
        # json.loads refuses integers longer than sys.get_int_max_str_digits() with a plain
        # ValueError; that is malformed input, not a crash.
        raise DocumentError(f"{what} holds a number too long to read ({e})") from e
