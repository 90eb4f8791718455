"""Security headers on every response the registry sends: API, UI, static files and errors alike;
and the one rule that keeps the host's paths out of every answer (``scrub_paths``).

They are set in a ``before_send`` hook rather than a route middleware because Litestar runs
``before_send`` for every message the app sends, including its own 404/405 answers for paths
that match no route; a middleware would only wrap matched routes.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Final

from litestar.types import Message, Scope

#: The browser may load scripts, styles and images only from this origin (images also as
#: ``data:`` URIs); no inline script or style, no plugins, no ``<base>``, no framing, and forms
#: post only back here. The UI is built to work under exactly this policy.
CONTENT_SECURITY_POLICY: Final = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "object-src 'none'; base-uri 'none'; frame-ancestors 'none'; form-action 'self'"
)

#: Header name -> value, exactly as sent.
SECURITY_HEADERS: Final[dict[str, str]] = {
    "content-security-policy": CONTENT_SECURITY_POLICY,
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "x-frame-options": "DENY",
}

_ENCODED: Final = [(name.encode("latin-1"), value.encode("latin-1")) for name, value in SECURITY_HEADERS.items()]
_NAMES: Final = frozenset(name for name, _ in _ENCODED)


async def add_security_headers(message: Message, scope: Scope) -> None:
    """``before_send`` hook: put the security headers on each HTTP response start message.

    Any value a handler set for one of these headers is replaced, so no route can weaken them.
    """
    if message["type"] != "http.response.start":
        return
    kept = [(name, value) for name, value in message.get("headers", []) if bytes(name).lower() not in _NAMES]
    message["headers"] = [*kept, *_ENCODED]


#: An absolute filesystem path inside a message: '/' then at least one more '/'-separated name,
#: not part of a URL or a relative path (no word character, ':', '/', '.', '~' or '-' just before
#: it); a name runs to whitespace, a quote or the punctuation that ends a path in a sentence.
ABSOLUTE_PATH: Final = re.compile(r"(?<![\w:/.~-])/(?:[^\s/'\"`:),;<>]+/)+[^\s/'\"`:),;<>]*")


def scrub_paths(text: str, roots: Iterable[str] = (), *, server_side: bool) -> str:
    """``text`` as an HTTP answer (API problem or HTML page) may show it: each of ``roots`` (the data
    directory, as given and resolved, longest first) replaced by ``DATA`` always, and with
    ``server_side`` (a 5xx: a fault may name any file) every other absolute path by ``<path>``.

    The one rule, for the API (problems.py), the pages (ui.py) and the witness: no answer names a
    file on the registry's host; the server log has the full message. API paths in messages
    ("GET /v1/entries/x ...") are only ever in 4xx answers, which keep them.
    """
    for root in roots:
        text = text.replace(root, "DATA")
    return ABSOLUTE_PATH.sub("<path>", text) if server_side else text
