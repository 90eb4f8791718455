"""Entries in-process: publishing signed envelopes, the checks before logging, and the read API."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvgraft.registry._internal.errors import RegistryError
from kvgraft.schemas import sha256_bytes
from kvgraft.verifier import parse_public_key
from kvgraft.verifier._internal.tlog import hash_leaf, verify_checkpoint, verify_consistency, verify_inclusion

from .conftest import (
    Harness,
    Key,
    artifact,
    blob_path,
    exactness_record,
    harness,
    pre_registration,
    replay,
    tampered,
)


def _problem(r, status: int, slug: str | None = None) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/problem+json")
    doc = dict(r.json())
    assert doc["status"] == status
    if slug is not None:
        assert doc["type"] == f"https://kvgraft.dev/problems/{slug}", doc
    return doc


def _log_key(reg: Harness) -> tuple[str, Any]:
    doc = reg.client.get("/v1/log/key").json()
    return doc["origin"], parse_public_key(doc["public_key_pem"].encode())


def _tree_size(reg: Harness) -> int:
    return int(reg.client.get("/v1/log/checkpoint").text.split("\n")[1])


def _check_proof(reg: Harness, envelope: bytes, doc: dict[str, Any]) -> None:
    origin, key = _log_key(reg)
    head = verify_checkpoint(doc["checkpoint"].encode(), origin, key, origin=origin)
    proof = doc["inclusion_proof"]
    assert proof["tree_size"] == head.size
    verify_inclusion(hash_leaf(envelope), proof["log_index"], head.size, [bytes.fromhex(h) for h in proof["hashes"]], head.root_hash)


def test_publish_an_artifact(reg: Harness, keys: dict[str, Key]) -> None:
    art = artifact("the knowledge to graft")
    assert reg.put_blob(art.tensors).status_code == 201
    envelope = keys["alice"].sign(art.statement)
    r = reg.publish(envelope)
    assert r.status_code == 201, r.text
    doc = r.json()
    entry = doc["entry"]
    assert entry["log_index"] == 0
    assert entry["digest"] == sha256_bytes(envelope)
    assert entry["leaf_hash"] == hash_leaf(envelope).hex()
    assert entry["kind"] == "artifact" and entry["predicate_type"] == "https://kvgraft.dev/kv-artifact/v1"
    assert entry["publisher"] == "alice"
    assert entry["keyids"] == [parse_key_id(keys["alice"])]
    assert entry["subjects"] == [{"name": "kv.safetensors", "digest": art.digest}]
    assert entry["artifact"]["digest"] == art.digest
    assert entry["artifact"]["model"]["name"] == "tiny-llama-test"
    assert entry["artifact"]["positions"] == [0, 4]
    assert r.headers["location"] == "/v1/entries/0"
    _check_proof(reg, envelope, doc)

    # Idempotent: the same bytes again are the same entry, and nothing is appended.
    again = reg.publish(envelope)
    assert again.status_code == 200
    assert again.json()["entry"] == entry
    assert _tree_size(reg) == 1

    # The stored bytes are exactly the posted ones, by index and by digest.
    for ref in ("0", entry["digest"]):
        got = reg.client.get(f"/v1/entries/{ref}/envelope")
        assert got.status_code == 200 and got.content == envelope
        assert got.headers["etag"] == f'"{entry["digest"]}"'
        meta = reg.client.get(f"/v1/entries/{ref}").json()
        assert meta["entry"] == entry
        _check_proof(reg, envelope, meta)
    assert reg.client.get("/v1/entries/0/envelope", headers={"If-None-Match": f'"{entry["digest"]}"'}).status_code == 304


def parse_key_id(key: Key) -> str:
    from kvgraft.verifier import keyid_of

    return keyid_of(key.private.public_key())


def test_missing_blobs_are_409_and_nothing_is_logged(reg: Harness, keys: dict[str, Key]) -> None:
    art = artifact("no tensors uploaded")
    doc = _problem(reg.publish(keys["alice"].sign(art.statement)), 409, "missing-blobs")
    assert doc["missing"] == [art.digest]
    assert art.digest in doc["detail"]
    assert _tree_size(reg) == 0

    # A child whose parent's tensors are absent is refused too.
    parent = artifact("parent")
    child = artifact("child", parent=parent)
    reg.put_blob(child.tensors)
    doc = _problem(reg.publish(keys["alice"].sign(child.statement)), 409, "missing-blobs")
    assert doc["missing"] == [parent.digest]
    assert _tree_size(reg) == 0


def test_a_tampered_envelope_is_refused_and_nothing_is_stored(reg: Harness, keys: dict[str, Key]) -> None:
    art = artifact("genuine")
    reg.put_blob(art.tensors)
    tampered_envelope = tampered(keys["alice"].sign(art.statement))
    doc = _problem(reg.publish(tampered_envelope), 422, "invalid-signature")
    assert "it was altered after signing" in doc["detail"]
    # Without key id hints the registry cannot tell who signed: still refused.
    no_hint = json.loads(tampered_envelope)
    no_hint["signatures"][0]["keyid"] = ""
    doc = _problem(reg.publish(json.dumps(no_hint).encode()), 422, "invalid-signature")
    assert "none of the envelope's 1 signature(s) verifies" in doc["detail"]
    assert _tree_size(reg) == 0
    _problem(reg.client.get(f"/v1/entries/{sha256_bytes(tampered_envelope)}"), 404, "entry-not-found")
    assert reg.client.get("/v1/artifacts").json()["items"] == []


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"", "the request body is empty"),
        (b"not json", "the posted envelope"),
        (b"[]", "must be a JSON object"),
        (b'{"payload": "!!", "payloadType": "application/vnd.in-toto+json", "signatures": [{"sig": "AA=="}]}', "not valid base64"),
        (b'{"payload": "e30=", "payloadType": "application/vnd.in-toto+json", "signatures": []}', "signatures"),
    ],
)
def test_malformed_envelopes_are_400(reg: Harness, body: bytes, message: str) -> None:
    doc = _problem(reg.publish(body), 400, "malformed-envelope")
    assert message in doc["detail"]
    assert _tree_size(reg) == 0


def test_auth_failures(reg: Harness, keys: dict[str, Key]) -> None:
    art = artifact("auth")
    reg.put_blob(art.tensors)
    envelope = keys["alice"].sign(art.statement)
    doc = _problem(reg.client.post("/v1/entries", content=envelope), 401, "unauthenticated")
    assert "needs a bearer token" in doc["detail"]
    doc = _problem(reg.client.post("/v1/entries", content=envelope, headers={"Authorization": "Basic abc"}), 401)
    assert "is not 'Bearer <token>'" in doc["detail"]
    doc = _problem(reg.client.post("/v1/entries", content=envelope, headers={"Authorization": "Bearer kvgr_nope"}), 401)
    assert "not one this registry issued" in doc["detail"]

    # bob's token may not publish alice's envelope.
    doc = _problem(reg.publish(envelope, "bob"), 403, "key-not-bound")
    assert "of publisher 'alice'" in doc["detail"] and "not bound to that key" in doc["detail"]
    # A key nobody registered.
    doc = _problem(reg.publish(keys["eve"].sign(art.statement)), 403, "key-not-bound")
    assert "not registered with this registry" in doc["detail"]

    # A revoked token is refused at once.
    token, token_id = reg.make_token("alice", keys["alice"])
    r = reg.admin("POST", f"/v1/admin/tokens/{token_id}/revoke")
    assert r.status_code == 200 and r.json()["changed"] is True
    doc = _problem(reg.client.post("/v1/entries", content=envelope, headers={"Authorization": f"Bearer {token}"}), 403, "token-revoked")
    assert token_id in doc["detail"]
    doc = _problem(reg.client.put(f"/v1/blobs/{art.digest}", content=art.tensors, headers={"Authorization": f"Bearer {token}"}), 403)
    assert _tree_size(reg) == 0


def test_a_token_bound_to_one_of_two_keys(reg: Harness, keys: dict[str, Key], tmp_path: Path) -> None:
    from .conftest import make_key

    second = make_key(tmp_path, "alice2")
    assert reg.admin("POST", "/v1/admin/keys", {"publisher": "alice", "public_key_pem": second.pem}).status_code == 201
    art = artifact("second key")
    reg.put_blob(art.tensors)
    # alice's token is bound to her first key only.
    doc = _problem(reg.publish(second.sign(art.statement)), 403, "key-not-bound")
    assert "of publisher 'alice'" in doc["detail"]
    token, _ = reg.make_token("alice", second)
    r = reg.client.post("/v1/entries", content=second.sign(art.statement), headers={"Authorization": f"Bearer {token}"})
    assert r.status_code == 201


def test_unsupported_statements_are_422(reg: Harness, keys: dict[str, Key]) -> None:
    from kvgraft.schemas import Statement

    from .conftest import subject

    data = b"some file"
    reg.put_blob(data)
    other = Statement(subject=[subject("f", data)], predicate_type="https://example.com/other/v1", predicate={})
    doc = _problem(reg.publish(keys["alice"].sign(other)), 422, "invalid-statement")
    assert "https://example.com/other/v1" in doc["detail"]
    no_kv = Statement(subject=[subject("f", data)], predicate_type="https://example.com/x", predicate={})
    assert _problem(reg.publish(keys["alice"].sign(no_kv)), 422)
    assert _tree_size(reg) == 0


def test_envelope_size_limit(tmp_path: Path, keys: dict[str, Key]) -> None:
    with harness(tmp_path / "data", keys, max_envelope_bytes=100) as h:
        doc = _problem(h.publish(keys["alice"].sign(artifact("x").statement)), 413, "too-large")
        assert "at most 100" in doc["detail"]


def test_records_replays_and_their_queries(reg: Harness, keys: dict[str, Key]) -> None:
    alice = keys["alice"]
    art = artifact("measured")
    reg.publish_artifact(art, alice)
    logits = b"\x00\x01" * 64
    record = alice.sign(exactness_record(art, logits))
    doc = _problem(reg.publish(record), 409, "missing-blobs")
    assert doc["missing"] == [sha256_bytes(logits)]
    reg.put_blob(logits)
    r = reg.publish(record)
    assert r.status_code == 201 and r.json()["entry"]["kind"] == "exactness"

    dataset, outputs = b"dataset", b"outputs"
    reg.put_blob(dataset)
    reg.put_blob(outputs)
    orphan = alice.sign(replay(outputs, sha256_bytes(b"no such pre-registration"), 0))
    doc = _problem(reg.publish(orphan), 409, "missing-reference")
    assert "not in this log" in doc["detail"]
    pre = alice.sign(pre_registration(dataset))
    pre_entry = reg.publish(pre).json()["entry"]
    wrong_index = alice.sign(replay(outputs, pre_entry["digest"], pre_entry["log_index"] + 5))
    assert "that digest is entry 2" in _problem(reg.publish(wrong_index), 422, "invalid-statement")["detail"]
    ok = reg.publish(alice.sign(replay(outputs, pre_entry["digest"], pre_entry["log_index"])))
    assert ok.status_code == 201, ok.text

    records = reg.client.get("/v1/records").json()
    assert [i["kind"] for i in records["items"]] == ["exactness", "pre-registration", "replay"]
    about = reg.client.get("/v1/records", params={"artifact": art.digest}).json()["items"]
    assert [i["kind"] for i in about] == ["exactness"]
    assert reg.client.get("/v1/records", params={"type": "replay"}).json()["items"][0]["kind"] == "replay"
    assert len(reg.client.get("/v1/records", params={"type": "https://kvgraft.dev/pre-registration/v1"}).json()["items"]) == 1
    replays_of = reg.client.get("/v1/records", params={"artifact": pre_entry["digest"]}).json()["items"]
    assert [i["kind"] for i in replays_of] == ["replay"]
    assert "unknown record type" in _problem(reg.client.get("/v1/records", params={"type": "nope"}), 400)["detail"]
    assert _problem(reg.client.get("/v1/records", params={"artifact": "sha256:XYZ"}), 400, "bad-digest")


def test_listing_filters_and_stable_cursors(reg: Harness, keys: dict[str, Key]) -> None:
    alice, bob = keys["alice"], keys["bob"]
    root = artifact("Janet's ducks lay sixteen eggs per day")
    child = artifact("She eats three for breakfast", parent=root)
    grandchild = artifact("and bakes muffins with four", parent=child)
    other_model = artifact("a different model", model="smollm2-135m")
    other_profile = artifact("another profile", profile_name="cpu-fp32-tiled")
    for art in (root, child, grandchild, other_model):
        reg.publish_artifact(art, alice)
    reg.publish_artifact(other_profile, bob, publisher="bob")

    def digests(**params: Any) -> list[str]:
        r = reg.client.get("/v1/artifacts", params=params)
        assert r.status_code == 200, r.text
        return [i["digest"] for i in r.json()["items"]]

    assert digests() == [a.digest for a in (root, child, grandchild, other_model, other_profile)]
    assert digests(model="smollm2-135m") == [other_model.digest]
    assert digests(profile="cpu-fp32-tiled") == [other_profile.digest]
    assert digests(publisher="bob") == [other_profile.digest]
    assert digests(parent=root.digest) == [child.digest]
    assert digests(parent="none") == [root.digest, other_model.digest, other_profile.digest]
    assert digests(q="DUCKS sixteen") == [root.digest]
    assert digests(q="muffins") == [grandchild.digest]
    assert digests(q="100%_") == []
    assert digests(q="ducks", model="smollm2-135m") == []

    # Pages of 2 walk the same list; cursors stay valid as the log grows.
    seen, cursor, pages = [], None, 0
    while True:
        params: dict[str, Any] = {"limit": 2, **({"cursor": cursor} if cursor else {})}
        page = reg.client.get("/v1/artifacts", params=params).json()
        seen += [i["digest"] for i in page["items"]]
        pages += 1
        cursor = page["next_cursor"]
        if pages == 1:
            late = artifact("published while paging")
            reg.publish_artifact(late, alice)
        if cursor is None:
            break
    assert pages == 3
    assert seen == digests()
    assert late.digest in seen
    assert reg.client.get("/v1/entries", params={"limit": 3}).json()["next_cursor"]

    assert "not one this registry issued" in _problem(reg.client.get("/v1/artifacts", params={"cursor": "garbage"}), 400)["detail"]
    assert "between 1 and 500" in _problem(reg.client.get("/v1/artifacts", params={"limit": 0}), 400)["detail"]
    _problem(reg.client.get("/v1/artifacts", params={"limit": 501}), 400)
    _problem(reg.client.get("/v1/artifacts", params={"parent": "sha256:short"}), 400, "bad-digest")

    # One artifact: statement, envelope, lineage both ways, proof and checkpoint.
    doc = reg.client.get(f"/v1/artifacts/{child.digest}").json()
    assert doc["artifact"]["digest"] == child.digest
    assert doc["artifact"]["text"] == "She eats three for breakfast"
    assert doc["statement"]["predicate"]["parent"] == root.digest
    assert doc["envelope"]["payloadType"] == "application/vnd.in-toto+json"
    assert [p["digest"] for p in doc["lineage"]["parents"]] == [root.digest]
    assert [c["digest"] for c in doc["lineage"]["children"]] == [grandchild.digest]
    envelope = reg.client.get(doc["entry"]["envelope_url"]).content
    _check_proof(reg, envelope, doc)
    deep = reg.client.get(f"/v1/artifacts/{grandchild.digest}").json()["lineage"]["parents"]
    assert [p["digest"] for p in deep] == [child.digest, root.digest]
    _problem(reg.client.get(f"/v1/artifacts/{sha256_bytes(b'none')}"), 404, "artifact-not-found")
    _problem(reg.client.get("/v1/artifacts/sha256:ABC"), 400, "bad-digest")

    pubs = {p["name"]: p for p in reg.client.get("/v1/publishers").json()["publishers"]}
    assert set(pubs) == {"alice", "bob"}
    assert [k["keyid"] for k in pubs["bob"]["keys"]] == [parse_key_id(bob)]


def test_log_endpoints_and_proofs(reg: Harness, keys: dict[str, Key]) -> None:
    origin, key = _log_key(reg)
    empty = reg.client.get("/v1/log/checkpoint")
    assert empty.headers["content-type"].startswith("text/plain")
    head0 = verify_checkpoint(empty.content, origin, key)
    assert head0.size == 0
    envelopes = []
    for i in range(5):
        art = artifact(f"entry {i}")
        doc = reg.publish_artifact(art, keys["alice"])
        envelopes.append(reg.client.get(doc["entry"]["envelope_url"]).content)
    head = verify_checkpoint(reg.client.get("/v1/log/checkpoint").content, origin, key)
    assert head.size == 5
    for i, envelope in enumerate(envelopes):
        proof = reg.client.get("/v1/log/proof/inclusion", params={"index": i}).json()
        assert proof["tree_size"] == 5 and set(proof) == {"log_index", "tree_size", "hashes"}
        verify_inclusion(hash_leaf(envelope), i, 5, [bytes.fromhex(h) for h in proof["hashes"]], head.root_hash)
    # Against an older checkpoint, and its consistency with the newest.
    old = verify_checkpoint(reg.client.get("/v1/log/checkpoint", params={"tree_size": 3}).content, origin, key)
    proof = reg.client.get("/v1/log/proof/inclusion", params={"index": 1, "tree_size": 3}).json()
    verify_inclusion(hash_leaf(envelopes[1]), 1, 3, [bytes.fromhex(h) for h in proof["hashes"]], old.root_hash)
    cons = reg.client.get("/v1/log/proof/consistency", params={"old": 3}).json()
    assert (cons["old_size"], cons["new_size"]) == (3, 5)
    verify_consistency(3, 5, old.root_hash, head.root_hash, [bytes.fromhex(h) for h in cons["hashes"]])

    assert "is not in a tree of size 5" in _problem(reg.client.get("/v1/log/proof/inclusion", params={"index": 5}), 404)["detail"]
    assert "outside the log" in _problem(reg.client.get("/v1/log/proof/inclusion", params={"index": 0, "tree_size": 6}), 404)["detail"]
    assert "must be between 0" in _problem(reg.client.get("/v1/log/proof/consistency", params={"old": 4, "new": 2}), 404)["detail"]
    assert "query index" in _problem(reg.client.get("/v1/log/proof/inclusion", params={"index": "x"}), 400)["detail"]
    _problem(reg.client.get("/v1/log/checkpoint", params={"tree_size": 99}), 404)
    assert "there is no entry 5" in _problem(reg.client.get("/v1/entries/5"), 404, "entry-not-found")["detail"]
    _problem(reg.client.get("/v1/entries/latest"), 400)
    key_doc = reg.client.get("/v1/log/key").json()
    assert key_doc["vkey"].startswith(origin + "+")
    assert (reg.data / "registry-key.pub.pem").read_text() == key_doc["public_key_pem"]


def test_a_failed_commit_leaves_no_entry_and_the_log_carries_on(
    reg: Harness, keys: dict[str, Key], monkeypatch: pytest.MonkeyPatch
) -> None:
    reg.publish_artifact(artifact("before"), keys["alice"])
    registry = reg.client.app.state.registry
    art = artifact("crash")
    reg.put_blob(art.tensors)
    real_sign = registry.log.sign

    def crash(*args: Any, **kwargs: Any) -> Any:
        head = real_sign(*args, **kwargs)
        # Fail inside the transaction, after the entry row was written.
        monkeypatch.setattr(registry.db, "transaction", _failing_transaction(registry.db))
        return head

    monkeypatch.setattr(registry.log, "sign", crash)
    r = reg.publish(keys["alice"].sign(art.statement))
    assert r.status_code == 500
    assert "could not be recorded" in r.json()["detail"]
    monkeypatch.undo()
    assert _tree_size(reg) == 1
    assert registry.log.size == 1
    assert reg.client.get("/v1/artifacts").json()["items"][0]["digest"] != art.digest
    assert registry.db.query("SELECT count(*) FROM entries")[0][0] == 1
    # The next publish gets index 1 and a proof that verifies.
    envelope = keys["alice"].sign(art.statement)
    doc = reg.publish(envelope).json()
    assert doc["entry"]["log_index"] == 1
    _check_proof(reg, envelope, doc)


def _failing_transaction(db: Any) -> Any:
    import contextlib

    import duckdb

    real = db.transaction

    @contextlib.contextmanager
    def transaction():  # type: ignore[no-untyped-def]
        with real() as conn:
            yield conn
            conn.execute("SELECT count(*) FROM entries")  # the entry row is in
            raise duckdb.ConstraintException("simulated failure before commit")

    return transaction


def test_reads_can_require_a_token(tmp_path: Path, keys: dict[str, Key]) -> None:
    with harness(tmp_path / "data", keys, reads_require_token=True) as h:
        _problem(h.client.get("/v1/artifacts"), 401, "unauthenticated")
        _problem(h.client.get("/v1/log/checkpoint"), 401)
        assert h.client.get("/v1/artifacts", headers=h.auth()).status_code == 200


def test_openapi_lists_the_api_but_not_admin(reg: Harness) -> None:
    paths = reg.client.get("/schema/openapi.json").json()["paths"]
    for p in ("/v1/blobs/{digest}", "/v1/entries", "/v1/entries/{ref}", "/v1/entries/{ref}/envelope", "/v1/log/checkpoint",
              "/v1/log/key", "/v1/log/proof/inclusion", "/v1/log/proof/consistency", "/v1/artifacts",
              "/v1/artifacts/{digest}", "/v1/records", "/v1/publishers"):
        assert p in paths
    assert not [p for p in paths if "admin" in p]


def test_admin_api_needs_the_secret(reg: Harness, keys: dict[str, Key]) -> None:
    r = reg.client.get("/v1/admin/tokens", headers={"Authorization": "Bearer " + reg.tokens["alice"]})
    assert "admin secret" in _problem(r, 401, "admin-unauthenticated")["detail"]
    _problem(reg.client.get("/v1/admin/keys"), 401)
    tokens = reg.admin("GET", "/v1/admin/tokens").json()["tokens"]
    assert {t["publisher"] for t in tokens} == {"alice", "bob"}
    assert all("token" not in t for t in tokens)
    # A key belongs to one publisher.
    r = reg.admin("POST", "/v1/admin/keys", {"publisher": "bob", "public_key_pem": keys["alice"].pem})
    assert "already registered for publisher 'alice'" in _problem(r, 409, "conflict")["detail"]
    r = reg.admin("POST", "/v1/admin/tokens", {"publisher": "bob", "public_keys_pem": [keys["alice"].pem]})
    assert "registered for publisher 'alice', not 'bob'" in _problem(r, 409)["detail"]
    r = reg.admin("POST", "/v1/admin/keys", {"publisher": "Bad Name", "public_key_pem": keys["eve"].pem})
    _problem(r, 400, "invalid-name")
    r = reg.admin("POST", "/v1/admin/keys", {"publisher": "eve", "public_key_pem": "not a key"})
    assert "not a PEM public key" in _problem(r, 400)["detail"]
    _problem(reg.admin("POST", "/v1/admin/tokens/tok_000000000000/revoke"), 404, "token-not-found")
    assert not any(p == "eve" for p in (x["name"] for x in reg.client.get("/v1/publishers").json()["publishers"]))


def test_every_error_is_a_problem_document(reg: Harness) -> None:
    for r, status in (
        (reg.client.get("/v1/nowhere"), 404),
        (reg.client.delete("/v1/entries"), 405),
        (reg.client.get("/v1/entries/0"), 404),
    ):
        doc = _problem(r, status)
        assert doc["type"] and doc["title"]
    assert issubclass(type(RegistryError("x")), Exception)


def test_a_stored_blob_is_what_the_registry_serves(reg: Harness, keys: dict[str, Key]) -> None:
    art = artifact("served")
    reg.publish_artifact(art, keys["alice"])
    assert blob_path(reg.data, art.tensors).read_bytes() == art.tensors
    assert reg.client.get(f"/v1/blobs/{art.digest}").content == art.tensors
