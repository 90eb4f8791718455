"""Red-team findings at the HTTP edge of a live ``kvgraft serve``, one regression test per bug.

- ``/static`` answered 500 for a name the OS cannot look up: a NUL byte, a name past NAME_MAX, a
  path through a file (``/static/app.js/x``). Each is now a 404.
- The admin routes parsed a stranger's JSON body before checking the admin secret, and parsed it
  with no depth bound: 100 000 ``[`` were a 500 (RecursionError) without any secret. The secret is
  now checked by a guard first, and the body is depth-checked (``too-deep``) before parsing.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from tests.registry.conftest import Server, running_server
from tests.reliability.servers import admin_secret, raw_request


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with running_server(tmp_path_factory.mktemp("redteam-http") / "data") as server:
        yield server


def _clean(server: Server, body: bytes) -> None:
    text = body.decode("utf-8", "replace")
    assert "Traceback" not in text and str(server.data) not in text and "site-packages" not in text


@pytest.mark.parametrize("path", ["/static/%00", "/static/app.js%00", "/static/" + "x" * 300, "/static/app.js/x"])
def test_static_names_the_os_cannot_look_up_are_404_not_500(live: Server, path: str) -> None:
    r = raw_request(live, "GET", path)
    assert r.status == 404, r.body[:300]
    _clean(live, r.body)
    assert "Traceback" not in live.log()


@pytest.mark.parametrize("path", ["/v1/admin/tokens", "/v1/admin/keys"])
def test_admin_body_is_not_parsed_before_the_secret_is_checked(live: Server, path: str) -> None:
    r = raw_request(live, "POST", path, body=b"[" * 100_000, headers={"Content-Type": "application/json"})
    assert r.status == 401, r.body[:300]
    assert r.headers["content-type"].startswith("application/problem+json")
    assert json.loads(r.body)["type"].endswith("/admin-unauthenticated")
    _clean(live, r.body)


@pytest.mark.parametrize("path", ["/v1/admin/tokens", "/v1/admin/keys"])
@pytest.mark.parametrize("body", [b"[" * 100_000, b'{"a":' * 10_000])
def test_admin_body_nesting_past_max_json_depth_is_a_400_too_deep_problem(live: Server, path: str, body: bytes) -> None:
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {admin_secret(live.data)}"}
    r = raw_request(live, "POST", path, body=body, headers=headers)
    assert r.status == 400, r.body[:300]
    assert json.loads(r.body)["type"].endswith("/too-deep")
    _clean(live, r.body)
    assert "RecursionError" not in live.log()


@pytest.mark.parametrize("body", [b"x", b"\xff", b"[]", b"", b" " * 10])
def test_admin_body_that_is_not_a_json_object_is_a_400_problem(live: Server, body: bytes) -> None:
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {admin_secret(live.data)}"}
    r = raw_request(live, "POST", "/v1/admin/tokens", body=body, headers=headers)
    assert r.status == 400, r.body[:300]
    assert r.headers["content-type"].startswith("application/problem+json")


def test_admin_body_over_one_mib_is_a_413_problem(live: Server) -> None:
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {admin_secret(live.data)}"}
    r = raw_request(live, "POST", "/v1/admin/tokens", body=b" " * (2 << 20), headers=headers)
    assert r.status == 413
    assert r.headers["content-type"].startswith("application/problem+json")
