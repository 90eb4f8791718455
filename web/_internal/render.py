"""The Jinja2 environment of the provenance browser: autoescaped templates and display filters."""

from __future__ import annotations

import functools
import json
import math
import re
import unicodedata
from pathlib import Path
from typing import Any

from jinja2 import Environment, FileSystemLoader, StrictUndefined
from markupsafe import Markup

TEMPLATES_DIR = Path(__file__).resolve().parents[1] / "templates"
STATIC_DIR = Path(__file__).resolve().parents[1] / "static"


#: Unicode categories that draw nothing or reorder what follows: controls (Cc), format characters
#: (Cf: bidi embeddings, overrides and isolates U+202A-202E, U+2066-2069, marks U+200E/F, zero-width
#: U+200B-200D, U+FEFF, soft hyphen, tags), line/paragraph separators (Zl, Zp) and lone surrogates
#: (Cs, which cannot even be encoded as UTF-8).
_INVISIBLE_CATEGORIES = frozenset({"Cc", "Cf", "Zl", "Zp", "Cs"})
#: Kept as they are: text layout that shows itself (source texts, JSON, notes and commands are multi-line).
_LAYOUT = frozenset("\n\t")
_NAMED_ESCAPES = {"\r": "\\r"}


@functools.cache
def invisible_pattern() -> re.Pattern[str]:
    """A regex matching one character of ``_INVISIBLE_CATEGORIES`` (newline and tab excepted).

    Built once from this Python's Unicode database, so new format characters are covered when
    Python updates it.
    """
    ranges: list[tuple[int, int]] = []
    for cp in range(0x110000):
        ch = chr(cp)
        if ch in _LAYOUT or unicodedata.category(ch) not in _INVISIBLE_CATEGORIES:
            continue
        if ranges and ranges[-1][1] == cp - 1:
            ranges[-1] = (ranges[-1][0], cp)
        else:
            ranges.append((cp, cp))
    body = "".join(f"\\U{a:08x}" if a == b else f"\\U{a:08x}-\\U{b:08x}" for a, b in ranges)
    return re.compile(f"[{body}]")


def escape_char(ch: str) -> str:
    """``ch`` as a visible escape: ``\\r``, ``\\x1b``, ``\\u202e``, ``\\U000e0041`` (Python's notation)."""
    named = _NAMED_ESCAPES.get(ch)
    if named is not None:
        return named
    cp = ord(ch)
    if cp < 0x100:
        return f"\\x{cp:02x}"
    return f"\\u{cp:04x}" if cp < 0x10000 else f"\\U{cp:08x}"


def visible(value: Any) -> Any:
    """Text with every control, bidi, zero-width or other invisible character shown as its escape.

    The one filter for stranger-controlled text: the environment applies it to every ``{{ }}``
    output (its ``finalize``), so no template can forget it. ``Markup`` stays ``Markup`` (the
    escapes are plain ASCII, safe in text and attributes); other values are turned into text
    first, as Jinja would. Newlines and tabs are kept.
    """
    if isinstance(value, Markup):
        return Markup(invisible_pattern().sub(lambda m: escape_char(m.group()), str(value)))
    if value is None or isinstance(value, bool | int | float):
        return value
    text = value if isinstance(value, str) else str(value)
    return invisible_pattern().sub(lambda m: escape_char(m.group()), text)


def _as_float(value: Any) -> float | None:
    # None where the value is not a number a float can hold (an int beyond 1.8e308, a string).
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        return float(value)
    except OverflowError:
        return None


def _big_int(value: int, digits: int) -> str:
    # Scientific notation by the decimal digits themselves: exact for any int a float cannot hold.
    text = str(abs(value))
    mantissa = text[0] + ("." + text[1:digits].rstrip("0") if text[1:digits].rstrip("0") else "")
    return f"{'-' if value < 0 else ''}{mantissa}e+{len(text) - 1}"


def short_digest(value: str | None, keep: int = 12) -> str:
    """``sha256:0123456789ab…`` : enough to tell digests apart on a page; the full one is in a title."""
    if not value:
        return ""
    algo, sep, hex_part = value.partition(":")
    if not sep:
        return value[:keep] + ("\u2026" if len(value) > keep else "")
    return f"{algo}:{hex_part[:keep]}\u2026" if len(hex_part) > keep else value


def number(value: Any) -> str:
    """An integer with thousands separators (``12,345``); never fails (other values as text).

    Ints of more than 30 digits are written in scientific notation (``2.13598e+308``): a signed
    record may hold any integer, and a page must not fill with its digits.
    """
    if value is None:
        return ""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**30:
        return _big_int(value, 6)
    if isinstance(value, bool) or not isinstance(value, int | float):
        return str(value)
    return f"{value:,}"


def figure(value: Any, digits: int = 6) -> str:
    """A measured float, short but never rounded to a misleading 0 (``0``, ``3.2e-07``, ``0.0123``).

    Total: an int too large for a float is shown by its digits, a non-number as text.
    """
    if value is None:
        return ""
    as_float = _as_float(value)
    if as_float is None:
        if isinstance(value, int) and not isinstance(value, bool):
            return _big_int(value, digits)
        return str(value)
    if as_float == 0:
        return "0"
    if not math.isfinite(as_float):
        return str(as_float)
    return f"{as_float:.{digits}g}"


def percent(value: Any) -> str:
    """A fraction as a percentage with one decimal (``97.5%``); never fails."""
    if value is None:
        return ""
    as_float = _as_float(value)
    if as_float is None or not math.isfinite(100 * as_float):
        return figure(value * 100 if isinstance(value, int) and not isinstance(value, bool) else value) + "%"
    return f"{100 * as_float:.1f}%"


def pretty_json(value: Any) -> str:
    """Indented JSON for display (escaped by the template like any other text)."""
    return json.dumps(value, indent=2, ensure_ascii=False, sort_keys=False)


@functools.cache
def environment() -> Environment:
    """The shared environment: autoescape on for every template, undefined names are errors."""
    env = Environment(
        loader=FileSystemLoader(TEMPLATES_DIR),
        # Every template is HTML; escaping is never left to a file-name guess.
        autoescape=True,
        undefined=StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        # Templates ship with the package and never change under a running server: no stat per render.
        auto_reload=False,
        # Every {{ }} output shows invisible characters escaped, whatever the template says.
        finalize=visible,
    )
    env.filters.update(
        short=short_digest, number=number, figure=figure, percent=percent, pretty_json=pretty_json, visible=visible
    )
    return env


def render_page(template: str, **context: Any) -> str:
    """Render ``template`` with ``context``; every value is escaped unless it is ``Markup``."""
    return environment().get_template(template).render(**context)
