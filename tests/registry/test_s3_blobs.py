"""The S3 blob store through ``kvgraft serve --blob-store s3://...``, against a real S3-compatible
server (SeaweedFS, tests/registry/s3server.py) on 127.0.0.1.

Small and multipart-sized blobs go in and come back whole and in ranges; bytes that do not hash
to their digest leave nothing under the final key and no multipart upload behind; publishes see
the blobs S3 holds; rot is quarantined (by a read and by ``kvgraft fsck`` over S3) until a
re-upload repairs it; a store that is unreachable or full is a 503/507 problem, never a 500; a
bucket or credential that cannot work stops ``kvgraft serve`` with one line.
"""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import json
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvgraft.registry._internal.blobs.s3 import s3_error
from tests.reliability.mounts import tmpfs
from tests.reliability.servers import make_token, post_entry, put_blob

from .conftest import Key, artifact, free_port, registry_cli, running_server
from .s3server import ACCESS_KEY, BUCKET, PART_SIZE, SECRET_KEY, S3Store, SeaweedS3, s3_server_fixture, seaweed  # noqa: F401

PROBLEM = "application/problem+json"
MIB = 1 << 20
SMALL = bytes(range(256)) * 40
#: Two and a half parts of 5 MiB: a three-part multipart upload.
LARGE = os.urandom(PART_SIZE * 5 // 2)


def _hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _problem(r: httpx.Response, status: int, slug: str) -> dict[str, Any]:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith(PROBLEM)
    doc: dict[str, Any] = r.json()
    assert doc["type"] == f"https://kvgraft.dev/problems/{slug}", doc
    assert doc["detail"] and doc["hint"]
    return doc


@pytest.fixture
def s3(s3_server: SeaweedS3) -> S3Store:
    """A prefix of its own in the shared bucket."""
    return s3_server.store()


@pytest.fixture
def served(tmp_path: Path, s3: S3Store) -> Iterator[tuple[Any, S3Store]]:
    """``kvgraft serve`` over a data directory whose blobs live in S3."""
    with running_server(tmp_path / "data", "--rate-limit", "0", *s3.flags()) as server:
        yield server, s3


def test_small_and_multipart_blobs_go_to_s3_and_come_back_whole_and_in_ranges(
    served: tuple[Any, S3Store], keys: dict[str, Key]
) -> None:
    server, s3 = served
    token, _ = make_token(server, "alice", keys["alice"])
    with httpx.Client(base_url=server.url, timeout=60) as client:
        for blob in (SMALL, LARGE):
            r = put_blob(client, token, blob)
            assert r.status_code == 201, r.text
            assert r.json() == {"digest": "sha256:" + _hex(blob), "size": len(blob), "created": True}
            assert s3.stored(_hex(blob)) == blob
            again = put_blob(client, token, blob)
            assert again.status_code == 200 and again.json()["created"] is False
        # Content-addressed keys, nothing else under the prefix, no upload left open.
        assert s3.keys() == sorted(f"blobs/sha256/{_hex(b)}" for b in (SMALL, LARGE))
        assert s3.uploads() == []
        assert not (server.data / "blobs" / "sha256").exists() or not any((server.data / "blobs" / "sha256").iterdir())
        # The large one went up as a multipart upload of 5 MiB parts (S3 marks the ETag with the count).
        head = s3.server.client().head_object(Bucket=BUCKET, Key=s3.key(_hex(LARGE)))
        assert head["ETag"].strip('"').endswith("-3")

        url = f"/v1/blobs/sha256:{_hex(LARGE)}"
        got = client.get(url)
        assert got.status_code == 200 and got.content == LARGE
        assert got.headers["etag"] == f'"sha256:{_hex(LARGE)}"'
        h = client.head(url)
        assert h.status_code == 200 and h.headers["content-length"] == str(len(LARGE))
        edge = PART_SIZE - 5
        r = client.get(url, headers={"Range": f"bytes={edge}-{edge + 9}"})
        assert r.status_code == 206 and r.content == LARGE[edge : edge + 10]
        assert r.headers["content-range"] == f"bytes {edge}-{edge + 9}/{len(LARGE)}"
        r = client.get(url, headers={"Range": "bytes=-100"})
        assert r.status_code == 206 and r.content == LARGE[-100:]
        r = client.get(url, headers={"Range": "bytes=0-4, 6000000-6000009"})
        assert r.status_code == 206 and r.headers["content-type"].startswith("multipart/byteranges")
        assert LARGE[:5] in r.content and LARGE[6000000:6000010] in r.content
        _problem(client.get(url, headers={"Range": f"bytes={len(LARGE)}-"}), 416, "range-not-satisfiable")

        # A publish checks the blobs it names in S3.
        art = artifact("held in s3")
        missing = post_entry(client, token, keys["alice"].sign(art.statement))
        assert _problem(missing, 409, "missing-blobs")["missing"] == [art.digest]
        assert put_blob(client, token, art.tensors).status_code == 201
        assert post_entry(client, token, keys["alice"].sign(art.statement)).status_code == 201


@pytest.mark.parametrize("blob", [SMALL, LARGE], ids=["small", "multipart"])
def test_bytes_that_do_not_match_their_digest_leave_nothing_in_s3(served: tuple[Any, S3Store], keys: dict[str, Key], blob: bytes) -> None:
    server, s3 = served
    token, _ = make_token(server, "alice", keys["alice"])
    wrong = blob[:-1] + bytes([blob[-1] ^ 1])
    with httpx.Client(base_url=server.url, timeout=60) as client:
        r = client.put(f"/v1/blobs/sha256:{_hex(blob)}", content=wrong, headers={"Authorization": f"Bearer {token}"})
        doc = _problem(r, 400, "digest-mismatch")
        assert doc["actual"] == "sha256:" + _hex(wrong) and doc["size"] == len(blob)
        assert "nothing was stored" in doc["hint"]
        assert s3.stored(_hex(blob)) is None
        assert s3.keys() == [] and s3.uploads() == []
        _problem(client.get(f"/v1/blobs/sha256:{_hex(blob)}"), 404, "blob-not-found")


def test_rot_in_s3_is_quarantined_by_reads_and_by_fsck_until_a_reupload_repairs_it(
    tmp_path: Path, s3: S3Store, keys: dict[str, Key]
) -> None:
    data = tmp_path / "data"
    small, large = artifact("rots when read"), artifact("rots at rest")
    large_tensors = large.tensors + os.urandom(PART_SIZE)  # a large blob: hashed while it streams
    with running_server(data, "--rate-limit", "0", *s3.flags()) as server:
        token, _ = make_token(server, "alice", keys["alice"])
        with httpx.Client(base_url=server.url, timeout=60) as client:
            for tensors in (small.tensors, large_tensors):
                assert put_blob(client, token, tensors).status_code == 201
            assert post_entry(client, token, keys["alice"].sign(small.statement)).status_code == 201
            # The object changes behind the registry's back: a small blob is re-hashed before it is served.
            s3.put_raw(small.digest[7:], small.tensors[:-1] + b"\x00")
            doc = _problem(client.get(f"/v1/blobs/{small.digest}"), 404, "blob-quarantined")
            assert small.digest in doc["detail"] and "upload the right bytes" in doc["hint"]
            assert s3.stored(small.digest[7:]) is None
            assert [k.split(".")[0] for k in s3.keys() if k.startswith("blobs/quarantine/")] == [f"blobs/quarantine/{small.digest[7:]}"]
            # A large one is cut short before its last chunk: never served whole under its ETag.
            hex_large = _hex(large_tensors)
            s3.put_raw(hex_large, large_tensors[:-1] + b"\x00")
            conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
            try:
                conn.request("GET", f"/v1/blobs/sha256:{hex_large}")
                answer = conn.getresponse()
                assert answer.status == 200 and answer.getheader("content-length") == str(len(large_tensors))
                with pytest.raises(http.client.IncompleteRead) as cut:
                    answer.read()
                assert len(cut.value.partial) < len(large_tensors)
            finally:
                conn.close()
            assert s3.stored(hex_large) is None
            assert "quarantined while being served" in server.log()
            # A re-upload repairs.
            assert put_blob(client, token, small.tensors).status_code == 201
            assert client.get(f"/v1/blobs/{small.digest}").content == small.tensors
            assert put_blob(client, token, large_tensors).status_code == 201

    # At rest, with the server stopped: fsck over S3 finds it, quarantines it, names the entry.
    s3.put_raw(small.digest[7:], b"rot" + small.tensors[3:])
    done = registry_cli("--json", "fsck", "--data", data, *s3.flags(), timeout=120)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "Traceback" not in done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    names = {(d["kind"], d["name"]) for d in report["damaged"]}
    assert ("blob", f"blob {small.digest}") in names and ("entry", "entry 0") in names
    assert report["quarantined"][0].startswith(f"quarantine/{small.digest[7:]}.")
    assert len(report["blobs"]["previously_quarantined"]) == 2  # the two reads' quarantines
    assert report["blobs"]["checked"] == 2
    assert f"blob {small.digest}" in done.stderr and "hint:" in done.stderr
    assert s3.stored(small.digest[7:]) is None
    again = registry_cli("--json", "fsck", "--data", data, *s3.flags(), timeout=120)
    assert again.returncode == 1 and "which is quarantined" in again.stdout

    with running_server(data, "--rate-limit", "0", *s3.flags()) as server:
        token, _ = make_token(server, "alice", keys["alice"])
        with httpx.Client(base_url=server.url, timeout=60) as client:
            assert put_blob(client, token, small.tensors).status_code == 201
    clean = registry_cli("--json", "fsck", "--data", data, *s3.flags(), timeout=120)
    assert clean.returncode == 0, clean.stdout + clean.stderr
    assert json.loads(clean.stdout)["blobs"]["checked"] == 2


def test_a_store_that_stops_answering_is_503_never_500(tmp_path: Path, keys: dict[str, Key]) -> None:
    with seaweed(tmp_path / "seaweed") as own:
        s3 = own.store()
        flags = [*s3.flags(), "--s3-max-attempts", "1", "--s3-timeout", "3"]
        with running_server(tmp_path / "data", "--rate-limit", "0", "--verify-on-read-bytes", "0", *flags) as server:
            token, _ = make_token(server, "alice", keys["alice"])
            with httpx.Client(base_url=server.url, timeout=60) as client:
                assert put_blob(client, token, SMALL).status_code == 201
                own.stop()
                url = f"/v1/blobs/sha256:{_hex(SMALL)}"
                for r in (
                    put_blob(client, token, SMALL + b"more"),
                    client.get(url),
                    client.head(url),
                    post_entry(client, token, keys["alice"].sign(artifact("store down").statement)),
                ):
                    assert r.status_code == 503, r.text
                    if r.request.method != "HEAD":
                        doc = _problem(r, 503, "storage-unavailable")
                        assert "S3 blob store did not answer" in doc["detail"]
                        assert "S3 blob store" in doc["hint"]
                        assert str(own.port) not in r.text and "127.0.0.1" not in r.text
                # The server is still up and says so for what needs no blob.
                assert client.get("/v1/log/checkpoint").status_code == 200


def test_a_full_store_is_a_storage_problem_never_500(tmp_path: Path, keys: dict[str, Key]) -> None:
    # SeaweedFS on a 96 MiB tmpfs: its one volume fills, and it answers 500 InternalError.
    with tmpfs(tmp_path / "disk", "96m") as disk, seaweed(disk / "seaweed") as own:
        s3 = own.store()
        flags = [*s3.flags(), "--s3-max-attempts", "1"]
        with running_server(tmp_path / "data", "--rate-limit", "0", *flags) as server:
            token, _ = make_token(server, "alice", keys["alice"])
            with httpx.Client(base_url=server.url, timeout=120) as client:
                statuses = []
                for _ in range(40):
                    r = put_blob(client, token, os.urandom(4 * 1024 * 1024))
                    statuses.append(r.status_code)
                    if r.status_code != 201:
                        break
                assert statuses[0] == 201 and statuses[-1] in (503, 507), statuses
                doc = _problem(r, statuses[-1], "storage-unavailable" if statuses[-1] == 503 else "insufficient-storage")
                assert "S3 blob store" in doc["detail"] and "S3 blob store" in doc["hint"]
                assert s3.uploads() == []


def test_s3_failures_map_to_503_and_507_without_naming_the_store() -> None:
    from botocore.exceptions import ClientError, EndpointConnectionError, ReadTimeoutError

    def client_error(code: str, status: int) -> ClientError:
        return ClientError({"Error": {"Code": code, "Message": "m"}, "ResponseMetadata": {"HTTPStatusCode": status}}, "PutObject")

    full = s3_error(client_error("XMinioStorageFull", 507), "the blob could not be stored")
    assert (full.status_code, full.slug) == (507, "insufficient-storage")
    assert full.message == "the blob could not be stored: the registry's S3 blob store is full (XMinioStorageFull)"
    assert s3_error(client_error("QuotaExceeded", 403), "x").status_code == 507
    denied = s3_error(client_error("AccessDenied", 403), "the blob could not be read")
    assert (denied.status_code, denied.slug) == (503, "storage-unavailable") and "refused its credentials" in denied.message
    assert s3_error(client_error("SlowDown", 503), "x").message == "x: the registry's S3 blob store answered 503 SlowDown"
    assert s3_error(client_error("InternalError", 500), "x").status_code == 503
    assert "--no-s3-server-checksum" in (s3_error(client_error("NotImplemented", 501), "x").hint or "")
    down = s3_error(EndpointConnectionError(endpoint_url="http://10.1.2.3:9000/b"), "the blob could not be read")
    assert down.status_code == 503 and "10.1.2.3" not in down.message and "did not answer (EndpointConnectionError)" in down.message
    slow = s3_error(ReadTimeoutError(endpoint_url="http://10.1.2.3:9000/b"), "x")
    assert slow.status_code == 503 and "10.1.2.3" not in slow.message


def test_serve_refuses_a_missing_bucket_and_wrong_credentials_in_one_line(tmp_path: Path, s3: S3Store) -> None:
    base = ["serve", "--data", tmp_path / "data", "--init", "--port", str(free_port())]
    nobucket = registry_cli(*base, *s3.flags()[2:], "--blob-store", f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}/p")
    assert nobucket.returncode == 1 and "Traceback" not in nobucket.stderr
    assert "cannot be used: the bucket does not exist" in nobucket.stderr and "create the bucket" in nobucket.stderr
    wrong = tmp_path / "wrong-secret"
    wrong.write_text("not-the-secret\n")
    flags = s3.flags()
    flags[flags.index("--s3-secret-access-key-file") + 1] = str(wrong)
    refused = registry_cli(*base, *flags)
    assert refused.returncode == 1 and "Traceback" not in refused.stderr
    assert "refused the credentials" in refused.stderr and "--s3-secret-access-key-file" in refused.stderr
    bad = registry_cli(*base, "--blob-store", "s3://Bad_Bucket/x")
    assert bad.returncode == 1 and "is not an S3 bucket name" in bad.stderr and "hint:" in bad.stderr
    small = registry_cli(*base, *s3.flags(), "--s3-part-size", "1000")
    assert small.returncode == 1 and "part_size must be an int from 5242880" in small.stderr
    half = registry_cli(*base, "--blob-store", s3.url, "--s3-access-key-id", ACCESS_KEY)
    assert half.returncode == 1 and "go together" in half.stderr


def test_credentials_and_endpoint_from_the_aws_environment_and_uploads_of_others_left_alone(
    tmp_path: Path, s3: S3Store, keys: dict[str, Key], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Another server process's multipart upload in progress: a start must not abort it.
    client = s3.server.client()
    other = client.create_multipart_upload(Bucket=BUCKET, Key=s3.key("0" * 64))
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3.server.endpoint)
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    with running_server(tmp_path / "data", "--rate-limit", "0", "--blob-store", s3.url) as server:
        token, _ = make_token(server, "alice", keys["alice"])
        with httpx.Client(base_url=server.url, timeout=60) as http:
            assert put_blob(http, token, SMALL).status_code == 201
    assert s3.stored(_hex(SMALL)) == SMALL
    assert s3.uploads() == [s3.key("0" * 64)]
    client.abort_multipart_upload(Bucket=BUCKET, Key=s3.key("0" * 64), UploadId=other["UploadId"])


def test_a_server_started_on_another_blob_store_than_the_logs_served_every_blob_404(
    tmp_path: Path, s3: S3Store, keys: dict[str, Key]
) -> None:
    """Started without --blob-store on a data directory whose blobs are on S3 (or the reverse), a
    server used to start and answer every stored blob 404. The first start records the store in
    the database; another is refused in one line naming both, until --blob-store-moved."""
    data = tmp_path / "data"
    art = artifact("on s3")
    with running_server(data, "--rate-limit", "0", *s3.flags()) as server:
        token, _ = make_token(server, "alice", keys["alice"])
        auth = {"Authorization": f"Bearer {token}"}
        assert httpx.put(f"{server.url}/v1/blobs/{art.digest}", content=art.tensors, headers=auth, timeout=30).status_code == 201
    base = ["serve", "--data", data, "--port", str(free_port())]
    local = registry_cli(*base)
    assert local.returncode == 1 and "Traceback" not in local.stderr
    assert f"this log's blobs are in {s3.url}, but this command was given the data directory's blobs/" in local.stderr
    assert f"pass --blob-store {s3.url}" in local.stderr and "--blob-store-moved" in local.stderr
    fsck = registry_cli("fsck", "--data", data)
    assert fsck.returncode == 1 and f"this log's blobs are in {s3.url}" in fsck.stderr and "Traceback" not in fsck.stderr
    # The operator copied the blob into the data directory: recorded once, then the usual start.
    (data / "blobs" / "sha256").mkdir(parents=True, exist_ok=True)
    (data / "blobs" / "sha256" / art.digest.removeprefix("sha256:")).write_bytes(art.tensors)
    for extra in (["--blob-store-moved"], []):
        with running_server(data, "--rate-limit", "0", *extra) as server:
            assert httpx.get(f"{server.url}/v1/blobs/{art.digest}", timeout=30).content == art.tensors
    back = registry_cli(*base, *s3.flags())
    assert back.returncode == 1 and f"this log's blobs are in the data directory's blobs/, but this command was given {s3.url}" in back.stderr
    assert "pass no --blob-store" in back.stderr


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for process {pid}")


def test_s3_regression_stalled_uploads_pinned_memory_without_a_cap(tmp_path: Path, s3: S3Store, keys: dict[str, Key]) -> None:
    # Was: each upload held up to one part (16 MiB by default) while its client stalled, with no
    # cap across uploads: 40 stalled uploads added 690 MiB. Now every upload reserves its buffer
    # from one budget before it reads a byte (here two 5 MiB parts); past it, 503 uploads-busy.
    import socket
    import threading
    import time

    budget = 2 * PART_SIZE
    data = tmp_path / "data"
    data.mkdir()
    with running_server(data, "--rate-limit", "0", *s3.flags(), "--s3-memory-budget", str(budget)) as server:
        token, _ = make_token(server, "alice", keys["alice"])
        before = _rss_bytes(server.pid)
        stalled: list[socket.socket] = []
        lock = threading.Lock()

        def stall(n: int) -> None:
            # A large upload that sends just under one part, then stops sending and waits.
            blob_hex = hashlib.sha256(b"stalled %d" % n).hexdigest()
            sock = socket.create_connection(("127.0.0.1", server.port), timeout=3)
            with lock:
                stalled.append(sock)
            sock.sendall(
                f"PUT /v1/blobs/sha256:{blob_hex} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {token}\r\n"
                f"Content-Length: {3 * PART_SIZE}\r\n\r\n".encode()
            )
            with contextlib.suppress(TimeoutError, OSError):
                sock.sendall(b"\0" * (PART_SIZE - 4096))

        threads = [threading.Thread(target=stall, args=(n,)) for n in range(40)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        try:
            time.sleep(1.0)
            grown = _rss_bytes(server.pid) - before
            # Two uploads' buffers, not forty (was about 40 x 5 MiB here).
            assert grown < 64 * MIB, f"the server grew by {grown / MIB:.0f} MiB for 40 stalled uploads"
            with httpx.Client(base_url=server.url, timeout=60) as client:
                start = time.monotonic()
                busy = put_blob(client, token, SMALL)
                doc = _problem(busy, 503, "uploads-busy")
                assert busy.headers["retry-after"] == "5" and doc["limit"] == budget
                assert "hold its whole upload memory budget" in doc["detail"]
                assert time.monotonic() - start < 15
        finally:
            for sock in stalled:
                sock.close()
        # The stalled uploads' reservations are given back: uploads go through again.
        with httpx.Client(base_url=server.url, timeout=60) as client:
            deadline = time.monotonic() + 30
            while (r := put_blob(client, token, SMALL)).status_code == 503 and time.monotonic() < deadline:
                time.sleep(0.2)
            assert r.status_code == 201, r.text
        assert s3.stored(_hex(SMALL)) == SMALL
        assert s3.keys() == [f"blobs/sha256/{_hex(SMALL)}"]
