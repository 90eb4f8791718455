"""Hostile HTTP inputs against a real ``kvgraft serve`` on 127.0.0.1.

Every answer must be below 500, every error an RFC 9457 problem with a detail and a hint; the
server stays up, and nothing is stored: the blob directory, blobs/tmp and the log are exactly
as they were before the first hostile request, and the server log holds no traceback.
"""

from __future__ import annotations

import json
import string
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvgraft.schemas import sha256_bytes
from tests.registry.conftest import Key, Server, artifact, leftovers, running_server
from tests.reliability.conftest import Figures, Scale
from tests.reliability.hostile import JSON_VALUES, mutated_json
from tests.reliability.servers import (
    RawResponse,
    make_token,
    partial_blobs,
    post_entry,
    put_blob,
    raw_request,
    stored_blobs,
    tree_size,
)

MAX_BLOB = 4096
MAX_ENVELOPE = 16384
# http.client refuses control characters and spaces in a request target; everything else goes.
_PATH_CHARS = string.ascii_letters + string.digits + "-._~:/?#[]@!$&'()*+,;=%"


class Target:
    """The server under attack and what it held before the attack."""

    def __init__(self, server: Server, token: str, blob: bytes, envelope: bytes, unstored: dict[str, Any]) -> None:
        self.server = server
        self.token = token
        self.blob = blob
        self.blob_ref = sha256_bytes(blob)
        self.envelope = envelope
        self.unstored = unstored
        self.blobs_before = stored_blobs(server.data)
        self.size_before = tree_size(server)

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory, rkeys: dict[str, Key]) -> Iterator[Target]:
    data = tmp_path_factory.mktemp("hostile-http") / "data"
    with running_server(
        data, "--max-blob-bytes", str(MAX_BLOB), "--max-envelope-bytes", str(MAX_ENVELOPE), "--rate-limit", "0", "--log-level", "info"
    ) as server:
        token, _ = make_token(server, "alice", rkeys["alice"])
        art = artifact("a stored artifact")
        with httpx.Client(base_url=server.url, timeout=30) as client:
            assert put_blob(client, token, art.tensors).status_code == 201
            envelope = rkeys["alice"].sign(art.statement)
            assert post_entry(client, token, envelope).status_code == 201
        # Signed by alice, but its tensors are never uploaded: every variant must be refused.
        unstored = json.loads(rkeys["alice"].sign(artifact("never stored").statement))
        t = Target(server, token, art.tensors, envelope, unstored)
        yield t
        # After every property: nothing stored, nothing half-written, the server alive and clean.
        assert server.proc.poll() is None, "the server died under hostile input"
        assert stored_blobs(data) == t.blobs_before
        assert leftovers(data) == []
        assert partial_blobs(data) == []
        assert tree_size(server) == t.size_before
        log = server.log()
        assert "Traceback" not in log and "Internal Server Error" not in log, log[-4000:]


def _settings(scale: Scale) -> settings:
    return settings(
        max_examples=scale.http_examples, deadline=None, database=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
    )


def _check(r: httpx.Response | RawResponse, method: str) -> None:
    status = r.status_code if isinstance(r, httpx.Response) else r.status
    body = r.content if isinstance(r, httpx.Response) else r.body
    headers = r.headers if isinstance(r, httpx.Response) else r.headers
    assert status < 500, (status, body[:500])
    if status >= 400 and method != "HEAD":
        assert headers["content-type"].startswith("application/problem+json"), (status, headers, body[:300])
        problem = json.loads(body)
        assert problem["status"] == status and problem["detail"], problem


# --- digests in paths --------------------------------------------------------------------------

_HOSTILE_REFS = st.one_of(
    st.text(alphabet=_PATH_CHARS, max_size=90),
    st.sampled_from([
        "sha256:..", "sha256:../../registry.duckdb", "sha256:%2e%2e%2fregistry.duckdb", "..", "../..", "%2e%2e",
        "sha256:" + "A" * 64, "sha256:" + "0" * 63, "sha256:" + "0" * 65, "sha512:" + "0" * 128, "sha256:" + "0" * 64 + "/..",
        "sha256:" + "0" * 32 + "/" + "0" * 32, "/etc/passwd", "//", "sha256:" + "0" * 64 + "%00", "tmp/x", "sha256/" + "0" * 64,
    ]),
)


def test_digests_in_paths(target: Target, scale: Scale, figures: Figures) -> None:
    @_settings(scale)
    @given(ref=_HOSTILE_REFS, method=st.sampled_from(["GET", "HEAD", "PUT"]), where=st.sampled_from(["blobs", "artifacts", "entries"]))
    def prop(ref: str, method: str, where: str) -> None:
        figures.count("http", "digest_paths")
        body = b"hostile" if method == "PUT" else None
        r = raw_request(target.server, method, f"/v1/{where}/{ref}", body=body, headers=target.auth)
        _check(r, method)
        assert r.status not in (200, 201) or method != "PUT", r

    prop()


# --- Range and Content-Range -------------------------------------------------------------------

#: What h11 lets a client send in a header value: visible ASCII, spaces inside, obs-text.
_HEADER_TEXT = st.text(alphabet=[chr(c) for c in [*range(0x20, 0x7F), *range(0x80, 0x100)]], max_size=40).map(str.strip)
_RANGES = st.one_of(
    _HEADER_TEXT,
    st.builds(lambda a, b: f"bytes={a}-{b}", st.integers(-5, 5000), st.integers(-5, 5000)),
    st.builds(lambda xs: "bytes=" + ",".join(xs), st.lists(st.sampled_from(["0-0", "-1", "5-", "-0", "9-3", "x-y", "1-2"]), max_size=20)),
    st.sampled_from(["bytes=-99999999999999999999999", "bytes=99999999999999999999-", "bytes=0-" + "9" * 5000, "items=0-1"]),
)


def test_range_headers(target: Target, scale: Scale, figures: Figures) -> None:
    size = len(target.blob)

    @_settings(scale)
    @given(value=_RANGES, if_range=st.one_of(st.none(), st.sampled_from(['"sha256:x"', "Mon, 01 Jan 2024 00:00:00 GMT"])))
    def prop(value: str, if_range: str | None) -> None:
        figures.count("http", "range_headers")
        headers: dict[str, bytes] = {"Range": value.encode("latin-1")}
        if if_range:
            headers["If-Range"] = if_range.encode("latin-1")
        r = httpx.get(f"{target.server.url}/v1/blobs/{target.blob_ref}", headers=headers, timeout=30)
        _check(r, "GET")
        if r.status_code == 200:
            assert r.content == target.blob
        elif r.status_code == 206 and "content-range" in r.headers:
            first, last = map(int, r.headers["content-range"].split()[1].split("/")[0].split("-"))
            assert r.content == target.blob[first : last + 1]
        elif r.status_code == 416:
            assert r.headers["content-range"] == f"bytes */{size}"

    prop()


def test_content_range_on_upload(target: Target, scale: Scale, figures: Figures) -> None:
    data = b"partial upload " * 8

    @_settings(scale)
    @given(value=st.one_of(_HEADER_TEXT, st.builds(lambda a, b, n: f"bytes {a}-{b}/{n}", st.integers(-1, 200), st.integers(-1, 200), st.integers(0, 200))),
           cut=st.integers(min_value=0, max_value=len(data) - 1))
    def prop(value: str, cut: int) -> None:
        figures.count("http", "content_range")
        headers = {**{k: v.encode() for k, v in target.auth.items()}, "Content-Range": value.encode("latin-1")}
        # Only a part of the blob is sent: whatever Content-Range says, nothing may be stored.
        r = httpx.put(f"{target.server.url}/v1/blobs/{sha256_bytes(data)}", content=data[:cut], headers=headers, timeout=30)
        _check(r, "PUT")
        assert r.status_code == 400 and r.json()["type"].endswith("/digest-mismatch"), r.text

    prop()


# --- bodies over the limit, slow bodies, broken bodies -----------------------------------------


def test_bodies_over_the_limit(target: Target, figures: Figures) -> None:
    url = target.server.url
    big = b"x" * (MAX_BLOB + 1)
    cases = [
        httpx.put(f"{url}/v1/blobs/{sha256_bytes(big)}", content=big, headers=target.auth, timeout=30),
        # chunked: no Content-Length, the limit is found while streaming
        httpx.put(f"{url}/v1/blobs/{sha256_bytes(big)}", content=iter([big[:1000], big[1000:]]), headers=target.auth, timeout=30),
        httpx.post(f"{url}/v1/entries", content=b" " * (MAX_ENVELOPE + 1), headers=target.auth, timeout=30),
        httpx.post(f"{url}/v1/entries", content=iter([b"{" * 9000, b"}" * 9000]), headers=target.auth, timeout=30),
    ]
    for r in cases:
        figures.count("http", "over_limit")
        _check(r, "PUT")
        assert r.status_code == 413, r.text
        assert r.json()["limit"] in (MAX_BLOB, MAX_ENVELOPE)


def test_slow_and_broken_bodies(target: Target, figures: Figures) -> None:
    url = target.server.url
    data = b"slow body " * 100

    def slow(parts: int, pause: float, stop_early: bool = False) -> Iterator[bytes]:
        step = len(data) // parts
        for i in range(parts):
            time.sleep(pause)
            if stop_early and i == parts // 2:
                raise ConnectionAbortedError("the client gives up mid-body")
            yield data[i * step : (i + 1) * step]

    # A slow, complete, wrong body (it is declared as another blob's digest): refused, nothing kept.
    figures.count("http", "slow_bodies")
    r = httpx.put(f"{url}/v1/blobs/{sha256_bytes(b'other')}", content=slow(10, 0.1), headers=target.auth, timeout=30)
    _check(r, "PUT")
    assert r.status_code == 400, r.text
    # Clients that hang up mid-body, while other requests go on.
    for _ in range(3):
        figures.count("http", "slow_bodies")
        with pytest.raises(ConnectionAbortedError):
            httpx.put(f"{url}/v1/blobs/{sha256_bytes(data)}", content=slow(10, 0.05, stop_early=True), headers=target.auth, timeout=30)
        assert httpx.get(f"{url}/v1/log/checkpoint", timeout=30).status_code == 200
    # A body declared longer than it is, then the connection closes.
    figures.count("http", "slow_bodies")
    _truncated_upload(target, data)
    # The server finished (or dropped) each of them: no upload is left in blobs/tmp.
    deadline = time.monotonic() + 10
    while leftovers(target.server.data) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert leftovers(target.server.data) == []


def _truncated_upload(target: Target, data: bytes) -> None:
    import socket

    with socket.create_connection(("127.0.0.1", target.server.port), timeout=10) as s:
        head = (
            f"PUT /v1/blobs/{sha256_bytes(data)} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {target.token}\r\n"
            f"Content-Length: {len(data)}\r\n\r\n"
        ).encode()
        s.sendall(head + data[:100])
        # Closed with 100 of the declared bytes sent, after the server has begun to read them.
        time.sleep(0.3)


# --- entries: content types, mutated envelopes, tokens ------------------------------------------


def test_posted_entries(target: Target, scale: Scale, figures: Figures) -> None:
    @_settings(scale)
    @given(
        body=st.one_of(mutated_json(target.unstored), st.binary(max_size=300), JSON_VALUES.map(lambda v: json.dumps(v).encode())),
        content_type=st.one_of(st.none(), st.sampled_from(["application/json", "text/plain", "multipart/form-data; boundary=x",
                                                            "application/x-www-form-urlencoded", "image/png", "*/*", "garbage"])),
        auth=st.sampled_from(["token", "none", "bad", "basic"]),
    )
    def prop(body: bytes, content_type: str | None, auth: str) -> None:
        figures.count("http", "entries")
        headers = {"token": target.auth, "none": {}, "bad": {"Authorization": "Bearer kvgr_" + "x" * 43},
                   "basic": {"Authorization": "Basic YWxpY2U6c2VjcmV0"}}[auth]
        if content_type:
            headers = {**headers, "Content-Type": content_type}
        r = httpx.post(f"{target.server.url}/v1/entries", content=body, headers=headers, timeout=30)
        _check(r, "POST")
        assert r.status_code >= 400, r.text
        if auth != "token":
            assert r.status_code == 401

    prop()


def test_query_parameters(target: Target, scale: Scale, figures: Figures) -> None:
    paths = ["/v1/entries", "/v1/artifacts", "/v1/records", "/v1/log/proof/inclusion", "/v1/log/proof/consistency", "/v1/log/checkpoint"]
    names = ["limit", "cursor", "index", "tree_size", "old", "new", "parent", "model", "q", "type", "artifact"]

    @_settings(scale)
    @given(path=st.sampled_from(paths), params=st.dictionaries(st.sampled_from(names), st.one_of(
        st.text(max_size=20), st.integers(-(2**70), 2**70).map(str), st.sampled_from(["-1", "0", "1e9", "NaN", "9" * 400])), max_size=4))
    def prop(path: str, params: dict[str, str]) -> None:
        figures.count("http", "query_params")
        r = httpx.get(target.server.url + path, params=params, timeout=30)
        _check(r, "GET")

    prop()
