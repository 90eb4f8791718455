"""The Jinja2 environment of the provenance browser: autoescaped templates and display filters."""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path
from typing import Any

from jinja2 import Environment, FileSystemLoader, StrictUndefined

TEMPLATES_DIR = Path(__file__).resolve().parents[1] / "templates"
STATIC_DIR = Path(__file__).resolve().parents[1] / "static"


def short_digest(value: str | None, keep: int = 12) -> str:
    """``sha256:0123456789ab…`` : enough to tell digests apart on a page; the full one is in a title."""
    if not value:
        return ""
    algo, sep, hex_part = value.partition(":")
    if not sep:
        return value[:keep] + ("\u2026" if len(value) > keep else "")
    return f"{algo}:{hex_part[:keep]}\u2026" if len(hex_part) > keep else value


def number(value: int | float | None) -> str:
    """An integer with thousands separators (``12,345``)."""
    if value is None:
        return ""
    return f"{value:,}"


def figure(value: float | None, digits: int = 6) -> str:
    """A measured float, short but never rounded to a misleading 0 (``0``, ``3.2e-07``, ``0.0123``)."""
    if value is None:
        return ""
    if value == 0:
        return "0"
    if not math.isfinite(value):
        return str(value)
    return f"{value:.{digits}g}"


def percent(value: float | None) -> str:
    """A fraction as a percentage with one decimal (``97.5%``)."""
    if value is None:
        return ""
    return f"{100 * value:.1f}%"


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
    )
    env.filters.update(short=short_digest, number=number, figure=figure, percent=percent, pretty_json=pretty_json)
    return env


def render_page(template: str, **context: Any) -> str:
    """Render ``template`` with ``context``; every value is escaped unless it is ``Markup``."""
    return environment().get_template(template).render(**context)
