"""Security headers on every response the registry sends: API, UI, static files and errors alike.

They are set in a ``before_send`` hook rather than a route middleware because Litestar runs
``before_send`` for every message the app sends, including its own 404/405 answers for paths
that match no route; a middleware would only wrap matched routes.
"""

from __future__ import annotations

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
