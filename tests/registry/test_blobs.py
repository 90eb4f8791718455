"""Blobs in-process: streamed upload checked against its digest, HEAD, GET with ETag and Range."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvgraft.registry import RangeNotSatisfiableError
from kvgraft.registry._internal.ranges import MAX_RANGES, none_match, parse_range

from .conftest import Harness, blob_path, harness, leftovers

DATA = bytes(range(256)) * 40  # 10240 bytes
DIGEST = "sha256:" + hashlib.sha256(DATA).hexdigest()


def _problem(r, status: int, slug: str | None = None) -> dict:  # type: ignore[no-untyped-def]
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/problem+json")
    doc = r.json()
    assert doc["status"] == status and doc["title"] and doc["detail"] and doc["type"]
    if slug is not None:
        assert doc["type"] == f"https://kvgraft.dev/problems/{slug}"
    return dict(doc)


def test_upload_is_201_then_200_and_the_bytes_come_back(reg: Harness) -> None:
    r = reg.put_blob(DATA)
    assert r.status_code == 201, r.text
    assert r.json() == {"digest": DIGEST, "size": len(DATA), "created": True}
    assert r.headers["location"] == f"/v1/blobs/{DIGEST}"
    assert blob_path(reg.data, DATA).read_bytes() == DATA
    again = reg.put_blob(DATA)
    assert again.status_code == 200 and again.json()["created"] is False

    got = reg.client.get(f"/v1/blobs/{DIGEST}")
    assert got.status_code == 200
    assert got.content == DATA
    assert got.headers["etag"] == f'"{DIGEST}"'
    assert got.headers["accept-ranges"] == "bytes"
    assert got.headers["content-length"] == str(len(DATA))
    assert got.headers["content-type"] == "application/octet-stream"
    head = reg.client.head(f"/v1/blobs/{DIGEST}")
    assert head.status_code == 200 and head.content == b""
    assert head.headers["content-length"] == str(len(DATA))
    assert head.headers["etag"] == f'"{DIGEST}"'
    assert leftovers(reg.data) == []


def test_streamed_upload_without_content_length(reg: Harness) -> None:
    def chunks():  # type: ignore[no-untyped-def]
        for i in range(0, len(DATA), 1000):
            yield DATA[i : i + 1000]

    r = reg.client.put(f"/v1/blobs/{DIGEST}", content=chunks(), headers=reg.auth())
    assert r.status_code == 201, r.text
    assert blob_path(reg.data, DATA).read_bytes() == DATA


def test_bytes_that_do_not_match_the_digest_are_refused_and_leave_nothing(reg: Harness) -> None:
    wrong = DATA[:-1] + b"\x00"
    r = reg.client.put(f"/v1/blobs/{DIGEST}", content=wrong, headers=reg.auth())
    doc = _problem(r, 400, "digest-mismatch")
    assert f"not {DIGEST}" in doc["detail"]
    assert doc["actual"] == "sha256:" + hashlib.sha256(wrong).hexdigest()
    assert not blob_path(reg.data, DATA).exists()
    assert leftovers(reg.data) == []
    _problem(reg.client.get(f"/v1/blobs/{DIGEST}"), 404, "blob-not-found")


def test_wrong_bytes_for_an_existing_blob_are_refused_and_the_blob_is_untouched(reg: Harness) -> None:
    reg.put_blob(DATA)
    r = reg.client.put(f"/v1/blobs/{DIGEST}", content=b"other", headers=reg.auth())
    _problem(r, 400, "digest-mismatch")
    assert blob_path(reg.data, DATA).read_bytes() == DATA


@pytest.mark.parametrize(
    "ref",
    [
        "sha256:" + "A" * 64,
        "sha256:" + "a" * 63,
        "sha256:" + "a" * 65,
        "sha512:" + "a" * 64,
        "a" * 64,
        "sha256:..%2F..%2Fregistry.duckdb",
        "sha256:" + "a" * 32 + "/" + "a" * 31,
        "sha256:" + "a" * 64 + "/x",
        "sha256:..",
    ],
)
def test_malformed_digests_are_400(reg: Harness, ref: str) -> None:
    for method in ("GET", "PUT"):
        r = reg.client.request(method, f"/v1/blobs/{ref}", content=b"x" if method == "PUT" else None, headers=reg.auth())
        doc = _problem(r, 400, "bad-digest")
        assert "is not sha256: followed by 64 lowercase hex digits" in doc["detail"]
    assert leftovers(reg.data) == []


def test_writes_need_a_token(reg: Harness) -> None:
    r = reg.client.put(f"/v1/blobs/{DIGEST}", content=DATA)
    doc = _problem(r, 401, "unauthenticated")
    assert r.headers["www-authenticate"].startswith("Bearer")
    assert "needs a bearer token" in doc["detail"]
    r = reg.client.put(f"/v1/blobs/{DIGEST}", content=DATA, headers={"Authorization": "Bearer kvgr_forged"})
    assert "not one this registry issued" in _problem(r, 401)["detail"]
    assert not blob_path(reg.data, DATA).exists()


def test_size_limit_is_413_with_or_without_content_length(tmp_path: Path, keys) -> None:  # type: ignore[no-untyped-def]
    with harness(tmp_path / "data", keys, max_blob_bytes=1000) as h:
        r = h.client.put(f"/v1/blobs/{DIGEST}", content=DATA, headers=h.auth())
        assert "at most 1000" in _problem(r, 413, "too-large")["detail"]

        def chunks():  # type: ignore[no-untyped-def]
            for i in range(0, len(DATA), 512):
                yield DATA[i : i + 512]

        r = h.client.put(f"/v1/blobs/{DIGEST}", content=chunks(), headers=h.auth())
        assert "larger than this registry's limit of 1000 bytes" in _problem(r, 413, "too-large")["detail"]
        assert leftovers(h.data) == []
        assert not blob_path(h.data, DATA).exists()
        small = b"small"
        assert h.put_blob(small).status_code == 201


@pytest.mark.parametrize(
    ("header", "first", "last"),
    [("bytes=0-0", 0, 0), ("bytes=10-19", 10, 19), ("bytes=10000-", 10000, 10239), ("bytes=-100", 10140, 10239),
     ("bytes=10200-99999", 10200, 10239), ("bytes=-99999", 0, 10239)],
)
def test_single_range_is_206(reg: Harness, header: str, first: int, last: int) -> None:
    reg.put_blob(DATA)
    r = reg.client.get(f"/v1/blobs/{DIGEST}", headers={"Range": header})
    assert r.status_code == 206, r.text
    assert r.content == DATA[first : last + 1]
    assert r.headers["content-range"] == f"bytes {first}-{last}/{len(DATA)}"
    assert r.headers["content-length"] == str(last - first + 1)
    assert r.headers["etag"] == f'"{DIGEST}"'


def test_several_ranges_are_multipart_byteranges(reg: Harness) -> None:
    reg.put_blob(DATA)
    r = reg.client.get(f"/v1/blobs/{DIGEST}", headers={"Range": "bytes=0-9, 100-109, -5"})
    assert r.status_code == 206
    ctype = r.headers["content-type"]
    assert ctype.startswith("multipart/byteranges; boundary=")
    boundary = ctype.split("boundary=")[1].encode()
    assert int(r.headers["content-length"]) == len(r.content)
    parts = [p for p in r.content.split(b"--" + boundary) if p.strip(b"\r\n") not in (b"", b"--")]
    assert len(parts) == 3
    got = []
    for part in parts:
        head, _, body = part.partition(b"\r\n\r\n")
        got.append((head.split(b"Content-Range: bytes ")[1].decode(), body.removesuffix(b"\r\n")))
    assert got == [
        (f"0-9/{len(DATA)}", DATA[0:10]),
        (f"100-109/{len(DATA)}", DATA[100:110]),
        (f"10235-10239/{len(DATA)}", DATA[-5:]),
    ]


def test_unsatisfiable_range_is_416_with_the_size(reg: Harness) -> None:
    reg.put_blob(DATA)
    for header in ("bytes=10240-", "bytes=20000-30000", "bytes=-0"):
        r = reg.client.get(f"/v1/blobs/{DIGEST}", headers={"Range": header})
        doc = _problem(r, 416, "range-not-satisfiable")
        assert r.headers["content-range"] == f"bytes */{len(DATA)}"
        assert "overlaps the blob's 10240 bytes" in doc["detail"]


@pytest.mark.parametrize("header", ["bytes=5-1", "items=0-1", "bytes=abc", "bytes=", "bytes=1-2-3"])
def test_invalid_range_headers_are_ignored(reg: Harness, header: str) -> None:
    reg.put_blob(DATA)
    r = reg.client.get(f"/v1/blobs/{DIGEST}", headers={"Range": header})
    assert r.status_code == 200 and r.content == DATA


def test_etag_conditionals(reg: Harness) -> None:
    reg.put_blob(DATA)
    url = f"/v1/blobs/{DIGEST}"
    for header in (f'"{DIGEST}"', f'W/"{DIGEST}"', f'"sha256:{"0" * 64}", "{DIGEST}"', "*"):
        r = reg.client.get(url, headers={"If-None-Match": header})
        assert r.status_code == 304 and r.content == b""
        assert r.headers["etag"] == f'"{DIGEST}"'
        assert reg.client.head(url, headers={"If-None-Match": header}).status_code == 304
    assert reg.client.get(url, headers={"If-None-Match": f'"sha256:{"0" * 64}"'}).status_code == 200
    # If-Range with another tag: the Range is dropped and the whole blob served.
    r = reg.client.get(url, headers={"Range": "bytes=0-9", "If-Range": '"sha256:other"'})
    assert r.status_code == 200 and r.content == DATA
    r = reg.client.get(url, headers={"Range": "bytes=0-9", "If-Range": f'"{DIGEST}"'})
    assert r.status_code == 206 and r.content == DATA[:10]


def test_missing_blob_head_and_get_are_404(reg: Harness) -> None:
    assert reg.client.head(f"/v1/blobs/{DIGEST}").status_code == 404
    assert "no blob" in _problem(reg.client.get(f"/v1/blobs/{DIGEST}"), 404, "blob-not-found")["detail"]


def test_an_empty_blob(reg: Harness) -> None:
    empty = "sha256:" + hashlib.sha256(b"").hexdigest()
    assert reg.client.put(f"/v1/blobs/{empty}", content=b"", headers=reg.auth()).status_code == 201
    r = reg.client.get(f"/v1/blobs/{empty}")
    assert r.status_code == 200 and r.content == b"" and r.headers["content-length"] == "0"
    _problem(reg.client.get(f"/v1/blobs/{empty}", headers={"Range": "bytes=0-"}), 416)


# --- the Range parser against a reference ---------------------------------------------------------


def _reference(specs: list[tuple[int | None, int | None]], size: int) -> list[tuple[int, int]]:
    out = []
    for first, last in specs:
        if first is None:
            if last and size:
                out.append((max(0, size - last), size - 1))
        elif first < size:
            out.append((first, size - 1 if last is None else min(last, size - 1)))
    return out


_spec = st.one_of(
    st.tuples(st.integers(0, 300), st.none()),
    st.tuples(st.none(), st.integers(0, 300)),
    st.integers(0, 300).flatmap(lambda a: st.tuples(st.just(a), st.integers(a, 400))),
)


@given(specs=st.lists(_spec, min_size=1, max_size=MAX_RANGES), size=st.integers(0, 300))
def test_parse_range_matches_the_rfc_reading(specs: list[tuple[int | None, int | None]], size: int) -> None:
    header = "bytes=" + ", ".join(f"{'' if a is None else a}-{'' if b is None else b}" for a, b in specs)
    want = _reference(specs, size)
    if not want:
        with pytest.raises(RangeNotSatisfiableError, match="overlaps the blob"):
            parse_range(header, size)
        return
    got = parse_range(header, size)
    assert got == want
    assert all(0 <= a <= b < size for a, b in got)


def test_too_many_ranges_serve_the_whole_blob() -> None:
    assert parse_range("bytes=" + ",".join(f"{i}-{i}" for i in range(MAX_RANGES + 1)), 100) is None
    assert parse_range(None, 10) is None


def test_if_none_match_parsing() -> None:
    assert none_match('"a", W/"b"', '"b"')
    assert not none_match('"a,b"', '"b"')
    assert none_match("*", '"x"')
    assert not none_match(None, '"x"')
