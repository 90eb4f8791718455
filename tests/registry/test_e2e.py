"""End to end: the real server (``kvgraft serve``) in a subprocess on 127.0.0.1, bounded, always stopped.

Publish, list, fetch, verify the log evidence with kvgraft.verifier and ``kvgraft-verify log``,
admin commands against the running server, restart, and check that everything is still there
and that the new log provably extends the old one.
"""

from __future__ import annotations

import hashlib
import json
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvgraft.schemas import sha256_bytes
from kvgraft.verifier.cli import main as verify_main

from .conftest import Key, artifact, blob_path, exactness_record, leftovers, registry_cli, running_server, tampered


def _token(data: Path, publisher: str, key: Key) -> dict[str, Any]:
    r = registry_cli("--json", "token", "create", "--data", data, "--publisher", publisher, "--key", key.pub_path)
    assert r.returncode == 0, r.stderr
    return dict(json.loads(r.stdout))


def _publish(client: httpx.Client, token: str, tensors: bytes, envelope: bytes) -> httpx.Response:
    auth = {"Authorization": f"Bearer {token}"}
    put = client.put(f"/v1/blobs/{sha256_bytes(tensors)}", content=tensors, headers=auth)
    assert put.status_code in (200, 201), put.text
    return client.post("/v1/entries", content=envelope, headers=auth)


def _verify_log(capsys: pytest.CaptureFixture[str], *argv: str | Path) -> tuple[int, str]:
    code = verify_main(["log", *map(str, argv)])
    out, err = capsys.readouterr()
    return code, out + err


def _save(directory: Path, name: str, data: bytes | str | dict[str, Any]) -> Path:
    path = directory / name
    if isinstance(data, dict):
        data = json.dumps(data)
    path.write_bytes(data if isinstance(data, bytes) else data.encode())
    return path


def test_publish_verify_restart(tmp_path: Path, keys: dict[str, Key], capsys: pytest.CaptureFixture[str]) -> None:
    data = tmp_path / "data"
    files = tmp_path / "files"
    files.mkdir()
    alice, bob = keys["alice"], keys["bob"]
    root = artifact("Natalia sold clips to 48 of her friends in April")
    child = artifact("and then she sold half as many clips in May", parent=root)
    logits = b"\x01\x02\x03\x04" * 256

    with running_server(data) as server, httpx.Client(base_url=server.url, timeout=30) as client:
        alice_token = _token(data, "alice", alice)
        assert alice_token["via"] == "server"
        bob_token = _token(data, "bob", bob)

        for art in (root, child):
            r = _publish(client, alice_token["token"], art.tensors, alice.sign(art.statement))
            assert r.status_code == 201, r.text
        r = client.put(f"/v1/blobs/sha256:{hashlib.sha256(logits).hexdigest()}", content=logits,
                       headers={"Authorization": f"Bearer {alice_token['token']}"})
        assert r.status_code == 201
        record = alice.sign(exactness_record(child, logits))
        r = client.post("/v1/entries", content=record, headers={"Authorization": f"Bearer {alice_token['token']}"})
        assert r.status_code == 201 and r.json()["entry"]["log_index"] == 2

        listing = client.get("/v1/artifacts").json()
        assert [i["digest"] for i in listing["items"]] == [root.digest, child.digest]
        detail = client.get(f"/v1/artifacts/{child.digest}").json()
        assert [p["digest"] for p in detail["lineage"]["parents"]] == [root.digest]
        assert [r["kind"] for r in client.get("/v1/records", params={"artifact": child.digest}).json()["items"]] == ["exactness"]
        assert client.get(f"/v1/blobs/{child.digest}").content == child.tensors

        # The log evidence, checked offline by kvgraft-verify.
        key_pem = _save(files, "registry.pub", client.get("/v1/log/key").json()["public_key_pem"])
        checkpoint = client.get("/v1/log/checkpoint").content
        old_checkpoint = _save(files, "checkpoint-3", checkpoint)
        envelope = client.get(detail["entry"]["envelope_url"]).content
        entry_file = _save(files, "child.dsse.json", envelope)
        proof_file = _save(files, "inclusion.json", detail["inclusion_proof"])
        code, out = _verify_log(capsys, "--checkpoint", old_checkpoint, "--registry-key", key_pem, "--inclusion", proof_file, entry_file)
        assert code == 0, out
        assert "is leaf 1" in out
        # The installed command, once, in its own process.
        cli = subprocess.run(
            [str(Path(sys.executable).parent / "kvgraft-verify"), "log", "--checkpoint", str(old_checkpoint),
             "--registry-key", str(key_pem), "--inclusion", str(proof_file), str(entry_file)],
            capture_output=True, text=True, timeout=60,
        )
        assert cli.returncode == 0, cli.stderr
        # Altered evidence is rejected.
        bad = dict(detail["inclusion_proof"])
        bad["hashes"] = [("0" if h[0] != "0" else "1") + h[1:] for h in bad["hashes"]]
        code, out = _verify_log(capsys, "--checkpoint", old_checkpoint, "--registry-key", key_pem, "--inclusion",
                                _save(files, "bad.json", bad), entry_file)
        assert code == 1 and "LogProofError" in out
        code, out = _verify_log(capsys, "--checkpoint", old_checkpoint, "--registry-key", key_pem, "--inclusion",
                                proof_file, _save(files, "edited.dsse.json", envelope.replace(b"\n", b" ")))
        assert code == 1 and "not the expected" in out

        # A revocation through the running server applies to the very next request.
        art = artifact("bob's first")
        assert _publish(client, bob_token["token"], art.tensors, bob.sign(art.statement)).status_code == 201
        revoke = registry_cli("token", "revoke", "--data", data, bob_token["token_id"])
        assert revoke.returncode == 0 and "from the server's next request on" in revoke.stdout
        art = artifact("bob's second")
        r = client.post("/v1/entries", content=bob.sign(art.statement), headers={"Authorization": f"Bearer {bob_token['token']}"})
        assert r.status_code == 403 and "was revoked" in r.json()["detail"]
        # Nor may alice publish with bob's key, nor anyone without a token.
        r = client.post("/v1/entries", content=bob.sign(art.statement), headers={"Authorization": f"Bearer {alice_token['token']}"})
        assert r.status_code == 403 and r.json()["type"].endswith("/key-not-bound")
        assert client.post("/v1/entries", content=alice.sign(art.statement)).status_code == 401

        # Refused input leaves nothing behind.
        r = client.put(f"/v1/blobs/{art.digest}", content=b"not these bytes", headers={"Authorization": f"Bearer {alice_token['token']}"})
        assert r.status_code == 400 and "have digest" in r.json()["detail"]
        assert not blob_path(data, art.tensors).exists() and leftovers(data) == []
        assert client.put(f"/v1/blobs/{art.digest}", content=art.tensors,
                          headers={"Authorization": f"Bearer {alice_token['token']}"}).status_code == 201
        r = client.post("/v1/entries", content=tampered(alice.sign(art.statement)),
                        headers={"Authorization": f"Bearer {alice_token['token']}"})
        assert r.status_code == 422 and "altered after signing" in r.json()["detail"], r.text
        assert int(client.get("/v1/log/checkpoint").text.split("\n")[1]) == 4

        # Raw dot segments (no client normalisation) never reach the file system.
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
            s.sendall(b"GET /v1/blobs/sha256:aa/../../registry.duckdb HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
            raw = b""
            while chunk := s.recv(65536):
                raw += chunk
        assert raw.startswith(b"HTTP/1.1 400"), raw[:200]

        before = {
            "artifacts": client.get("/v1/artifacts").json(),
            "entries": client.get("/v1/entries").json(),
            "checkpoint": client.get("/v1/log/checkpoint").content,
            "envelope": client.get("/v1/entries/1/envelope").content,
        }
        assert (data / "admin.json").exists()
    # uvicorn shuts down gracefully on SIGTERM, then re-raises it (exit status -15); the lifespan
    # ran its shutdown: admin.json is gone.
    assert server.proc.returncode in (0, -15), server.log()
    assert not (data / "admin.json").exists()

    # With the server stopped, admin commands open the database themselves.
    listed = registry_cli("--json", "token", "list", "--data", data)
    out = json.loads(listed.stdout)
    assert out["via"] == "database"
    assert {t["token_id"]: t["revoked"] for t in out["tokens"]} == {alice_token["token_id"]: False, bob_token["token_id"]: True}

    with running_server(data) as server, httpx.Client(base_url=server.url, timeout=30) as client:
        assert client.get("/v1/artifacts").json() == before["artifacts"]
        assert client.get("/v1/entries").json() == before["entries"]
        assert client.get("/v1/log/checkpoint").content == before["checkpoint"]
        assert client.get("/v1/entries/1/envelope").content == before["envelope"] == envelope
        assert client.get(f"/v1/blobs/{root.digest}").content == root.tensors
        art = artifact("bob's third")
        r = client.post("/v1/entries", content=bob.sign(art.statement), headers={"Authorization": f"Bearer {bob_token['token']}"})
        assert r.status_code == 403

        after = artifact("after the restart", parent=child)
        r = _publish(client, alice_token["token"], after.tensors, alice.sign(after.statement))
        assert r.status_code == 201 and r.json()["entry"]["log_index"] == 4
        new_checkpoint = _save(files, "checkpoint-5", client.get("/v1/log/checkpoint").content)
        consistency = _save(files, "consistency.json", client.get("/v1/log/proof/consistency", params={"old": 3}).json())
        code, out = _verify_log(capsys, "--checkpoint", new_checkpoint, "--registry-key", key_pem, "--consistency", consistency, old_checkpoint)
        assert code == 0, out
        assert "it extends the checkpoint at size 3" in out
        # The old inclusion proof still holds against the old checkpoint; a fresh one against the new.
        code, out = _verify_log(capsys, "--checkpoint", old_checkpoint, "--registry-key", key_pem, "--inclusion", proof_file, entry_file)
        assert code == 0, out
        fresh = _save(files, "inclusion-5.json", client.get("/v1/log/proof/inclusion", params={"index": 1}).json())
        code, out = _verify_log(capsys, "--checkpoint", new_checkpoint, "--registry-key", key_pem, "--inclusion", fresh, entry_file)
        assert code == 0, out
        bad = json.loads(consistency.read_text())
        bad["hashes"][0] = "f" * 64
        code, out = _verify_log(capsys, "--checkpoint", new_checkpoint, "--registry-key", key_pem, "--consistency",
                                _save(files, "bad-consistency.json", bad), old_checkpoint)
        assert code == 1 and "LogProofError" in out


def test_concurrent_publishes_get_distinct_indices(tmp_path: Path, keys: dict[str, Key]) -> None:
    from kvgraft.verifier import parse_public_key
    from kvgraft.verifier._internal.tlog import hash_leaf, verify_checkpoint, verify_inclusion

    data = tmp_path / "data"
    alice = keys["alice"]
    arts = [artifact(f"concurrent {i}") for i in range(16)]
    envelopes = [alice.sign(a.statement) for a in arts]
    with running_server(data) as server, httpx.Client(base_url=server.url, timeout=60) as client:
        token = _token(data, "alice", alice)["token"]

        def publish(i: int) -> dict[str, Any]:
            with httpx.Client(base_url=server.url, timeout=60) as c:
                r = _publish(c, token, arts[i].tensors, envelopes[i])
                assert r.status_code == 201, r.text
                return dict(r.json())

        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(publish, range(len(arts))))
        assert sorted(r["entry"]["log_index"] for r in results) == list(range(16))
        key = client.get("/v1/log/key").json()
        public = parse_public_key(key["public_key_pem"].encode())
        head = verify_checkpoint(client.get("/v1/log/checkpoint").content, key["origin"], public)
        assert head.size == 16
        for envelope, result in zip(envelopes, results, strict=True):
            index = result["entry"]["log_index"]
            proof = client.get("/v1/log/proof/inclusion", params={"index": index}).json()
            verify_inclusion(hash_leaf(envelope), index, 16, [bytes.fromhex(h) for h in proof["hashes"]], head.root_hash)
            # Each response's own proof verifies against the checkpoint it came with.
            own = verify_checkpoint(result["checkpoint"].encode(), key["origin"], public)
            p = result["inclusion_proof"]
            verify_inclusion(hash_leaf(envelope), index, own.size, [bytes.fromhex(h) for h in p["hashes"]], own.root_hash)


def test_a_captured_artifact_round_trips(tmp_path: Path, keys: dict[str, Key], monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("torch")
    from kvgraft.engine import KV_FILE, STATEMENT_FILE, capture, current_profile, load_model
    from kvgraft.verifier import TrustedKeys, parse_envelope, trusted_key, verify_statement_envelope

    monkeypatch.setenv("KVGRAFT_HOME", str(tmp_path / "home"))
    alice = keys["alice"]
    model, profile = load_model("tiny-llama-test"), current_profile()
    captured = capture(model, profile, "A worked solution: 3 + 4 = 7.", tmp_path / "art", key=alice.path)
    tensors = (captured.directory / KV_FILE).read_bytes()
    envelope = (captured.directory / STATEMENT_FILE).read_bytes()
    data = tmp_path / "data"
    with running_server(data) as server, httpx.Client(base_url=server.url, timeout=30) as client:
        token = _token(data, "alice", alice)["token"]
        r = _publish(client, token, tensors, envelope)
        assert r.status_code == 201, r.text
        assert r.json()["entry"]["artifact"]["digest"] == captured.kv_digest
        found = client.get("/v1/artifacts", params={"model": "tiny-llama-test", "q": "worked solution"}).json()["items"]
        assert [i["digest"] for i in found] == [captured.kv_digest]
        doc = client.get(f"/v1/artifacts/{captured.kv_digest}").json()
        pulled = client.get(doc["entry"]["envelope_url"]).content
        assert pulled == envelope
        assert client.get(f"/v1/blobs/{captured.kv_digest}").content == tensors
        trust = TrustedKeys((trusted_key("alice", alice.private.public_key()),))
        _, statement = verify_statement_envelope(parse_envelope(pulled), trust)
        assert statement.predicate.source_text.text == "A worked solution: 3 + 4 = 7."  # type: ignore[attr-defined]
