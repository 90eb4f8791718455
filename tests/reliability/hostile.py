"""Hypothesis strategies for hostile inputs: JSON mutations, raw byte damage, absurd numbers.

Shared by the in-process parser properties and the HTTP properties against a real server.
"""

from __future__ import annotations

import copy
import json
from typing import Any

from hypothesis import strategies as st

#: Values a stranger may put where a field is expected: wrong types, huge and negative
#: integers, deep nesting, long strings, control characters, lone surrogates escaped.
_LEAF = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, -1, 2**63, 2**64, -(2**63) - 1, 10**400]),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=40),
    st.sampled_from(["", "..", "../../etc/passwd", "sha256:" + "0" * 64, "sha256:" + "G" * 64, "\u0000", "A" * 5000]),
)
JSON_VALUES = st.recursive(
    _LEAF,
    lambda children: st.one_of(st.lists(children, max_size=4), st.dictionaries(st.text(max_size=8), children, max_size=4)),
    max_leaves=12,
)


def _paths(doc: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out += _paths(v, (*prefix, i))
    return out


def _set(doc: Any, path: tuple[Any, ...], value: Any) -> Any:
    if not path:
        return value
    parent = doc
    for p in path[:-1]:
        parent = parent[p]
    parent[path[-1]] = value
    return doc


def _delete(doc: Any, path: tuple[Any, ...]) -> Any:
    if not path:
        return {}
    parent = doc
    for p in path[:-1]:
        parent = parent[p]
    del parent[path[-1]]
    return doc


@st.composite
def mutated_json(draw: st.DrawFn, original: Any) -> bytes:
    """``original`` serialised as JSON text after one hostile change."""
    doc = copy.deepcopy(original)
    paths = _paths(doc)
    path = draw(st.sampled_from(paths))
    op = draw(st.sampled_from(["replace", "delete", "add", "duplicate", "nest", "huge-int", "bytes", "truncate"]))
    if op == "replace":
        doc = _set(doc, path, draw(JSON_VALUES))
    elif op == "delete" and path:
        doc = _delete(doc, path)
    elif op == "add":
        target = doc
        for p in path:
            target = target[p]
        if isinstance(target, dict):
            target[draw(st.text(max_size=12))] = draw(JSON_VALUES)
        elif isinstance(target, list):
            target.append(draw(JSON_VALUES))
    elif op == "nest":
        depth = draw(st.sampled_from([10, 65, 100, 1000, 100_000]))
        return _replace_text(doc, path, "[" * depth + "]" * depth)
    elif op == "huge-int":
        return _replace_text(doc, path, "9" * draw(st.sampled_from([20, 400, 4301, 50_000])))
    text = json.dumps(doc).encode("utf-8")
    if op == "duplicate" and isinstance(original, dict) and original:
        key = draw(st.sampled_from(sorted(original)))
        # A second member with the same name, as a JSON parser that keeps the last would read it.
        return text[:1] + json.dumps(key).encode() + b":" + json.dumps(draw(JSON_VALUES)).encode() + b"," + text[1:]
    if op == "bytes" and text:
        i = draw(st.integers(min_value=0, max_value=len(text) - 1))
        return text[:i] + bytes([draw(st.integers(0, 255))]) + text[i + 1 :]
    if op == "truncate" and text:
        return text[: draw(st.integers(min_value=0, max_value=len(text) - 1))]
    return text


def _replace_text(doc: Any, path: tuple[Any, ...], raw: str) -> bytes:
    marker = "\u2603REPLACE\u2603"
    doc = _set(doc, path, marker)
    return json.dumps(doc).replace(json.dumps(marker), raw).encode("utf-8")


def flip_byte(data: bytes, index: int, xor: int = 0x01) -> bytes:
    """``data`` with byte ``index`` xor-ed with ``xor``."""
    return data[:index] + bytes([data[index] ^ xor]) + data[index + 1 :]


def _b64_paths(doc: Any) -> list[tuple[Any, ...]]:
    import base64
    import binascii

    out = []
    for path in _paths(doc):
        value = doc
        for p in path:
            value = value[p]
        if isinstance(value, str) and len(value) >= 16:
            try:
                base64.b64decode(value, validate=True)
            except (binascii.Error, ValueError):
                continue
            out.append(path)
    return out


@st.composite
def mutated_b64_field(draw: st.DrawFn, original: Any) -> bytes:
    """``original`` as JSON with one base64 field's *decoded* bytes damaged (flip, cut, insert),
    re-encoded: reaches the parsers behind the base64 (certificates, signatures, log bodies)."""
    import base64

    doc = copy.deepcopy(original)
    paths = _b64_paths(doc)
    if not paths:
        return json.dumps(doc).encode()
    path = draw(st.sampled_from(paths))
    value = doc
    for p in path:
        value = value[p]
    raw = base64.b64decode(value)
    i = draw(st.integers(min_value=0, max_value=max(0, len(raw) - 1)))
    how = draw(st.sampled_from(["flip", "cut", "insert", "set"]))
    if how == "flip" and raw:
        raw = flip_byte(raw, i, draw(st.integers(1, 255)))
    elif how == "cut":
        raw = raw[:i] + raw[i + draw(st.integers(1, 16)) :]
    elif how == "insert":
        raw = raw[:i] + draw(st.binary(min_size=1, max_size=8)) + raw[i:]
    elif raw:
        raw = raw[:i] + bytes([draw(st.sampled_from([0x00, 0x01, 0x02, 0x05, 0x30, 0x7F, 0x80, 0xFF]))]) + raw[i + 1 :]
    return json.dumps(_set(doc, path, base64.b64encode(raw).decode())).encode()
