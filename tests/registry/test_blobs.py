"""Blobs in-process, on both stores (the data directory and S3): streamed upload checked against
its digest, HEAD, GET with ETag and Range, multipart-sized uploads, rot quarantined and repaired."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvgraft.registry import RangeNotSatisfiableError
from kvgraft.registry._internal.ranges import MAX_RANGES, none_match, parse_range

from .conftest import Harness, Key, blob_path, harness, leftovers
from .s3server import PART_SIZE, s3_server_fixture  # noqa: F401 - the session fixture the S3 stores use

DATA = bytes(range(256)) * 40  # 10240 bytes
DIGEST = "sha256:" + hashlib.sha256(DATA).hexdigest()
#: Larger than two S3 parts: a three-part multipart upload on S3, a plain file locally.
LARGE = bytes(range(251)) * (PART_SIZE * 5 // 2 // 251)


@dataclass
class Store:
    """One blob store under test: the settings that name it, and a direct view of what it holds."""

    kind: str
    settings: dict[str, Any]
    #: The bytes stored under a blob's final name, or None.
    stored: Callable[[bytes], bytes | None]
    #: Overwrite a stored blob behind the registry's back (rot).
    damage: Callable[[bytes, bytes], None]
    #: Uploads in progress and anything outside blobs/sha256 and blobs/quarantine: none once a request ends.
    leftovers: Callable[[], list[str]]
    extra: dict[str, Any] = field(default_factory=dict)


@pytest.fixture(params=["local", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Store:
    data = tmp_path / "data"
    if request.param == "local":
        def stored(b: bytes) -> bytes | None:
            path = blob_path(data, b)
            return path.read_bytes() if path.exists() else None

        def damage(b: bytes, other: bytes) -> None:
            blob_path(data, b).write_bytes(other)

        return Store("local", {}, stored, damage, lambda: [str(p) for p in leftovers(data)])
    s3 = request.getfixturevalue("s3_server").store()

    def s3_leftovers() -> list[str]:
        stray = [k for k in s3.keys() if not k.startswith(("blobs/sha256/", "blobs/quarantine/"))]
        return s3.uploads() + stray

    return Store(
        "s3", s3.settings(), lambda b: s3.stored(hashlib.sha256(b).hexdigest()),
        lambda b, other: s3.put_raw(hashlib.sha256(b).hexdigest(), other), s3_leftovers, {"s3": s3},
    )


@pytest.fixture
def reg(store: Store, tmp_path: Path, keys: dict[str, Key]) -> Iterator[Harness]:
    """An in-process registry over ``store``, with tokens for alice and bob."""
    with harness(tmp_path / "data", keys, **store.settings) as h:
        yield h


def _problem(r, status: int, slug: str | None = None) -> dict:  # type: ignore[no-untyped-def]
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/problem+json")
    doc = r.json()
    assert doc["status"] == status and doc["title"] and doc["detail"] and doc["type"]
    if slug is not None:
        assert doc["type"] == f"https://kvgraft.dev/problems/{slug}"
    return dict(doc)


def test_upload_is_201_then_200_and_the_bytes_come_back(reg: Harness, store: Store) -> None:
    r = reg.put_blob(DATA)
    assert r.status_code == 201, r.text
    assert r.json() == {"digest": DIGEST, "size": len(DATA), "created": True}
    assert r.headers["location"] == f"/v1/blobs/{DIGEST}"
    assert store.stored(DATA) == DATA
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
    assert store.leftovers() == []


def test_streamed_upload_without_content_length(reg: Harness, store: Store) -> None:
    def chunks():  # type: ignore[no-untyped-def]
        for i in range(0, len(DATA), 1000):
            yield DATA[i : i + 1000]

    r = reg.client.put(f"/v1/blobs/{DIGEST}", content=chunks(), headers=reg.auth())
    assert r.status_code == 201, r.text
    assert store.stored(DATA) == DATA


def test_bytes_that_do_not_match_the_digest_are_refused_and_leave_nothing(reg: Harness, store: Store) -> None:
    wrong = DATA[:-1] + b"\x00"
    r = reg.client.put(f"/v1/blobs/{DIGEST}", content=wrong, headers=reg.auth())
    doc = _problem(r, 400, "digest-mismatch")
    assert f"not {DIGEST}" in doc["detail"]
    assert doc["actual"] == "sha256:" + hashlib.sha256(wrong).hexdigest()
    assert store.stored(DATA) is None
    assert store.leftovers() == []
    _problem(reg.client.get(f"/v1/blobs/{DIGEST}"), 404, "blob-not-found")


def test_wrong_bytes_for_an_existing_blob_are_refused_and_the_blob_is_untouched(reg: Harness, store: Store) -> None:
    reg.put_blob(DATA)
    r = reg.client.put(f"/v1/blobs/{DIGEST}", content=b"other", headers=reg.auth())
    _problem(r, 400, "digest-mismatch")
    assert store.stored(DATA) == DATA


def test_a_blob_of_several_parts_is_stored_whole_and_read_back_in_ranges(reg: Harness, store: Store) -> None:
    ref = "sha256:" + hashlib.sha256(LARGE).hexdigest()
    r = reg.client.put(f"/v1/blobs/{ref}", content=LARGE, headers=reg.auth())
    assert r.status_code == 201, r.text
    assert r.json()["size"] == len(LARGE)
    assert store.stored(LARGE) == LARGE
    if store.kind == "s3":
        # Sent as a multipart upload of 5 MiB parts: S3 marks such an object's ETag with its part count.
        s3 = store.extra["s3"]
        head = s3.server.client().head_object(Bucket="kvgraft-test", Key=s3.key(ref[7:]))
        assert head["ETag"].strip('"').endswith(f"-{-(-len(LARGE) // PART_SIZE)}")
    assert store.leftovers() == []
    got = reg.client.get(f"/v1/blobs/{ref}")
    assert got.status_code == 200 and got.content == LARGE
    edge = PART_SIZE - 3
    r = reg.client.get(f"/v1/blobs/{ref}", headers={"Range": f"bytes={edge}-{edge + 9}, -7"})
    assert r.status_code == 206 and LARGE[edge : edge + 10] in r.content and r.content.count(LARGE[-7:]) >= 1


def test_a_multipart_sized_upload_with_the_wrong_bytes_leaves_nothing(reg: Harness, store: Store) -> None:
    ref = "sha256:" + hashlib.sha256(LARGE).hexdigest()
    wrong = LARGE[:-1] + b"\xff"
    doc = _problem(reg.client.put(f"/v1/blobs/{ref}", content=wrong, headers=reg.auth()), 400, "digest-mismatch")
    assert doc["size"] == len(LARGE)
    assert store.stored(LARGE) is None
    assert store.leftovers() == []


def test_a_rotten_blob_is_quarantined_and_a_reupload_repairs_it(reg: Harness, store: Store) -> None:
    reg.put_blob(DATA)
    store.damage(DATA, DATA[:-1] + b"\x01")
    doc = _problem(reg.client.get(f"/v1/blobs/{DIGEST}"), 404, "blob-quarantined")
    assert "no longer hashed to its digest" in doc["detail"]
    assert store.stored(DATA) is None
    assert reg.client.head(f"/v1/blobs/{DIGEST}").status_code == 404
    r = reg.put_blob(DATA)
    assert r.status_code == 201 and r.json()["created"] is True
    assert reg.client.get(f"/v1/blobs/{DIGEST}").content == DATA
    assert store.stored(DATA) == DATA


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
def test_malformed_digests_are_400(reg: Harness, store: Store, ref: str) -> None:
    for method in ("GET", "PUT"):
        r = reg.client.request(method, f"/v1/blobs/{ref}", content=b"x" if method == "PUT" else None, headers=reg.auth())
        doc = _problem(r, 400, "bad-digest")
        assert "is not sha256: followed by 64 lowercase hex digits" in doc["detail"]
    assert store.leftovers() == []


def test_writes_need_a_token(reg: Harness, store: Store) -> None:
    r = reg.client.put(f"/v1/blobs/{DIGEST}", content=DATA)
    doc = _problem(r, 401, "unauthenticated")
    assert r.headers["www-authenticate"].startswith("Bearer")
    assert "needs a bearer token" in doc["detail"]
    r = reg.client.put(f"/v1/blobs/{DIGEST}", content=DATA, headers={"Authorization": "Bearer kvgr_forged"})
    assert "not one this registry issued" in _problem(r, 401)["detail"]
    assert store.stored(DATA) is None


def test_size_limit_is_413_with_or_without_content_length(tmp_path: Path, keys, store: Store) -> None:  # type: ignore[no-untyped-def]
    with harness(tmp_path / "data", keys, max_blob_bytes=1000, **store.settings) as h:
        r = h.client.put(f"/v1/blobs/{DIGEST}", content=DATA, headers=h.auth())
        assert "at most 1000" in _problem(r, 413, "too-large")["detail"]

        def chunks():  # type: ignore[no-untyped-def]
            for i in range(0, len(DATA), 512):
                yield DATA[i : i + 512]

        r = h.client.put(f"/v1/blobs/{DIGEST}", content=chunks(), headers=h.auth())
        assert "larger than this registry's limit of 1000 bytes" in _problem(r, 413, "too-large")["detail"]
        assert store.leftovers() == []
        assert store.stored(DATA) is None
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


def test_full_disk_during_a_pipelined_upload_is_the_error_raised_not_the_closed_stream_regression() -> None:
    # A full-disk run of make test answered 500, not 507: the store task failed on the disk and
    # closed its stream, the receiving task's send then raised BrokenResourceError, and that
    # consequence was picked as the upload's error.
    import anyio

    from kvgraft.registry._internal.blobs.store import _first_error

    disk_full = OSError(28, "No space left on device")
    alone = anyio.BrokenResourceError()

    async def pick() -> tuple[BaseException, BaseException]:  # the cancellation class is the running loop's
        group = BaseExceptionGroup("upload", [anyio.BrokenResourceError(), BaseExceptionGroup("store", [disk_full])])
        return _first_error(group), _first_error(BaseExceptionGroup("upload", [alone]))

    assert anyio.run(pick) == (disk_full, alone)
