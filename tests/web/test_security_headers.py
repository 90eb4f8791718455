"""Every response of the registry app carries the security headers: API, errors, unknown paths."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvgraft.registry._internal.http.security import CONTENT_SECURITY_POLICY, SECURITY_HEADERS
from tests.registry.conftest import Harness, Key, harness
from tests.registry.conftest import keys as keys  # noqa: F401  (the session fixture, re-exported)


@pytest.fixture
def reg(tmp_path: Path, keys: dict[str, Key]) -> Iterator[Harness]:  # noqa: F811
    with harness(tmp_path / "data", keys) as h:
        yield h


def test_policy_forbids_inline_script_and_framing() -> None:
    directives = dict(d.strip().split(" ", 1) for d in CONTENT_SECURITY_POLICY.split(";"))
    assert directives["script-src"] == "'self'"
    assert directives["style-src"] == "'self'"
    assert directives["object-src"] == "'none'"
    assert directives["frame-ancestors"] == "'none'"
    assert "unsafe-inline" not in CONTENT_SECURITY_POLICY


@pytest.mark.parametrize(
    ("method", "path", "status"),
    [
        ("GET", "/v1/log/checkpoint", 200),
        ("GET", "/v1/log/key", 200),
        ("GET", "/v1/entries/99", 404),
        ("GET", "/v1/blobs/sha256:nothex", 400),
        ("POST", "/v1/entries", 401),
        ("GET", "/no/such/path", 404),
        ("DELETE", "/v1/log/checkpoint", 405),
        ("GET", "/schema/openapi.json", 200),
    ],
)
def test_every_response_carries_security_headers(reg: Harness, method: str, path: str, status: int) -> None:
    r = reg.client.request(method, path)
    assert r.status_code == status, r.text
    for name, value in SECURITY_HEADERS.items():
        assert r.headers.get(name) == value, f"{method} {path}: {name} is {r.headers.get(name)!r}"
        assert len(r.headers.get_list(name)) == 1, f"{method} {path}: {name} sent more than once"
