"""Access against a real server: tokens scoped to keys, revocation at once, per-token rate
limits, no secret in any log line, and the security headers on every response."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import httpx
import pytest

from kvgraft.registry._internal.http.security import SECURITY_HEADERS
from kvgraft.schemas import sha256_bytes
from tests.registry.conftest import Key, Server, artifact, registry_cli, running_server
from tests.reliability.conftest import Figures
from tests.reliability.servers import admin_secret, make_token

#: Slow enough that the burst is spent long before one request is refilled, even on a busy machine.
RATE, BURST = 0.2, 5


class Seen:
    """Every response the tests got, for the header check, and every secret they handled."""

    def __init__(self) -> None:
        self.responses: list[httpx.Response] = []
        self.secrets: dict[str, str] = {}

    def keep(self, r: httpx.Response) -> httpx.Response:
        self.responses.append(r)
        return r


@pytest.fixture(scope="module")
def seen() -> Seen:
    return Seen()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, seen: Seen) -> Iterator[Server]:
    data = tmp_path_factory.mktemp("access") / "data"
    # debug: the most the server ever logs, so the secret scan below sees every line it can write.
    with running_server(data, "--log-level", "debug", "--rate-limit", str(RATE), "--rate-burst", str(BURST)) as s:
        seen.secrets["admin secret"] = admin_secret(data)
        seen.secrets["registry private key"] = _pem_body((data / "registry-key.pem").read_text())
        yield s


def _pem_body(pem: str) -> str:
    # The base64 of the key, without the BEGIN/END lines: a private key in any form.
    return "".join(line for line in pem.splitlines() if not line.startswith("-----"))[:40]


def _put(server: Server, token: str, data: bytes) -> httpx.Response:
    return httpx.put(f"{server.url}/v1/blobs/{sha256_bytes(data)}", content=data, headers={"Authorization": f"Bearer {token}"}, timeout=30)


def _post(server: Server, token: str, envelope: bytes) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/entries", content=envelope, headers={"Authorization": f"Bearer {token}"}, timeout=30)


def test_tokens_are_scoped_to_their_keys(server: Server, rkeys: dict[str, Key], seen: Seen, figures: Figures) -> None:
    alice, bob, eve = rkeys["alice"], rkeys["bob"], rkeys["eve"]
    a_token, _ = make_token(server, "alice", alice)
    b_token, _ = make_token(server, "bob", bob)
    seen.secrets |= {"alice's token": a_token, "bob's token": b_token, "alice's private key": _pem_body(alice.path.read_text())}
    art = artifact("scoped")
    assert seen.keep(_put(server, a_token, art.tensors)).status_code == 201

    r = seen.keep(_post(server, a_token, bob.sign(art.statement)))
    assert r.status_code == 403 and r.json()["type"].endswith("/key-not-bound")
    assert "publisher 'bob'" in r.json()["detail"] and "not bound to that key" in r.json()["detail"]
    r = seen.keep(_post(server, a_token, eve.sign(art.statement)))
    assert r.status_code == 403 and "not registered with this registry" in r.json()["detail"]
    r = seen.keep(_post(server, b_token, alice.sign(art.statement)))
    assert r.status_code == 403 and "publisher 'alice'" in r.json()["detail"]
    r = seen.keep(_post(server, a_token, alice.sign(art.statement)))
    assert r.status_code == 201 and r.json()["entry"]["publisher"] == "alice"
    figures.add("access", scoped_tokens_refused=3, scoped_tokens_accepted=1)


def test_revocation_applies_to_the_very_next_request(server: Server, rkeys: dict[str, Key], seen: Seen, figures: Figures) -> None:
    token, token_id = make_token(server, "alice", rkeys["alice"])
    seen.secrets["revoked token"] = token
    assert seen.keep(_put(server, token, b"before revocation")).status_code == 201
    r = registry_cli("--json", "token", "revoke", "--data", server.data, token_id)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["via"] == "server"
    refused = seen.keep(_put(server, token, b"after revocation"))
    assert refused.status_code == 403 and refused.json()["type"].endswith("/token-revoked")
    assert token_id in refused.json()["detail"]
    assert seen.keep(_post(server, token, rkeys["alice"].sign(artifact("late").statement))).status_code == 403
    figures.add("access", revoked_refused_on_next_request=True)


def test_rate_limit_per_token(server: Server, rkeys: dict[str, Key], seen: Seen, figures: Figures) -> None:
    token, token_id = make_token(server, "alice", rkeys["alice"])
    other, _ = make_token(server, "alice", rkeys["alice"])
    seen.secrets |= {"rate-limited token": token, "other token": other}
    blob = b"rate limited"
    codes = [seen.keep(_put(server, token, blob)).status_code for _ in range(BURST)]
    assert codes == [201] + [200] * (BURST - 1)
    r = seen.keep(_put(server, token, blob))
    assert r.status_code == 429, r.text
    assert r.headers["content-type"].startswith("application/problem+json")
    problem = r.json()
    assert problem["type"].endswith("/rate-limited") and token_id in problem["detail"] and "Retry-After" in problem["hint"]
    retry_after = int(r.headers["retry-after"])
    assert retry_after == problem["retry_after"] >= 1
    # Another token of the same publisher has its own bucket.
    assert seen.keep(_put(server, other, blob)).status_code == 200
    time.sleep(retry_after)
    assert seen.keep(_put(server, token, blob)).status_code == 200
    figures.add("access", rate_limit=f"{RATE}/s burst {BURST}", rate_limited_status=429, retry_after_s=retry_after)


def test_security_headers_on_every_response(server: Server, seen: Seen, figures: Figures) -> None:
    url = server.url
    blob = b"headers"
    sample = [
        httpx.get(url + "/v1/log/checkpoint"), httpx.get(url + "/v1/log/key"), httpx.get(url + "/v1/entries"),
        httpx.get(url + "/schema/openapi.json"), httpx.get(url + "/no/such/route"), httpx.delete(url + "/v1/entries"),
        httpx.get(url + "/v1/blobs/sha256:..%2f"), httpx.head(url + f"/v1/blobs/{sha256_bytes(blob)}"),
        httpx.put(url + f"/v1/blobs/{sha256_bytes(blob)}", content=blob), httpx.get(url + "/v1/entries/99999"),
        httpx.get(url + "/v1/log/proof/inclusion", params={"index": "x"}), httpx.post(url + "/v1/admin/tokens", json={}),
    ]
    for r in sample:
        seen.keep(r)
    statuses = sorted({r.status_code for r in seen.responses})
    missing = [
        (r.request.method, str(r.request.url), r.status_code, name)
        for r in seen.responses for name, value in SECURITY_HEADERS.items() if r.headers.get(name) != value
    ]
    assert missing == []
    # The sample covers successes and every error family the tests met (auth, scope, limits, routes).
    assert {200, 201, 401, 403, 404, 405, 429} <= set(statuses), statuses
    figures.add("access", security_headers_checked_responses=len(seen.responses), security_headers_statuses=statuses)


def test_no_secret_in_any_log_line(server: Server, seen: Seen, figures: Figures) -> None:
    # A wrong token is a secret too (a typo of a real one); send one, then read the log.
    wrong = "kvgr_" + "S3cretTypo" * 4
    seen.keep(httpx.put(f"{server.url}/v1/blobs/{sha256_bytes(b'x')}", content=b"x", headers={"Authorization": f"Bearer {wrong}"}))
    seen.secrets["a wrong token"] = wrong
    log = server.log()
    assert "POST /v1/entries" in log and "PUT /v1/blobs/" in log, "the server log does not show the requests: nothing was scanned"
    leaked = [name for name, secret in seen.secrets.items() if secret and secret in log]
    assert leaked == [], f"secrets in the server log: {leaked}"
    assert len(seen.secrets) >= 8
    figures.add("access", log_lines_scanned=len(log.splitlines()), secrets_checked=len(seen.secrets), secrets_in_log=len(leaked))
