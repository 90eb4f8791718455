"""The fast read path: cache headers a CDN can act on, 304s and envelopes answered from memory
(without the database), and the verified-blob cache that never lets rot through: a blob that
rotted after it was read once is still refused (every byte sent is re-hashed), and a quarantine,
however it was found, ends every answer from memory."""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from kvgraft.registry._internal.blobs.store import INLINE_READ_BYTES, WHOLE_READ_BYTES
from kvgraft.registry._internal.readcache import BoundedLru, EnvelopeCache

from .conftest import Harness, Key, artifact, blob_path, harness

IMMUTABLE = "public, max-age=31536000, immutable"
SMALL = bytes(range(256)) * 16  # 4 KiB: read on the event loop once verified
MIB = bytes(range(251)) * ((1 << 20) // 251)  # about 1 MiB: read whole in a worker thread, sent in one piece
QUARANTINED = "https://kvgraft.dev/problems/blob-quarantined"


def digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


@pytest.fixture
def reg(tmp_path: Path, keys: dict[str, Key]) -> Iterator[Harness]:
    """An in-process registry on the data directory's blob store (the one with a verified cache)."""
    with harness(tmp_path / "data", keys) as h:
        yield h


@contextmanager
def database_held(reg: Harness, seconds: float = 5.0) -> Iterator[None]:
    """The database's lock held by another thread for ``seconds`` (or until the block ends): a
    request that needs the database waits that long."""
    lock = reg.client.app.state.registry.db.lock
    held, done = threading.Event(), threading.Event()

    def hold() -> None:
        with lock:
            held.set()
            done.wait(seconds)

    t = threading.Thread(target=hold)
    t.start()
    held.wait(5)
    try:
        yield
    finally:
        done.set()
        t.join(10)


def flip(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x01
    path.write_bytes(bytes(data))


def assert_quarantined(r, ref: str) -> None:  # type: ignore[no-untyped-def]
    assert r.status_code == 404, r.text
    assert r.headers.get("etag") != f'"{ref}"'
    if r.request.method != "HEAD":
        doc = r.json()
        assert doc["type"] == QUARANTINED and ref in doc["detail"] and "upload the right bytes" in doc["hint"]


def test_the_sizes_the_fast_paths_assume() -> None:
    # A 4 KiB blob is read on the event loop once verified; 1 MiB in one worker-thread read.
    assert len(SMALL) <= INLINE_READ_BYTES < len(MIB) <= WHOLE_READ_BYTES


@pytest.mark.parametrize("data", [SMALL, MIB, b""], ids=["4KiB", "1MiB", "empty"])
def test_blobs_carry_immutable_cache_headers_and_come_whole(reg: Harness, data: bytes) -> None:
    ref = digest(data)
    assert reg.put_blob(data).status_code == 201
    for _ in range(2):  # the first read verifies; the second is answered by the fast path
        r = reg.client.get(f"/v1/blobs/{ref}")
        assert r.status_code == 200 and r.content == data
        assert r.headers["content-length"] == str(len(data))
        assert r.headers["cache-control"] == IMMUTABLE and r.headers["etag"] == f'"{ref}"'
        head = reg.client.head(f"/v1/blobs/{ref}")
        assert head.status_code == 200 and head.headers["content-length"] == str(len(data))
        assert head.headers["cache-control"] == IMMUTABLE
        cond = reg.client.get(f"/v1/blobs/{ref}", headers={"If-None-Match": f'"{ref}"'})
        assert cond.status_code == 304 and cond.content == b"" and cond.headers["cache-control"] == IMMUTABLE


def test_ranges_of_a_blob_read_whole_are_its_slices(reg: Harness) -> None:
    ref = digest(MIB)
    reg.put_blob(MIB)
    r = reg.client.get(f"/v1/blobs/{ref}", headers={"Range": "bytes=1000-1999"})
    assert r.status_code == 206 and r.content == MIB[1000:2000]
    assert r.headers["content-range"] == f"bytes 1000-1999/{len(MIB)}" and r.headers["content-length"] == "1000"
    r = reg.client.get(f"/v1/blobs/{ref}", headers={"Range": "bytes=0-1,-2"})
    assert r.status_code == 206 and r.headers["content-type"].startswith("multipart/byteranges")
    assert MIB[:2] in r.content and MIB[-2:] in r.content


@pytest.mark.parametrize("data", [SMALL, MIB], ids=["4KiB", "1MiB"])
def test_a_blob_that_rots_after_it_was_served_is_refused_by_every_read_after(reg: Harness, data: bytes) -> None:
    ref = digest(data)
    reg.put_blob(data)
    assert reg.client.get(f"/v1/blobs/{ref}").content == data  # verified: now in the cache
    # Answers that send no bytes come from memory meanwhile; the next read that sends bytes
    # re-hashes them, finds the rot and quarantines the blob, ending the answers from memory.
    flip(blob_path(reg.data, data), len(data) // 2)
    assert_quarantined(reg.client.get(f"/v1/blobs/{ref}", headers={"Range": "bytes=0-9"}), ref)
    assert_quarantined(reg.client.get(f"/v1/blobs/{ref}"), ref)
    assert_quarantined(reg.client.head(f"/v1/blobs/{ref}"), ref)
    assert_quarantined(reg.client.get(f"/v1/blobs/{ref}", headers={"If-None-Match": f'"{ref}"'}), ref)
    # A re-upload repairs it, and the cache serves it again.
    assert reg.put_blob(data).json()["created"] is True
    assert reg.client.get(f"/v1/blobs/{ref}").content == data
    assert reg.client.get(f"/v1/blobs/{ref}", headers={"If-None-Match": f'"{ref}"'}).status_code == 304


def test_a_blob_the_scrub_quarantines_is_no_longer_answered_from_memory(reg: Harness) -> None:
    ref = digest(SMALL)
    reg.put_blob(SMALL)
    assert reg.client.head(f"/v1/blobs/{ref}").status_code == 200
    flip(blob_path(reg.data, SMALL), 7)
    result = reg.client.app.state.registry.blobs.scrub()
    assert [d.hex_digest for d in result.damaged] == [ref.removeprefix("sha256:")]
    assert_quarantined(reg.client.head(f"/v1/blobs/{ref}"), ref)
    assert_quarantined(reg.client.get(f"/v1/blobs/{ref}", headers={"If-None-Match": f'"{ref}"'}), ref)


def test_a_blob_removed_behind_the_servers_back_is_not_served(reg: Harness) -> None:
    ref = digest(SMALL)
    reg.put_blob(SMALL)
    reg.client.get(f"/v1/blobs/{ref}")
    blob_path(reg.data, SMALL).unlink()
    r = reg.client.get(f"/v1/blobs/{ref}")
    assert r.status_code == 404 and r.json()["type"] == "https://kvgraft.dev/problems/blob-not-found"


def test_envelopes_and_their_304_are_answered_without_the_database_once_read(reg: Harness, keys: dict[str, Key]) -> None:
    first = reg.publish_artifact(artifact("one"), keys["alice"])["entry"]
    # The premise: a read not yet cached waits for the database.
    with database_held(reg, seconds=1.5):
        started = time.monotonic()
        envelope = reg.client.get("/v1/entries/0/envelope").content
        assert time.monotonic() - started >= 1.0
    etag = f'"{first["digest"]}"'
    with database_held(reg):
        started = time.monotonic()
        by_index = reg.client.get("/v1/entries/0/envelope")
        by_digest = reg.client.get(f"/v1/entries/{first['digest']}/envelope")
        cond = reg.client.get("/v1/entries/0/envelope", headers={"If-None-Match": etag})
        elapsed = time.monotonic() - started
    assert elapsed < 2.5, f"the cached reads waited {elapsed:.1f} s for the database"
    assert by_index.status_code == 200 and by_index.content == envelope and by_index.headers["etag"] == etag
    assert by_digest.content == envelope and by_digest.headers["cache-control"] == IMMUTABLE
    assert cond.status_code == 304 and cond.headers["cache-control"] == IMMUTABLE
    # An entry not yet read still comes from the database, and a missing one is still 404.
    assert reg.client.get("/v1/entries/1/envelope").status_code == 404


def test_blob_reads_do_not_wait_for_the_database(reg: Harness) -> None:
    ref = digest(SMALL)
    reg.put_blob(SMALL)
    with database_held(reg):
        started = time.monotonic()
        assert reg.client.get(f"/v1/blobs/{ref}").content == SMALL
        assert reg.client.get(f"/v1/blobs/{ref}", headers={"If-None-Match": f'"{ref}"'}).status_code == 304
        elapsed = time.monotonic() - started
    assert elapsed < 2.5, f"blob reads waited {elapsed:.1f} s for the database"


def test_old_checkpoints_are_immutable_and_the_latest_is_not(reg: Harness, keys: dict[str, Key]) -> None:
    reg.publish_artifact(artifact("one"), keys["alice"])
    reg.publish_artifact(artifact("two"), keys["alice"])
    latest = reg.client.get("/v1/log/checkpoint")
    assert latest.status_code == 200 and latest.headers["cache-control"] == "no-cache"
    size = int(latest.text.splitlines()[1])
    assert size == 2
    old = reg.client.get("/v1/log/checkpoint", params={"tree_size": "1"})
    assert old.status_code == 200 and old.headers["cache-control"] == IMMUTABLE
    # Named by its size, the latest still moves on (witness cosignatures gather on it first).
    named = reg.client.get("/v1/log/checkpoint", params={"tree_size": str(size)})
    assert named.status_code == 200 and named.headers["cache-control"] == "no-cache"
    # A checkpoint that does not exist is a problem, never cacheable content.
    missing = reg.client.get("/v1/log/checkpoint", params={"tree_size": "99"})
    assert missing.status_code == 404 and missing.headers.get("cache-control") != IMMUTABLE


def test_bounded_lru_keeps_the_recent_within_both_bounds() -> None:
    lru: BoundedLru[str, int] = BoundedLru(max_entries=3, max_weight=10)
    for k in "abc":
        lru.put(k, ord(k), 2)
    assert lru.get("a") == ord("a")  # now the most recent: "b" goes first
    lru.put("d", 0, 2)
    assert lru.get("b") is None and len(lru) == 3
    lru.put("e", 0, 9)  # weight: evicts until 9 fits within 10
    assert [k for k in "acde" if lru.get(k) is not None] == ["e"]
    lru.put("huge", 0, 11)  # heavier than the whole cache: not kept
    assert lru.get("huge") is None and lru.get("e") == 0
    lru.pop("e")
    lru.pop("never")
    assert len(lru) == 0
    off: BoundedLru[str, int] = BoundedLru(max_entries=0, max_weight=10)
    off.put("a", 1)
    assert off.get("a") is None


def test_envelope_cache_answers_both_names() -> None:
    cache = EnvelopeCache(max_entries=4, max_bytes=100)
    cache.put("3", "sha256:" + "a" * 64, b"{}")
    assert cache.get("3") == cache.get("sha256:" + "a" * 64)
    assert cache.get("4") is None
