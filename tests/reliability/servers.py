"""Helpers for tests against a real ``kvgraft serve`` process: tokens, raw requests, stored state."""

from __future__ import annotations

import hashlib
import http.client
import json
from dataclasses import dataclass
from pathlib import Path

import httpx

from kvgraft.schemas import sha256_bytes
from tests.registry.conftest import Key, Server


def admin_secret(data: Path) -> str:
    """The running server's admin secret, from DATA/admin.json (the operator's way in)."""
    return str(json.loads((data / "admin.json").read_text())["secret"])


def make_token(server: Server, publisher: str, *keys: Key) -> tuple[str, str]:
    """A token for ``publisher`` bound to ``keys``, made through the running server's admin API: (token, id)."""
    r = httpx.post(
        server.url + "/v1/admin/tokens",
        json={"publisher": publisher, "public_keys_pem": [k.pem for k in keys]},
        headers={"Authorization": f"Bearer {admin_secret(server.data)}"},
        timeout=30,
    )
    if r.status_code != 201:
        raise RuntimeError(f"token create failed: {r.status_code} {r.text}")
    return str(r.json()["token"]), str(r.json()["token_id"])


@dataclass(frozen=True)
class RawResponse:
    status: int
    headers: dict[str, str]
    body: bytes


def raw_request(
    server: Server, method: str, path: str, *, body: bytes | None = None, headers: dict[str, str] | None = None, timeout: float = 30
) -> RawResponse:
    """One request with the path sent exactly as given (httpx would normalise '..' segments)."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=timeout)
    try:
        conn.putrequest(method, path, skip_accept_encoding=True)
        for k, v in (headers or {}).items():
            conn.putheader(k, v)
        if body is not None and not any(k.lower() in ("content-length", "transfer-encoding") for k in headers or {}):
            conn.putheader("Content-Length", str(len(body)))
        conn.endheaders()
        if body:
            conn.send(body)
        r = conn.getresponse()
        return RawResponse(r.status, {k.lower(): v for k, v in r.getheaders()}, r.read())
    finally:
        conn.close()


def stored_blobs(data: Path) -> dict[str, int]:
    """Every file under blobs/sha256: name -> size."""
    d = data / "blobs" / "sha256"
    return {p.name: p.stat().st_size for p in sorted(d.iterdir())} if d.exists() else {}


def partial_blobs(data: Path) -> list[str]:
    """Blob files whose bytes do not hash to their name (there must be none)."""
    bad = []
    for p in sorted((data / "blobs" / "sha256").iterdir()):
        h = hashlib.sha256()
        with p.open("rb") as f:
            for chunk in iter(lambda f=f: f.read(1 << 20), b""):
                h.update(chunk)
        if h.hexdigest() != p.name:
            bad.append(p.name)
    return bad


def tree_size(server: Server) -> int:
    """The size in the server's latest checkpoint (its second line)."""
    note = httpx.get(server.url + "/v1/log/checkpoint", timeout=30).text
    return int(note.split("\n")[1])


def put_blob(client: httpx.Client, token: str, data: bytes) -> httpx.Response:
    return client.put(f"/v1/blobs/{sha256_bytes(data)}", content=data, headers={"Authorization": f"Bearer {token}"})


def post_entry(client: httpx.Client, token: str, envelope: bytes) -> httpx.Response:
    return client.post("/v1/entries", content=envelope, headers={"Authorization": f"Bearer {token}"})
