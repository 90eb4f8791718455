"""Blob rot and a damaged database (issue 14, finding 9): detected, quarantined, repaired.

A real ``kvgraft serve`` on 127.0.0.1 stores blobs and entries; then bytes are changed on disk
the way a failing disk or a careless operator would. The server must not serve a changed blob
with its original ETag (small blobs are re-hashed before they are served, large ones while they
stream, cut short on a mismatch), ``kvgraft fsck`` must exit 1 naming each damaged thing and
move a bad blob to ``blobs/quarantine/``, and an upload of the right bytes must repair it.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import time
from pathlib import Path
from typing import Any

import duckdb
import httpx
import pytest

from kvgraft.schemas import sha256_bytes
from kvgraft.verifier import hash_leaf
from tests.registry.conftest import Key, artifact, blob_path, harness, registry_cli, running_server
from tests.reliability.servers import make_token, post_entry, put_blob

PROBLEM = "application/problem+json"
QUARANTINED = "https://kvgraft.dev/problems/blob-quarantined"


def _flip(path: Path, index: int = 0) -> None:
    """Change one byte of ``path`` in place, as rot on disk would."""
    with path.open("r+b") as f:
        f.seek(index)
        byte = f.read(1)
        f.seek(index)
        f.write(bytes([byte[0] ^ 0x01]))


def _quarantine(data: Path) -> list[str]:
    d = data / "blobs" / "quarantine"
    return sorted(p.name for p in d.iterdir()) if d.is_dir() else []


def _fsck(data: Path, *extra: str) -> tuple[int, dict[str, Any], str]:
    """``kvgraft --json fsck --data DATA``: (exit status, the JSON document, stderr)."""
    done = registry_cli("--json", "fsck", "--data", data, *extra, timeout=120)
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 1, (done.stdout, done.stderr)
    assert "Traceback" not in done.stderr, done.stderr
    return done.returncode, json.loads(lines[0]), done.stderr


def _publish(data: Path, key: Key, texts: list[str]) -> list[bytes]:
    """Start a server over ``data``, publish one artifact per text (blob first); return the tensors."""
    tensors = []
    with running_server(data, "--rate-limit", "0") as server:
        token, _ = make_token(server, "alice", key)
        with httpx.Client(base_url=server.url, timeout=30) as client:
            for text in texts:
                art = artifact(text)
                assert put_blob(client, token, art.tensors).status_code == 201
                r = post_entry(client, token, key.sign(art.statement))
                assert r.status_code == 201, r.text
                tensors.append(art.tensors)
    return tensors


def _assert_quarantined_problem(r: httpx.Response, digest: str) -> None:
    assert r.status_code == 404, r.text
    assert r.headers["content-type"].startswith(PROBLEM)
    assert r.headers.get("etag") != f'"{digest}"'
    doc = r.json()
    assert doc["type"] == QUARANTINED
    assert "quarantined" in doc["detail"] and digest in doc["detail"]
    assert "upload the right bytes" in doc["hint"]
    assert "/tmp" not in r.text and str(Path.home()) not in r.text


# --- the server ------------------------------------------------------------------------------


def test_blob_with_one_flipped_byte_is_not_served_with_its_original_etag(tmp_path: Path, rkeys: dict[str, Key]) -> None:
    data = tmp_path / "data"
    blob = bytes(range(256)) * 40
    digest = sha256_bytes(blob)
    with running_server(data, "--rate-limit", "0") as server:
        token, _ = make_token(server, "alice", rkeys["alice"])
        with httpx.Client(base_url=server.url, timeout=30) as client:
            assert put_blob(client, token, blob).status_code == 201
            good = client.get(f"/v1/blobs/{digest}")
            assert good.status_code == 200 and good.headers["etag"] == f'"{digest}"'
            _flip(blob_path(data, blob), 5000)

            _assert_quarantined_problem(client.get(f"/v1/blobs/{digest}"), digest)
            assert [n.split(".")[0] for n in _quarantine(data)] == [digest.removeprefix("sha256:")]
            assert not blob_path(data, blob).exists()
            # Every way of reading it now says so: HEAD, a range, a conditional GET.
            head = client.head(f"/v1/blobs/{digest}")
            assert head.status_code == 404 and head.headers.get("etag") != f'"{digest}"'
            _assert_quarantined_problem(client.get(f"/v1/blobs/{digest}", headers={"Range": "bytes=0-9"}), digest)

            # An upload of the right bytes repairs it.
            again = put_blob(client, token, blob)
            assert again.status_code == 201 and again.json()["created"] is True
            back = client.get(f"/v1/blobs/{digest}")
            assert back.status_code == 200 and back.content == blob and back.headers["etag"] == f'"{digest}"'
        assert "Traceback" not in server.log()
        assert "is damaged" in server.log()


def test_range_of_a_small_rotten_blob_is_refused_not_served_from_the_changed_bytes(
    tmp_path: Path, rkeys: dict[str, Key]
) -> None:
    data = tmp_path / "data"
    blob = b"range-me" * 1000
    digest = sha256_bytes(blob)
    with running_server(data, "--rate-limit", "0") as server:
        token, _ = make_token(server, "alice", rkeys["alice"])
        with httpx.Client(base_url=server.url, timeout=30) as client:
            assert put_blob(client, token, blob).status_code == 201
            _flip(blob_path(data, blob), 3)
            _assert_quarantined_problem(client.get(f"/v1/blobs/{digest}", headers={"Range": "bytes=0-15"}), digest)


def test_large_blob_with_one_flipped_byte_is_cut_short_never_served_whole_with_its_etag(
    tmp_path: Path, rkeys: dict[str, Key]
) -> None:
    # Larger than verify_on_read_bytes (1 MiB) and than two 4 MiB read chunks: hashed while it streams.
    data = tmp_path / "data"
    blob = hashlib.sha256(b"large").digest() * (9 * 1024 * 1024 // 32)
    digest = sha256_bytes(blob)
    with running_server(data, "--rate-limit", "0") as server:
        token, _ = make_token(server, "alice", rkeys["alice"])
        with httpx.Client(base_url=server.url, timeout=60) as client:
            assert put_blob(client, token, blob).status_code == 201
        _flip(blob_path(data, blob), len(blob) - 10)

        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
        try:
            conn.request("GET", f"/v1/blobs/{digest}")
            r = conn.getresponse()
            # The headers went out before the last byte was read; the body must not complete.
            assert r.status == 200 and r.getheader("content-length") == str(len(blob))
            with pytest.raises(http.client.IncompleteRead) as got:
                r.read()
            assert len(got.value.partial) < len(blob)
        finally:
            conn.close()

        with httpx.Client(base_url=server.url, timeout=60) as client:
            _assert_quarantined_problem(client.get(f"/v1/blobs/{digest}"), digest)
        assert "quarantined while being served" in server.log()


def test_reupload_of_an_existing_digest_rechecks_the_stored_file_and_repairs_it(
    tmp_path: Path, rkeys: dict[str, Key]
) -> None:
    # 2 MiB: above verify_on_read_bytes, so nothing re-hashes it before the upload does.
    data = tmp_path / "data"
    blob = hashlib.sha256(b"repair").digest() * (2 * 1024 * 1024 // 32)
    with running_server(data, "--rate-limit", "0") as server:
        token, _ = make_token(server, "alice", rkeys["alice"])
        with httpx.Client(base_url=server.url, timeout=60) as client:
            assert put_blob(client, token, blob).status_code == 201
            assert put_blob(client, token, blob).status_code == 200  # intact: kept, not rewritten
            assert _quarantine(data) == []
            _flip(blob_path(data, blob), 1234)
            again = put_blob(client, token, blob)
            assert again.status_code == 201 and again.json()["created"] is True
            assert blob_path(data, blob).read_bytes() == blob
            assert len(_quarantine(data)) == 1
            # Wrong bytes for it are still refused and leave the repaired blob alone.
            wrong = client.put(
                f"/v1/blobs/{sha256_bytes(blob)}", content=b"x" * 10, headers={"Authorization": f"Bearer {token}"}
            )
            assert wrong.status_code == 400 and blob_path(data, blob).read_bytes() == blob


def test_background_scrub_quarantines_a_flipped_blob_nobody_asked_for(tmp_path: Path, rkeys: dict[str, Key]) -> None:
    data = tmp_path / "data"
    blob = b"scrub-me" * 4096
    with harness(data, rkeys, scrub_interval=0.2) as h:
        scrubber = h.client.app.state.registry.scrubber
        assert scrubber is not None
        assert h.put_blob(blob).status_code == 201
        _flip(blob_path(data, blob), 100)
        deadline = time.monotonic() + 20
        while not _quarantine(data) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [n.split(".")[0] for n in _quarantine(data)] == [hashlib.sha256(blob).hexdigest()]
        r = h.client.get(f"/v1/blobs/{sha256_bytes(blob)}")
        assert r.status_code == 404 and r.json()["type"] == QUARANTINED
        assert scrubber.passes >= 1
    # The lifespan stopped and joined the scrub thread at shutdown.
    assert not scrubber._thread.is_alive()


# --- kvgraft fsck ----------------------------------------------------------------------------


def test_fsck_on_an_intact_registry_exits_0_with_a_summary(tmp_path: Path, rkeys: dict[str, Key]) -> None:
    data = tmp_path / "data"
    _publish(data, rkeys["alice"], ["one", "two", "three"])
    code, doc, _ = _fsck(data)
    assert code == 0, doc
    assert doc["ok"] is True and doc["clean"] is True and doc["damaged"] == []
    assert doc["blobs"]["checked"] == 3 and doc["entries"]["checked"] == 3
    assert doc["log"]["tree_size"] == 3 and doc["log"]["checkpoints_checked"] == 4
    assert "no damage found" in doc["summary"]


def test_fsck_names_a_flipped_blob_exits_1_and_quarantines_it_until_a_reupload_repairs_it(
    tmp_path: Path, rkeys: dict[str, Key]
) -> None:
    data = tmp_path / "data"
    first, second = _publish(data, rkeys["alice"], ["alpha", "beta"])
    hex_digest = hashlib.sha256(second).hexdigest()
    _flip(blob_path(data, second), 7)

    code, doc, err = _fsck(data)
    assert code == 1
    assert doc["ok"] is False and doc["clean"] is False
    names = {(d["kind"], d["name"]) for d in doc["damaged"]}
    assert ("blob", f"blob sha256:{hex_digest}") in names
    assert ("entry", "entry 1") in names  # the artifact whose tensors they are
    assert f"blob sha256:{hex_digest}" in doc["message"] and "quarantined" in doc["message"]
    assert f"blob sha256:{hex_digest}" in err and "hint:" in err
    assert doc["quarantined"] and doc["quarantined"][0].startswith(f"quarantine/{hex_digest}.")
    assert not blob_path(data, second).exists() and blob_path(data, first).exists()

    # Still damaged (the entry's blob is gone) until the right bytes come back.
    code, doc, _ = _fsck(data)
    assert code == 1 and any("quarantined" in d["detail"] for d in doc["damaged"])

    with running_server(data, "--rate-limit", "0") as server:
        token, _ = make_token(server, "alice", rkeys["alice"])
        with httpx.Client(base_url=server.url, timeout=30) as client:
            _assert_quarantined_problem(client.get(f"/v1/blobs/sha256:{hex_digest}"), f"sha256:{hex_digest}")
            assert put_blob(client, token, second).status_code == 201
            back = client.get(f"/v1/blobs/sha256:{hex_digest}")
            assert back.status_code == 200 and back.content == second
    code, doc, _ = _fsck(data)
    assert code == 0, doc


def test_fsck_no_quarantine_reports_a_damaged_blob_and_leaves_it(tmp_path: Path, rkeys: dict[str, Key]) -> None:
    data = tmp_path / "data"
    (tensors,) = _publish(data, rkeys["alice"], ["gamma"])
    _flip(blob_path(data, tensors), 0)
    code, doc, _ = _fsck(data, "--no-quarantine")
    assert code == 1 and doc["quarantined"] == []
    assert blob_path(data, tensors).exists() and _quarantine(data) == []
    # Without --json: every damaged thing on stdout, one line on stderr, exit 1.
    text = registry_cli("fsck", "--data", data, "--no-quarantine", timeout=120)
    assert text.returncode == 1
    assert f"DAMAGED blob {sha256_bytes(tensors)}" in text.stdout and "DAMAGED entry 0" in text.stdout
    assert text.stderr.count("\n") == 1 and "Traceback" not in text.stderr


def test_fsck_while_the_server_runs_refuses_with_a_hint(tmp_path: Path, rkeys: dict[str, Key]) -> None:
    data = tmp_path / "data"
    with running_server(data) as server:
        code, doc, err = _fsck(data)
        assert code == 1 and doc["ok"] is False
        assert f"in use by process {server.pid}" in doc["message"]
        assert "stop the server" in doc["message"] and "--scrub-interval" in doc["message"]
        assert err.count("\n") == 1


def test_fsck_of_a_directory_without_a_registry_is_a_one_line_error(tmp_path: Path) -> None:
    code, doc, err = _fsck(tmp_path / "nothing-here")
    assert code == 1 and "holds no registry database" in doc["message"] and err.count("\n") == 1


def _rewrite(data: Path, sql: str, params: list[Any]) -> None:
    conn = duckdb.connect(str(data / "registry.duckdb"))
    try:
        conn.execute(sql, params)
    finally:
        conn.close()


def _envelope(data: Path, index: int) -> bytes:
    conn = duckdb.connect(str(data / "registry.duckdb"), read_only=True)
    try:
        row = conn.execute("SELECT envelope FROM entries WHERE log_index = ?", [index]).fetchone()
    finally:
        conn.close()
    assert row is not None
    return bytes(row[0])


def test_fsck_detects_a_corrupt_entry_envelope(tmp_path: Path, rkeys: dict[str, Key]) -> None:
    data = tmp_path / "data"
    _publish(data, rkeys["alice"], ["one", "two", "three"])
    envelope = _envelope(data, 1)
    i = envelope.index(b'"payload"') + 20
    rotten = envelope[:i] + bytes([envelope[i] ^ 0x01]) + envelope[i + 1 :]
    _rewrite(data, "UPDATE entries SET envelope = ? WHERE log_index = 1", [rotten])

    code, doc, _ = _fsck(data)
    assert code == 1
    details = {(d["name"], d["detail"]) for d in doc["damaged"]}
    assert any(n == "entry 1" and "not its recorded digest" in t for n, t in details), details
    assert any(n == "entry 1" and "leaf hash" in t for n, t in details), details
    # Every checkpoint from size 2 on covered the original leaf.
    assert {n for n, t in details if n.startswith("checkpoint")} == {"checkpoint 2", "checkpoint 3"}
    assert "entry 1" in doc["message"]


def test_fsck_detects_a_rewritten_log_leaf(tmp_path: Path, rkeys: dict[str, Key]) -> None:
    data = tmp_path / "data"
    _publish(data, rkeys["alice"], ["one", "two"])
    _rewrite(data, "UPDATE entries SET leaf_hash = ? WHERE log_index = 0", [hash_leaf(b"something else")])
    code, doc, _ = _fsck(data)
    assert code == 1
    assert [(d["name"], d["detail"]) for d in doc["damaged"]] == [
        ("entry 0", "its stored leaf hash is not the RFC 9162 leaf hash of its envelope")
    ]


def test_fsck_detects_an_entry_rewritten_consistently_by_its_signed_checkpoints(
    tmp_path: Path, rkeys: dict[str, Key]
) -> None:
    # Envelope, digest and leaf hash changed together, as someone hiding the change would: only
    # the roots signed before the change can tell.
    data = tmp_path / "data"
    _publish(data, rkeys["alice"], ["one", "two"])
    other = rkeys["alice"].sign(artifact("forged").statement)
    _rewrite(
        data,
        "UPDATE entries SET envelope = ?, digest = ?, leaf_hash = ? WHERE log_index = 1",
        [other, sha256_bytes(other), hash_leaf(other)],
    )
    code, doc, _ = _fsck(data)
    assert code == 1
    names = {d["name"] for d in doc["damaged"]}
    assert "checkpoint 2" in names
    assert any("subjects" in d["detail"] and d["name"] == "entry 1" for d in doc["damaged"])


def test_fsck_detects_a_database_rolled_back_behind_its_signed_head(tmp_path: Path, rkeys: dict[str, Key]) -> None:
    # As a lost WAL would leave it: the last entry and its checkpoint gone from the database,
    # while signed-head.json still holds the tree head signed for them.
    data = tmp_path / "data"
    _publish(data, rkeys["alice"], ["one", "two", "three"])
    assert (data / "signed-head.json").is_file()
    _rewrite(data, "DELETE FROM entries WHERE log_index = 2", [])
    _rewrite(data, "DELETE FROM checkpoints WHERE tree_size = 3", [])
    _rewrite(data, "DELETE FROM entry_subjects WHERE log_index = 2", [])
    code, doc, _ = _fsck(data)
    assert code == 1
    assert [(d["name"], d["detail"]) for d in doc["damaged"]] == [
        ("log", "the database holds 2 entries, behind the tree head signed at size 3 (signed-head.json): rolled back")
    ]
