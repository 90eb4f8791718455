"""Batched sequencing (registry/_internal/sequencer.py): publishes verified outside the lock, then
appended in batches under one transaction and one signed checkpoint each.

The batching itself is shown against a real ``kvgraft serve`` with concurrent HTTP clients. What
lands in one batch in which order (a bad member, duplicates, a parent and its child, a failed
commit, a full queue) is set up through the registry's own two steps, ``prepare_publish`` then
``submit``, on the sequencer the app's lifespan started: queued in a known order, within one
batch wait.
"""

from __future__ import annotations

import base64
import hashlib
import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import duckdb
import httpx
import pytest

from kvgraft.registry import RegistryError
from kvgraft.registry._internal.publishing import PreparedPublish
from kvgraft.verifier import (
    envelope_json,
    ephemeral_signing_key,
    hash_leaf,
    parse_public_key,
    sign_envelope,
    verify_checkpoint,
    verify_inclusion,
)
from tests.registry.conftest import (
    Artifact,
    Harness,
    Key,
    artifact,
    harness,
    pre_registration,
    registry_cli,
    replay,
    running_server,
)

#: Long enough that everything a test queues at once lands in one batch.
WAIT_MS = 400


def _registry(h: Harness) -> Any:
    return h.client.app.state.registry


def _verify_answer(key_doc: dict[str, Any], envelope: bytes, doc: dict[str, Any]) -> int:
    """Check an answer's checkpoint (signed by the registry key) and inclusion proof; its tree size."""
    public = parse_public_key(key_doc["public_key_pem"].encode("ascii"))
    head = verify_checkpoint(doc["checkpoint"].encode("utf-8"), key_doc["origin"], public, origin=key_doc["origin"])
    proof = doc["inclusion_proof"]
    assert proof["tree_size"] == head.size and proof["log_index"] == doc["entry"]["log_index"]
    verify_inclusion(hash_leaf(envelope), proof["log_index"], head.size, [bytes.fromhex(h) for h in proof["hashes"]], head.root_hash)
    return head.size


@pytest.fixture
def batched(tmp_path: Path, keys: dict[str, Key]) -> Iterator[Harness]:
    """An in-process registry whose batches wait WAIT_MS for more publishes."""
    with harness(tmp_path / "data", keys, batch_wait_ms=WAIT_MS) as h:
        yield h


def _prepared(
    h: Harness, key: Key, art: Artifact | None = None, *, envelope: bytes | None = None, publisher: str = "alice"
) -> PreparedPublish:
    """The blob uploaded and the envelope prepared (verified, checked) for the sequencer."""
    registry = _registry(h)
    if art is not None:
        assert h.put_blob(art.tensors, publisher).status_code in (200, 201)
        envelope = key.sign(art.statement)
    assert envelope is not None
    prepared = registry.publisher.prepare_publish(envelope, registry.authenticate(f"Bearer {h.tokens[publisher]}"))
    assert isinstance(prepared, PreparedPublish), "already logged"
    return prepared


def _outcome(future: Future[Any]) -> Any:
    try:
        return future.result(timeout=30)
    except RegistryError as e:
        return e


def _in_one_batch(h: Harness, prepared: list[PreparedPublish]) -> list[Any]:
    """Queue ``prepared`` in this order, each announced as on its way first (as the app does for
    a request), so that the batch the first opens waits for the rest; their outcomes."""
    sequencer = _registry(h).publisher.sequencer
    with sequencer.arriving():
        futures = [_registry(h).publisher.submit(p) for p in prepared]
    return [_outcome(f) for f in futures]


# --- batching really happens (a real server, concurrent clients) -----------------------------


def test_concurrent_publishes_share_checkpoints_and_every_proof_verifies_against_its_batch(
    tmp_path: Path, keys: dict[str, Key]
) -> None:
    data = tmp_path / "data"
    alice = keys["alice"]
    clients = 24
    arts = [artifact(f"batched publish {i}") for i in range(clients)]
    envelopes = [alice.sign(a.statement) for a in arts]
    with running_server(data, "--rate-limit", "0", "--batch-wait-ms", "200") as server:
        made = registry_cli("--json", "token", "create", "--data", data, "--publisher", "alice", "--key", alice.pub_path)
        assert made.returncode == 0, made.stderr
        auth = {"Authorization": f"Bearer {json.loads(made.stdout)['token']}"}
        with httpx.Client(base_url=server.url, timeout=60, limits=httpx.Limits(max_connections=clients + 2)) as client:
            for a in arts:
                assert client.put(f"/v1/blobs/{a.digest}", content=a.tensors, headers=auth).status_code == 201
            key_doc = client.get("/v1/log/key").json()
            start = threading.Barrier(clients)
            answers: list[httpx.Response | None] = [None] * clients

            def post(i: int) -> None:
                start.wait(30)
                answers[i] = client.post("/v1/entries", content=envelopes[i], headers=auth)

            threads = [threading.Thread(target=post, args=(i,)) for i in range(clients)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            docs = []
            for r in answers:
                assert r is not None and r.status_code == 201, r.text if r is not None else "no answer"
                docs.append(r.json())
            sizes = {_verify_answer(key_doc, envelopes[i], d) for i, d in enumerate(docs)}
            assert sorted(d["entry"]["log_index"] for d in docs) == list(range(clients))
            # Fewer checkpoints than publishes: each batch signed one, for the size it ends at.
            assert len(sizes) < clients
            assert max(sizes) == clients
            for d in docs:
                assert d["entry"]["log_index"] < d["inclusion_proof"]["tree_size"]
            inside = next((n for n in range(1, clients) if n not in sizes), None)
            assert inside is not None
            r = client.get("/v1/log/checkpoint", params={"tree_size": inside})
            assert r.status_code == 404
            assert f"no checkpoint was signed at tree size {inside}" in r.json()["detail"]
            assert "a checkpoint is signed for each batch of publishes" in r.json()["detail"]
            # Proofs are served for any size up to the latest, a batch's inside included.
            r = client.get("/v1/log/proof/inclusion", params={"index": 0, "tree_size": inside})
            assert r.status_code == 200 and r.json()["tree_size"] == inside
            for n in sizes:
                assert client.get("/v1/log/checkpoint", params={"tree_size": n}).status_code == 200
    conn = duckdb.connect(str(data / "registry.duckdb"), read_only=True)
    try:
        stored = [int(s) for (s,) in conn.execute("SELECT tree_size FROM checkpoints ORDER BY tree_size").fetchall()]
    finally:
        conn.close()
    # One row per batch (and the empty log's): exactly the sizes the answers carried.
    assert stored == [0, *sorted(sizes)]


def test_a_publisher_posting_one_at_a_time_gets_a_checkpoint_per_entry(reg: Harness, keys: dict[str, Key]) -> None:
    sizes = []
    for i in range(3):
        doc = reg.publish_artifact(artifact(f"one at a time {i}"), keys["alice"])
        sizes.append(doc["inclusion_proof"]["tree_size"])
        assert doc["entry"]["log_index"] == i
    assert sizes == [1, 2, 3]
    for n in sizes:
        assert reg.client.get("/v1/log/checkpoint", params={"tree_size": n}).status_code == 200


def test_a_lone_publish_does_not_wait_out_the_batch_window(tmp_path: Path, keys: dict[str, Key]) -> None:
    # A batch waits for publishes on their way only: with none, it is closed at once.
    with harness(tmp_path / "data", keys, batch_wait_ms=1000) as h:
        art = artifact("alone")
        assert h.put_blob(art.tensors).status_code == 201
        t0 = time.monotonic()
        r = h.publish(keys["alice"].sign(art.statement))
        assert r.status_code == 201 and time.monotonic() - t0 < 0.8


# --- what one batch holds (queued in a known order on the app's sequencer) --------------------


def test_a_bad_member_fails_alone_and_the_rest_of_its_batch_is_logged(batched: Harness, keys: dict[str, Key]) -> None:
    alice = keys["alice"]
    registry = _registry(batched)
    good = [artifact(f"good member {i}") for i in range(3)]
    # A child of an artifact nobody logged (its tensors are stored): refused only in its batch,
    # where the parent is looked for among the log and the batch's earlier entries.
    never_logged = artifact("a parent never logged")
    assert batched.put_blob(never_logged.tensors).status_code == 201
    orphan = artifact("an orphan child", parent=never_logged)
    # A replay of a pre-registration that is not in the log either.
    outputs = b'{"0": "out"}\n'
    assert batched.put_blob(outputs).status_code == 201
    stray = alice.sign(replay(outputs, "sha256:" + "ab" * 32, 0))
    prepared = [
        _prepared(batched, alice, good[0]),
        _prepared(batched, alice, orphan),
        _prepared(batched, alice, good[1]),
        _prepared(batched, alice, envelope=stray),
        _prepared(batched, alice, good[2]),
    ]
    outcomes = _in_one_batch(batched, prepared)
    refused_child, refused_replay = outcomes[1], outcomes[3]
    assert refused_child.status_code == 422 and f"parent {never_logged.digest} has no entry in this log" in refused_child.message
    assert refused_replay.status_code == 409 and "which is not in this log" in refused_replay.message
    logged = [outcomes[0], outcomes[2], outcomes[4]]
    assert all(o.created for o in logged)
    assert [o.document["entry"]["log_index"] for o in logged] == [0, 1, 2]
    # One batch: one checkpoint for all three, at the size the batch ended at.
    assert {o.document["checkpoint"] for o in logged} == {registry.head.note.decode()}
    assert registry.head.size == 3
    key_doc = batched.client.get("/v1/log/key").json()
    for art, o in zip(good, logged, strict=True):
        assert _verify_answer(key_doc, alice.sign(art.statement), o.document) == 3


def test_duplicates_in_one_batch_get_one_entry(batched: Harness, keys: dict[str, Key]) -> None:
    alice = keys["alice"]
    registry = _registry(batched)
    before = artifact("logged before the batch")
    batched.publish_artifact(before, alice)
    twice = artifact("posted three times in one batch")
    again = [_prepared(batched, alice, twice) for _ in range(3)]
    earlier = _prepared(batched, alice, envelope=alice.sign(before.statement))
    other = _prepared(batched, alice, artifact("another in the same batch"))
    outcomes = _in_one_batch(batched, [*again, earlier, other])
    first, *repeats = outcomes[:3]
    assert first.created and first.document["entry"]["log_index"] == 1
    for r in repeats:
        assert not r.created and r.document == first.document
    assert not outcomes[3].created and outcomes[3].document["entry"]["log_index"] == 0
    assert outcomes[4].created and outcomes[4].document["entry"]["log_index"] == 2
    assert registry.head.size == 3
    assert registry.db.query("SELECT count(*) FROM entries")[0][0] == 3
    # Over HTTP, the same bytes once more are the same entry (200).
    r = batched.publish(alice.sign(twice.statement))
    assert r.status_code == 200 and r.json()["entry"]["log_index"] == 1


def test_a_parent_and_its_child_in_one_batch_are_both_logged(batched: Harness, keys: dict[str, Key]) -> None:
    alice = keys["alice"]
    root = artifact("a root with a child")
    child = artifact("its child, queued right behind it", parent=root)
    grandchild = artifact("and a grandchild", parent=child)
    # The child's parent is not logged when it is prepared: the sequencer looks for it in the batch.
    prepared = [_prepared(batched, alice, a) for a in (root, child, grandchild)]
    assert prepared[1].lineage is None and prepared[2].lineage is None
    outcomes = _in_one_batch(batched, prepared)
    assert [o.document["entry"]["log_index"] for o in outcomes] == [0, 1, 2]
    assert len({o.document["checkpoint"] for o in outcomes}) == 1
    lineage = batched.client.get(f"/v1/artifacts/{grandchild.digest}").json()["lineage"]
    assert [p["digest"] for p in lineage["parents"]] == [child.digest, root.digest]
    # A child that does not start where its parent (in the same batch) ends is refused there.
    base = artifact("another root")
    misjoined = artifact("misjoined child", parent=base)
    shifted = misjoined.statement.predicate.positions.model_copy(update={"start": 99, "end": 99 + len(misjoined.statement.predicate.tokens.ids)})
    bad = Artifact(misjoined.tensors, misjoined.statement.model_copy(
        update={"predicate": misjoined.statement.predicate.model_copy(update={"positions": shifted})}
    ))
    outcomes = _in_one_batch(batched, [_prepared(batched, alice, base), _prepared(batched, alice, bad)])
    assert outcomes[0].created
    assert outcomes[1].status_code == 422 and "a child must start where its parent ends" in outcomes[1].message


def test_a_child_queued_before_its_parent_is_refused(batched: Harness, keys: dict[str, Key]) -> None:
    alice = keys["alice"]
    root = artifact("a parent queued second")
    child = artifact("a child queued first", parent=root)
    assert batched.put_blob(root.tensors).status_code == 201
    outcomes = _in_one_batch(batched, [_prepared(batched, alice, child), _prepared(batched, alice, root)])
    assert outcomes[0].status_code == 422 and "has no entry in this log" in outcomes[0].message
    assert outcomes[1].created and outcomes[1].document["entry"]["log_index"] == 0


def test_a_revocation_before_the_batch_refuses_its_publishes(batched: Harness, keys: dict[str, Key]) -> None:
    alice = keys["alice"]
    registry = _registry(batched)
    token, token_id = batched.make_token("alice", alice)
    batched.tokens["temp"] = token
    doomed = _prepared(batched, alice, artifact("prepared, then its token revoked"), publisher="temp")
    kept = _prepared(batched, alice, artifact("another token's publish"))
    registry.accounts.revoke_token(token_id)
    outcomes = _in_one_batch(batched, [doomed, kept])
    assert outcomes[0].status_code == 403 and f"token {token_id} was revoked" in outcomes[0].message
    assert outcomes[1].created and outcomes[1].document["entry"]["log_index"] == 0


def test_a_failed_commit_fails_exactly_its_batch_and_leaves_tree_database_and_head_as_they_were(
    batched: Harness, keys: dict[str, Key], monkeypatch: pytest.MonkeyPatch
) -> None:
    alice = keys["alice"]
    registry = _registry(batched)
    first = artifact("committed before the failure")
    batched.publish_artifact(first, alice)
    head_file = batched.data / "signed-head.json"
    head_before, root_before = head_file.read_bytes(), registry.log.root()
    doomed = [artifact(f"in the failing batch {i}") for i in range(3)]
    prepared = [_prepared(batched, alice, a) for a in doomed]
    duplicate = _prepared(batched, alice, envelope=alice.sign(first.statement))
    real = registry.db.transaction

    def failing() -> Any:
        import contextlib

        @contextlib.contextmanager
        def transaction() -> Iterator[Any]:
            with real() as conn:
                yield conn
                raise duckdb.IOException("simulated failure before commit")

        return transaction()

    monkeypatch.setattr(registry.db, "transaction", failing)
    outcomes = _in_one_batch(batched, [*prepared, duplicate])
    monkeypatch.undo()
    for o in outcomes[:3]:
        assert isinstance(o, RegistryError) and o.status_code == 500
        assert "the 3 entries of this batch could not be recorded" in o.message
    # The duplicate of a committed entry did not depend on the batch: it is answered.
    assert not outcomes[3].created and outcomes[3].document["entry"]["log_index"] == 0
    assert registry.log.size == 1 and registry.log.root() == root_before and registry.head.size == 1
    assert registry.db.query("SELECT count(*) FROM entries")[0][0] == 1
    assert [s for (s,) in registry.db.query("SELECT tree_size FROM checkpoints ORDER BY tree_size")] == [0, 1]
    assert head_file.read_bytes() == head_before
    # The log carries on: the same publishes again are entries 1 to 3 with proofs that verify.
    key_doc = batched.client.get("/v1/log/key").json()
    outcomes = _in_one_batch(batched, [_prepared(batched, alice, a) for a in doomed])
    assert [o.document["entry"]["log_index"] for o in outcomes] == [1, 2, 3]
    for art, o in zip(doomed, outcomes, strict=True):
        assert _verify_answer(key_doc, alice.sign(art.statement), o.document) == 4


def test_failed_commit_then_unreadable_database_left_the_batch_leaves_in_the_tree(
    batched: Harness, keys: dict[str, Key], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tree used to forget a failed batch by reloading every leaf from the database that had
    just failed: when that read failed too, the leaves stayed, and the next batch would have been
    numbered after them and signed a root over entries no database holds."""
    alice = keys["alice"]
    registry = _registry(batched)
    batched.publish_artifact(artifact("committed before the failure"), alice)
    root_before = registry.log.root()
    real_transaction, real_query = registry.db.transaction, registry.db.query

    def failing() -> Any:
        import contextlib

        @contextlib.contextmanager
        def transaction() -> Iterator[Any]:
            with real_transaction() as conn:
                yield conn
                # The database goes bad with the commit: from now on no read works either.
                monkeypatch.setattr(registry.db, "query", _unreadable)
                raise duckdb.IOException("simulated failure before commit")

        return transaction()

    def _unreadable(*args: Any, **kwargs: Any) -> Any:
        raise duckdb.IOException("simulated: the database cannot be read")

    monkeypatch.setattr(registry.db, "transaction", failing)
    outcomes = _in_one_batch(batched, [_prepared(batched, alice, artifact(f"doomed {i}")) for i in range(2)])
    assert all(isinstance(o, RegistryError) and "the 2 entries of this batch could not be recorded" in o.message for o in outcomes)
    assert registry.log.size == 1 and registry.log.root() == root_before
    monkeypatch.setattr(registry.db, "query", real_query)
    monkeypatch.setattr(registry.db, "transaction", real_transaction)
    later = _in_one_batch(batched, [_prepared(batched, alice, artifact("after the database came back"))])
    assert later[0].document["entry"]["log_index"] == 1
    key_doc = batched.client.get("/v1/log/key").json()
    assert _verify_answer(key_doc, alice.sign(artifact("after the database came back").statement), later[0].document) == 2


def test_a_full_queue_is_answered_503_with_retry_after_and_logs_nothing(tmp_path: Path, keys: dict[str, Key]) -> None:
    alice = keys["alice"]
    with harness(tmp_path / "data", keys, max_publish_queue=2, batch_max_entries=1, batch_wait_ms=0) as h:
        registry = _registry(h)
        h.publish_artifact(artifact("warms the remembered token lookups"), alice)
        held = [_prepared(h, alice, artifact(f"queued {i}")) for i in range(4)]
        waiting = artifact("refused: the queue is full")
        assert h.put_blob(waiting.tensors).status_code == 201
        futures = []
        # The sequencer cannot take the database lock while the test holds it: the queue fills.
        with registry.db.lock:
            futures.append(registry.publisher.submit(held[0]))
            deadline = time.monotonic() + 30
            while registry.publisher.sequencer.queued and time.monotonic() < deadline:
                time.sleep(0.005)  # until the sequencer took it and waits for the lock
            futures += [registry.publisher.submit(held[1]), registry.publisher.submit(held[2])]
            with pytest.raises(RegistryError, match="2 publishes .* are already waiting to be logged; this registry queues at most 2"):
                registry.publisher.submit(held[3])
            r = h.publish(alice.sign(waiting.statement))
            assert r.status_code == 503
            assert r.headers["retry-after"] == "1"
            doc = r.json()
            assert doc["type"].endswith("/publish-queue-full") and doc["retry_after"] == 1 and doc["limit"] == 2
            assert "Retry-After" in doc["hint"]
        assert [f.result(timeout=30).document["entry"]["log_index"] for f in futures] == [1, 2, 3]
        assert registry.head.size == 4
        # Nothing of the refused publish was logged; posted again later, it is.
        r = h.publish(alice.sign(waiting.statement))
        assert r.status_code == 201 and r.json()["entry"]["log_index"] == 4


def test_batch_settings_are_checked(tmp_path: Path) -> None:
    from kvgraft.registry import RegistrySettings

    with pytest.raises(ValueError, match="batch_wait_ms must be a number from 0 to 1000"):
        RegistrySettings(batch_wait_ms=5000)
    with pytest.raises(ValueError, match="batch_max_entries must be a positive int"):
        RegistrySettings(batch_max_entries=0)
    done = registry_cli("serve", "--data", tmp_path / "d", "--max-publish-queue", "0")
    assert done.returncode == 1 and "max_publish_queue must be a positive int" in done.stderr
    assert "Traceback" not in done.stderr


def test_pre_registration_and_its_replay_in_one_batch(batched: Harness, keys: dict[str, Key]) -> None:
    alice = keys["alice"]
    dataset = b'{"q": 1}\n'
    assert batched.put_blob(dataset).status_code == 201
    pre = alice.sign(pre_registration(dataset))
    outputs = b'{"0": "out"}\n'
    assert batched.put_blob(outputs).status_code == 201
    answer = alice.sign(replay(outputs, "sha256:" + hashlib.sha256(pre).hexdigest(), 0))
    outcomes = _in_one_batch(batched, [_prepared(batched, alice, envelope=e) for e in (pre, answer)])
    assert [o.document["entry"]["log_index"] for o in outcomes] == [0, 1]
    assert outcomes[1].document["entry"]["kind"] == "replay"


def test_a_statement_the_database_cannot_store_is_refused_before_it_is_queued(
    batched: Harness, keys: dict[str, Key]
) -> None:
    # JSON may escape a lone UTF-16 surrogate; no UTF-8 text holds one, so DuckDB would refuse
    # the row and with it the whole batch's transaction: it is refused before it is queued.
    alice = keys["alice"]
    art = artifact("surrogate placeholder")
    assert batched.put_blob(art.tensors).status_code == 201
    signed = json.loads(alice.sign(art.statement))
    payload = base64.b64decode(signed["payload"]).replace(b'"surrogate placeholder"', b'"broken \\ud800 text"')
    with ephemeral_signing_key(alice.private) as signer:
        envelope = envelope_json(sign_envelope(payload, [signer]))
    r = batched.publish(envelope)
    assert r.status_code == 422, r.text
    assert r.json()["type"].endswith("/invalid-statement") and "lone UTF-16 surrogate" in r.json()["detail"]
    assert _registry(batched).publisher.sequencer.sequenced == 0
    assert batched.publish_artifact(artifact("a good one after it"), alice)["entry"]["log_index"] == 0
