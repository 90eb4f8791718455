"""Issue 14 ("trust under attack"), the registry core: bounded search, bounded publish, a log
that cannot be rolled back, and lineage / reference checks. Each test is named after the
finding it pins; they run against a real ``kvgraft serve`` on 127.0.0.1 where the finding was
about the server process (memory, restart, the CLI's one-line error), and against the
in-process app (real DuckDB, real signatures) elsewhere.
"""

from __future__ import annotations

import base64
import json
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import duckdb
import httpx
import pytest

from kvgraft.registry import RegistrySettings
from kvgraft.registry._internal import publisher as publisher_module
from kvgraft.registry._internal.datadir import DataDir, read_signed_head, write_signed_head
from kvgraft.registry._internal.datadir import SignedHead as SavedHead
from kvgraft.registry._internal.errors import LogRollbackError
from kvgraft.registry._internal.service import Registry
from kvgraft.schemas import PositionRange, TokenSpan, canonical_json, sha256_bytes
from kvgraft.verifier import (
    Checkpoint,
    envelope_json,
    ephemeral_signing_key,
    open_signing_key,
    sign_checkpoint,
    sign_envelope,
)
from tests.registry.conftest import Artifact, Harness, Key, Server, artifact, free_port, harness, registry_cli
from tests.reliability.servers import make_token, post_entry, put_blob

DB = "registry.duckdb"
WAL = "registry.duckdb.wal"
HEAD = "signed-head.json"


def _problem(r: httpx.Response, status: int, slug: str | None = None) -> dict[str, Any]:
    assert r.status_code == status, (r.status_code, r.text)
    assert r.headers["content-type"].startswith("application/problem+json"), r.headers
    doc = dict(r.json())
    assert doc["detail"] and doc["hint"], doc
    if slug is not None:
        assert doc["type"].endswith("/" + slug), doc
    return doc


def _size(h: Harness) -> int:
    return int(h.client.get("/v1/log/checkpoint").text.split("\n")[1])


@pytest.fixture
def reg(tmp_path: Path, rkeys: dict[str, Key]) -> Iterator[Harness]:
    with harness(tmp_path / "data", rkeys) as h:
        yield h


def _registry(h: Harness) -> Registry:
    registry: Registry = h.client.app.state.registry
    return registry


def _with_span(
    art: Artifact, *, start: int | None = None, end: int | None = None, ids: list[int] | None = None
) -> Artifact:
    """``art`` with its positions and token ids replaced (the tensors stay the same)."""
    p = art.statement.predicate
    ids = list(p.tokens.ids) if ids is None else ids
    s = p.positions.start if start is None else start
    e = p.positions.end if end is None else end
    positions = PositionRange.model_construct(start=s, end=e)
    tokens = TokenSpan(ids=ids, digest=sha256_bytes(canonical_json(ids)))
    predicate = p.model_copy(update={"positions": positions, "tokens": tokens})
    return Artifact(art.tensors, art.statement.model_copy(update={"predicate": predicate}))


def _with_parent(art: Artifact, parent: Artifact) -> Artifact:
    """``art``'s tensors, re-stated as a child of ``parent`` (starting at its end)."""
    p = art.statement.predicate
    start = parent.statement.predicate.positions.end
    n = p.positions.end - p.positions.start
    predicate = p.model_copy(update={"parent": parent.digest, "positions": PositionRange(start=start, end=start + n)})
    return Artifact(art.tensors, art.statement.model_copy(update={"predicate": predicate}))


# --- finding 1: search is bounded and uses an index --------------------------------------------


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def test_search_with_10000_words_is_refused_before_touching_the_database(tmp_path: Path, rkeys: dict[str, Key]) -> None:
    data = tmp_path / "data"
    words = " ".join(f"w{i}" for i in range(10_000))
    server = Server(data, tmp_path / "server.log", "--rate-limit", "0")
    try:
        server.wait_ready()
        token, _ = make_token(server, "alice", rkeys["alice"])
        with httpx.Client(base_url=server.url, timeout=30) as client:
            art = artifact("ducks lay sixteen eggs")
            assert put_blob(client, token, art.tensors).status_code == 201
            assert post_entry(client, token, rkeys["alice"].sign(art.statement)).status_code == 201
            before = _rss_kib(server.pid)
            for path in ("/v1/artifacts", "/artifacts"):
                for _ in range(5):
                    t0 = time.monotonic()
                    r = client.get(path, params={"q": words})
                    elapsed = time.monotonic() - t0
                    assert r.status_code == 400, (path, r.status_code, r.text[:300])
                    assert elapsed < 2.0, (path, elapsed)
            api = client.get("/v1/artifacts", params={"q": words})
            doc = _problem(api, 400, "query-too-large")
            assert "this registry searches at most 256" in doc["detail"] and doc["limit"] == 256
            assert "at most 8 words" in doc["hint"]
            assert "256" in client.get("/artifacts", params={"q": words}).text
            # Ten refused 59 KB queries left the server's memory where it was.
            assert _rss_kib(server.pid) - before < 64 * 1024
            # And every other request is answered meanwhile: the search still works.
            found = client.get("/v1/artifacts", params={"q": "EGGS ducks"}).json()["items"]
            assert [i["digest"] for i in found] == [art.digest]
    finally:
        server.stop()


def test_search_naming_more_words_than_max_search_terms_is_400(reg: Harness) -> None:
    nine = " ".join(f"w{i}" for i in range(9))
    doc = _problem(reg.client.get("/v1/artifacts", params={"q": nine}), 400, "query-too-large")
    assert "names 9 distinct words; this registry searches for at most 8" in doc["detail"]
    r = reg.client.get("/artifacts", params={"q": nine})
    assert r.status_code == 400 and "at most 8" in r.text


def test_search_at_the_term_limit_is_answered_quickly_from_the_index(reg: Harness, rkeys: dict[str, Key]) -> None:
    alice = rkeys["alice"]
    texts = [f"entry {i} with words alpha beta gamma delta epsilon zeta eta{i % 3}, and more." for i in range(30)]
    arts = [artifact(t) for t in texts]
    for a in arts:
        reg.publish_artifact(a, alice)
    eight = "alpha BETA gamma delta epsilon zeta eta1 more"
    t0 = time.monotonic()
    for _ in range(20):
        r = reg.client.get("/v1/artifacts", params={"q": eight, "limit": 500})
        assert r.status_code == 200, r.text
    assert time.monotonic() - t0 < 10.0
    assert [i["digest"] for i in r.json()["items"]] == [a.digest for i, a in enumerate(arts) if i % 3 == 1]
    # Words are matched whole, case- and punctuation-insensitively; punctuation alone matches nothing.
    assert len(reg.client.get("/v1/artifacts", params={"q": "more"}).json()["items"]) == 30
    assert reg.client.get("/v1/artifacts", params={"q": "%%% ,,"}).json()["items"] == []
    assert len(reg.client.get("/v1/artifacts", params={"q": "   "}).json()["items"]) == 30
    page = reg.client.get("/artifacts", params={"q": "eta2 alpha"})
    assert page.status_code == 200 and arts[2].digest in page.text and arts[1].digest not in page.text


def test_search_index_is_backfilled_for_entries_logged_before_it(tmp_path: Path, rkeys: dict[str, Key]) -> None:
    data = tmp_path / "data"
    old = artifact("Photosynthesis turns light, water and carbon dioxide into sugar.")
    with harness(data, rkeys) as h:
        h.publish_artifact(old, rkeys["alice"])
    # Make the database what a registry of the previous schema left: no index, version 1.
    conn = duckdb.connect(str(data / DB))
    conn.execute("DROP TABLE search_terms")
    conn.execute("DROP TABLE cosignatures")  # migration 3, which came after the index
    conn.execute("DELETE FROM schema_version WHERE version >= 2")
    conn.close()
    with harness(data, rkeys) as h:
        assert [i["digest"] for i in h.client.get("/v1/artifacts", params={"q": "light sugar"}).json()["items"]] == [
            old.digest
        ]
        versions = _registry(h).db.query("SELECT version FROM schema_version ORDER BY version")
        assert [v for (v,) in versions][-1] >= 2


# --- finding 3 (publish side): signature bomb, JSON depth, verification outside the lock -------


def _with_garbage_signatures(envelope: bytes, n: int) -> bytes:
    doc = json.loads(envelope)
    junk = {"keyid": "", "sig": base64.b64encode(bytes(64)).decode()}
    doc["signatures"] = [junk] * n + doc["signatures"]
    return json.dumps(doc).encode()


def test_envelope_with_more_signatures_than_max_signatures_is_refused_before_verifying_any(
    reg: Harness, rkeys: dict[str, Key], monkeypatch: pytest.MonkeyPatch
) -> None:
    art = artifact("signature bomb")
    assert reg.put_blob(art.tensors).status_code == 201
    good = rkeys["alice"].sign(art.statement)
    calls = []
    real = publisher_module.verify_for_token
    monkeypatch.setattr(publisher_module, "verify_for_token", lambda *a: calls.append(1) or real(*a))
    doc = _problem(reg.publish(_with_garbage_signatures(good, 16)), 413, "too-many-signatures")
    assert "carries 17 signatures; this registry verifies at most 16 per envelope" in doc["detail"]
    assert doc["limit"] == 16
    t0 = time.monotonic()
    _problem(reg.publish(_with_garbage_signatures(good, 60_000)), 413, "too-many-signatures")
    assert time.monotonic() - t0 < 10.0
    assert calls == [] and _size(reg) == 0
    # At the limit it is accepted (15 garbage signatures and the good one).
    assert reg.publish(_with_garbage_signatures(good, 15)).status_code == 201


def _nested(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = [value]
    return value


def test_envelope_or_statement_nesting_deeper_than_max_json_depth_is_400(reg: Harness, rkeys: dict[str, Key]) -> None:
    payload = json.dumps({"_type": "https://in-toto.io/Statement/v1", "subject": _nested(100)}).encode()
    with ephemeral_signing_key(rkeys["alice"].private) as signer:
        deep_payload = envelope_json(sign_envelope(payload, [signer]))
    doc = _problem(reg.publish(deep_payload), 400, "too-deep")
    assert "the envelope's payload nests deeper than 64 levels" in doc["detail"] and doc["limit"] == 64
    art = artifact("deep envelope")
    reg.put_blob(art.tensors)
    envelope = json.loads(rkeys["alice"].sign(art.statement))
    envelope["x"] = _nested(100)
    doc = _problem(reg.publish(json.dumps(envelope).encode()), 400, "too-deep")
    assert "the posted envelope nests deeper than 64 levels" in doc["detail"]
    assert _size(reg) == 0


def test_publish_verifies_signatures_outside_the_database_lock_and_still_honours_a_revocation(
    reg: Harness, rkeys: dict[str, Key], monkeypatch: pytest.MonkeyPatch
) -> None:
    registry = _registry(reg)
    real = publisher_module.verify_for_token
    held: list[bool] = []
    revoke: list[str] = []

    def spy(*args: Any) -> Any:
        # The real verification runs; this only records whether the database lock was held.
        held.append(registry.db.lock._is_owned())  # type: ignore[attr-defined]
        if revoke:
            registry.accounts.revoke_token(revoke.pop())
        return real(*args)

    monkeypatch.setattr(publisher_module, "verify_for_token", spy)
    first = artifact("verified without the lock")
    reg.publish_artifact(first, rkeys["alice"])
    assert held == [False]
    # A revocation that lands while the signatures are being checked refuses the publish.
    token, token_id = reg.make_token("alice", rkeys["alice"])
    second = artifact("revoked mid-verification")
    assert reg.put_blob(second.tensors).status_code == 201
    revoke.append(token_id)
    r = reg.client.post(
        "/v1/entries", content=rkeys["alice"].sign(second.statement), headers={"Authorization": f"Bearer {token}"}
    )
    assert "was revoked" in _problem(r, 403, "token-revoked")["detail"]
    assert _size(reg) == 1


def test_a_slow_publish_verification_does_not_stall_reads(
    reg: Harness, rkeys: dict[str, Key], monkeypatch: pytest.MonkeyPatch
) -> None:
    art = artifact("slow verification")
    assert reg.put_blob(art.tensors).status_code == 201
    real = publisher_module.verify_for_token
    entered, release = threading.Event(), threading.Event()

    def slow(*args: Any) -> Any:
        entered.set()
        release.wait(30)
        return real(*args)

    monkeypatch.setattr(publisher_module, "verify_for_token", slow)
    registry = _registry(reg)
    token = reg.make_token("alice", rkeys["alice"])[0]
    info = registry.authenticate(f"Bearer {token}")
    result: list[Any] = []
    worker = threading.Thread(target=lambda: result.append(registry.publisher.publish(rkeys["alice"].sign(art.statement), info)))
    worker.start()
    try:
        assert entered.wait(30)
        t0 = time.monotonic()
        # Reads take the database lock: they are answered while the publish is verifying.
        assert registry.reader.list_artifacts(limit=5).items == []
        assert registry.head.size == 0
        assert time.monotonic() - t0 < 5.0
    finally:
        release.set()
        worker.join(30)
    assert result and result[0].created


# --- finding 4: the log cannot be rolled back or forked ---------------------------------------


def _publish_n(server: Server, token: str, alice: Key, n: int, tag: str) -> list[int]:
    out = []
    with httpx.Client(base_url=server.url, timeout=30) as client:
        for i in range(n):
            art = artifact(f"{tag} {i}")
            assert put_blob(client, token, art.tensors).status_code in (200, 201)
            r = post_entry(client, token, alice.sign(art.statement))
            assert r.status_code == 201, r.text
            out.append(int(r.json()["entry"]["log_index"]))
    return out


def _kill_9(server: Server) -> None:
    server.proc.kill()
    server.proc.wait(timeout=30)
    server.stop()


def _serve_refused(data: Path) -> str:
    """Run ``kvgraft serve`` on ``data``; it must refuse to start with one line and no traceback."""
    r = registry_cli("serve", "--data", data, "--port", str(free_port()), timeout=60)
    out = (r.stdout + r.stderr).strip()
    assert r.returncode != 0, out
    assert "Traceback" not in out, out
    assert len(out.splitlines()) == 1, out
    return out


def _stored_checkpoint_sizes(data: Path) -> list[int]:
    conn = duckdb.connect(str(data / DB), read_only=True)
    try:
        return [int(s) for (s,) in conn.execute("SELECT tree_size FROM checkpoints ORDER BY tree_size").fetchall()]
    finally:
        conn.close()


def test_restoring_an_older_copy_of_the_database_is_refused_at_start_and_nothing_is_signed(
    tmp_path: Path, rkeys: dict[str, Key]
) -> None:
    data = tmp_path / "data"
    alice = rkeys["alice"]
    server = Server(data, tmp_path / "s1.log", "--rate-limit", "0")
    try:
        server.wait_ready()
        token, _ = make_token(server, "alice", alice)
        assert _publish_n(server, token, alice, 3, "before the copy") == [0, 1, 2]
    finally:
        server.stop()
    shutil.copy(data / DB, tmp_path / "old.duckdb")  # the copy an attacker (or a careless restore) puts back
    server = Server(data, tmp_path / "s2.log", "--rate-limit", "0")
    try:
        server.wait_ready()
        assert _publish_n(server, token, alice, 3, "after the copy") == [3, 4, 5]
    finally:
        _kill_9(server)
    head_before = (data / HEAD).read_bytes()
    assert json.loads(head_before)["tree_size"] == 6
    shutil.copy(tmp_path / "old.duckdb", data / DB)
    (data / WAL).unlink(missing_ok=True)
    line = _serve_refused(data)
    assert "the database holds 3 log entries, but this registry already signed a checkpoint at tree size 6" in line
    assert "the database was rolled back or lost committed writes" in line and "would fork the log" in line
    assert "restore registry.duckdb (with its .wal) from a backup taken at tree size 6 or later" in line
    # Refused before anything was signed: no new checkpoint in the database, the head file untouched.
    assert _stored_checkpoint_sizes(data) == [0, 1, 2, 3]
    assert (data / HEAD).read_bytes() == head_before


@pytest.mark.parametrize("damage", ["deleted", "truncated"])
def test_a_deleted_or_truncated_wal_after_kill_9_is_refused_at_start(
    tmp_path: Path, rkeys: dict[str, Key], damage: str
) -> None:
    data = tmp_path / "data"
    alice = rkeys["alice"]
    server = Server(data, tmp_path / "s.log", "--rate-limit", "0")
    try:
        server.wait_ready()
        token, _ = make_token(server, "alice", alice)
        _publish_n(server, token, alice, 6, f"wal {damage}")
    finally:
        _kill_9(server)
    wal = data / WAL
    assert wal.exists() and wal.stat().st_size > 0
    head_before = (data / HEAD).read_bytes()
    if damage == "deleted":
        wal.unlink()
    else:
        with wal.open("r+b") as f:
            f.truncate(wal.stat().st_size // 2)
    damaged = (data / DB).read_bytes(), wal.read_bytes() if wal.exists() else None
    line = _serve_refused(data)
    # The refused start left the evidence as it was: no checkpoint folded the WAL into the file.
    assert ((data / DB).read_bytes(), wal.read_bytes() if wal.exists() else None) == damaged
    # DuckDB either replays what is left (a shorter log: refused as rolled back) or cannot open it at all.
    assert ("but this registry already signed a checkpoint at tree size 6" in line) or (
        "cannot open the registry database" in line
    ), line
    assert (data / HEAD).read_bytes() == head_before


def test_a_crash_between_the_commit_and_the_head_write_does_not_brick_the_server(
    tmp_path: Path, rkeys: dict[str, Key]
) -> None:
    data = tmp_path / "data"
    with harness(data, rkeys) as h:
        for i in range(2):
            h.publish_artifact(artifact(f"ahead {i}"), rkeys["alice"])
        older = (data / HEAD).read_bytes()
        for i in range(2, 4):
            h.publish_artifact(artifact(f"ahead {i}"), rkeys["alice"])
    # The database committed entries 2 and 3 but the head file still says 2: a database AHEAD of
    # the saved head is what a crash between the two writes leaves, and is served.
    (data / HEAD).write_bytes(older)
    with Registry.open(data, RegistrySettings()) as registry:
        assert registry.head.size == 4
    saved = read_signed_head(DataDir(data))
    assert saved is not None and saved.tree_size == 4


def test_each_publish_saves_the_signed_head_before_answering(reg: Harness, rkeys: dict[str, Key]) -> None:
    for i in range(3):
        doc = reg.publish_artifact(artifact(f"saved head {i}"), rkeys["alice"])
        saved = json.loads((reg.data / HEAD).read_text())
        assert saved["tree_size"] == i + 1
        assert saved["checkpoint"] == doc["checkpoint"]
        assert saved["root_hash"] == bytes(_registry(reg).log.root()).hex()


def test_a_database_holding_a_different_tree_of_the_signed_size_is_refused(
    tmp_path: Path, rkeys: dict[str, Key]
) -> None:
    data = tmp_path / "data"
    with harness(data, rkeys) as h:
        for i in range(3):
            h.publish_artifact(artifact(f"fork {i}"), rkeys["alice"])
        origin = _registry(h).log.origin
    # A head for size 3 with another root, validly signed: what the registry would have signed
    # for a different tree of that size (the split view the log exists to prevent).
    other_root = bytes(range(32))
    with open_signing_key(data / "registry-key.pem") as key:
        note = sign_checkpoint(Checkpoint(origin=origin, size=3, root_hash=other_root), origin, key)
    # Replacing the file (write_signed_head itself refuses another root at the saved size).
    (data / HEAD).unlink()
    write_signed_head(DataDir(data), SavedHead(origin=origin, tree_size=3, root_hash=other_root, checkpoint=note))
    with pytest.raises(LogRollbackError, match="the database holds a different log; serving it would fork the log"):
        with Registry.open(data, RegistrySettings()):
            pass


def test_a_deleted_signed_head_file_is_refused_but_an_upgraded_data_directory_gets_one(
    tmp_path: Path, rkeys: dict[str, Key]
) -> None:
    data = tmp_path / "data"
    with harness(data, rkeys) as h:
        h.publish_artifact(artifact("head file"), rkeys["alice"])
    (data / HEAD).unlink()
    line = _serve_refused(data)
    assert "signed-head.json is missing from the data directory, but this database has written one" in line
    # A data directory from before signed heads existed (no file, no record of one) gets one written.
    conn = duckdb.connect(str(data / DB))
    conn.execute("DELETE FROM meta WHERE key = 'signed_head_file'")
    conn.close()
    with Registry.open(data, RegistrySettings()) as registry:
        assert registry.head.size == 1
    saved = read_signed_head(DataDir(data))
    assert saved is not None and saved.tree_size == 1


# --- finding 10: references, numbers and lineage ----------------------------------------------


def test_entry_refs_with_non_ascii_digits_are_400_not_500_nor_another_entry(
    reg: Harness, rkeys: dict[str, Key]
) -> None:
    for i in range(4):
        reg.publish_artifact(artifact(f"entry {i}"), rkeys["alice"])
    assert reg.client.get("/v1/entries/3").json()["entry"]["log_index"] == 3
    for ref in ("%C2%B3", "%D9%A3", "%EF%BC%93", "3%E2%81%A0", "99999999999999999999999"):
        for suffix in ("", "/envelope"):
            r = reg.client.get(f"/v1/entries/{ref}{suffix}")
            assert r.status_code in (400, 404), (ref, r.status_code, r.text)
            assert "ASCII digits" in _problem(r, r.status_code)["hint"] or r.status_code == 404


def test_numeric_query_parameters_out_of_range_are_400_never_500(reg: Harness, rkeys: dict[str, Key]) -> None:
    reg.publish_artifact(artifact("numbers"), rkeys["alice"])
    huge, negative = str(10**30), "-1"
    cases: list[tuple[str, dict[str, str], int | tuple[int, ...]]] = [
        ("/v1/log/checkpoint", {"tree_size": huge}, (400, 404)),
        ("/v1/log/checkpoint", {"tree_size": negative}, (400, 404)),
        ("/v1/log/proof/inclusion", {"index": huge}, (400, 404)),
        ("/v1/log/proof/inclusion", {"index": "0", "tree_size": huge}, (400, 404)),
        ("/v1/log/proof/inclusion", {"index": negative}, (400, 404)),
        ("/v1/log/proof/consistency", {"old": negative}, (400, 404)),
        ("/v1/log/proof/consistency", {"old": "0", "new": huge}, (400, 404)),
        ("/v1/log/proof/consistency", {"old": huge}, (400, 404)),
        ("/v1/entries", {"limit": huge}, 400),
        ("/v1/artifacts", {"limit": negative}, 400),
        ("/v1/records", {"limit": "0"}, 400),
    ]
    for path, params, status in cases:
        r = reg.client.get(path, params=params)
        assert r.status_code in (status if isinstance(status, tuple) else (status,)), (
            path,
            params,
            r.status_code,
            r.text,
        )
        _problem(r, r.status_code)
    for before in (huge, negative):
        r = reg.client.get("/artifacts", params={"before": before})
        assert r.status_code in (200, 400), (before, r.status_code)


def test_a_child_that_does_not_start_at_its_parents_end_is_refused(reg: Harness, rkeys: dict[str, Key]) -> None:
    alice = rkeys["alice"]
    root = artifact("the root of a gap")
    reg.publish_artifact(root, alice)
    child = artifact("the child after a gap", parent=root)
    end = root.statement.predicate.positions.end
    n = len(child.statement.predicate.tokens.ids)
    gap = _with_span(child, start=end + 1, end=end + 1 + n)
    assert reg.put_blob(gap.tensors).status_code == 201
    doc = _problem(reg.publish(alice.sign(gap.statement)), 422, "invalid-lineage")
    assert f"starts at position {end + 1}, but its parent {root.digest} ends at position {end}" in doc["detail"]
    # A parent whose tensors are stored but that has no entry cannot be joined up to.
    orphan_parent = artifact("a parent never published")
    orphan = artifact("an orphan", parent=orphan_parent)
    reg.put_blob(orphan_parent.tensors)
    reg.put_blob(orphan.tensors)
    doc = _problem(reg.publish(alice.sign(orphan.statement)), 422, "invalid-lineage")
    assert f"the artifact's parent {orphan_parent.digest} has no entry in this log" in doc["detail"]
    # A root must start at 0.
    late_root = _with_span(artifact("a root that starts late"), start=5, end=8, ids=[1, 2, 3])
    reg.put_blob(late_root.tensors)
    assert "must start at position 0" in _problem(reg.publish(alice.sign(late_root.statement)), 422)["detail"]
    assert _size(reg) == 1
    reg.publish_artifact(child, alice)


def test_zero_length_artifacts_are_refused(reg: Harness, rkeys: dict[str, Key]) -> None:
    alice = rkeys["alice"]
    empty = _with_span(artifact("empty"), start=0, end=0, ids=[])
    reg.put_blob(empty.tensors)
    doc = _problem(reg.publish(alice.sign(empty.statement)), 422, "invalid-lineage")
    assert "covers no positions: its range [0, 0) is empty" in doc["detail"]
    # Token ids that do not fill the range (refused by the registry, or already by the statement schema).
    for bad in (
        _with_span(artifact("no token ids"), start=0, end=2, ids=[]),
        _with_span(artifact("short"), start=0, end=3, ids=[7]),
    ):
        reg.put_blob(bad.tensors)
        detail = _problem(reg.publish(alice.sign(bad.statement)), 422)["detail"]
        assert "token ids" in detail and "cover" in detail, detail
    # A range that ends before it starts is not even a valid statement.
    backwards = _with_span(artifact("backwards"), start=3, end=1, ids=[])
    reg.put_blob(backwards.tensors)
    assert "ends before it starts" in _problem(reg.publish(alice.sign(backwards.statement)), 422)["detail"]
    assert _size(reg) == 0


def test_parent_cycles_are_refused_at_publish(reg: Harness, rkeys: dict[str, Key]) -> None:
    alice = rkeys["alice"]
    a = artifact("cycle a")
    reg.publish_artifact(a, alice)
    b = artifact("cycle b", parent=a)
    reg.publish_artifact(b, alice)
    # A second statement about a's tensors, naming b (a's own child) as parent: a -> b -> a.
    a_again = _with_parent(a, b)
    doc = _problem(reg.publish(alice.sign(a_again.statement)), 422, "invalid-lineage")
    assert "would make a lineage cycle" in doc["detail"]
    itself = _with_parent(b, b)
    doc = _problem(reg.publish(alice.sign(itself.statement)), 422, "invalid-lineage")
    assert "names itself as its parent" in doc["detail"]
    assert _size(reg) == 2


def test_a_lineage_deeper_than_max_lineage_depth_is_refused_at_publish(tmp_path: Path, rkeys: dict[str, Key]) -> None:
    alice = rkeys["alice"]
    with harness(tmp_path / "data", rkeys, max_lineage_depth=3) as h:
        chain = [artifact("depth 0")]
        h.publish_artifact(chain[0], alice)
        for i in range(1, 4):  # three ancestors at most: depth 3 is the limit
            chain.append(artifact(f"depth {i}", parent=chain[-1]))
            h.publish_artifact(chain[-1], alice)
        too_deep = artifact("depth 4", parent=chain[-1])
        h.put_blob(too_deep.tensors)
        doc = _problem(h.publish(alice.sign(too_deep.statement)), 422, "invalid-lineage")
        assert "parent chain is more than 3 artifacts deep" in doc["detail"] and doc["limit"] == 3
        assert _size(h) == 4


def test_lineage_views_of_old_cyclic_or_deep_data_are_bounded(tmp_path: Path, rkeys: dict[str, Key]) -> None:
    alice = rkeys["alice"]
    data = tmp_path / "data"
    with harness(data, rkeys) as h:
        chain = [artifact("old 0")]
        h.publish_artifact(chain[0], alice)
        for i in range(1, 6):
            chain.append(artifact(f"old {i}", parent=chain[-1]))
            h.publish_artifact(chain[-1], alice)
    # Old data (logged before publish checked lineage) may hold a cycle: root's parent is the leaf.
    conn = duckdb.connect(str(data / DB))
    conn.execute("UPDATE entries SET parent = ? WHERE artifact_digest = ?", [chain[-1].digest, chain[0].digest])
    conn.close()
    with harness(data, rkeys, max_lineage_depth=3) as h:
        t0 = time.monotonic()
        for art in chain:
            r = h.client.get(f"/v1/artifacts/{art.digest}")
            assert r.status_code == 200, r.text
            assert len(r.json()["lineage"]["parents"]) <= 3
        assert time.monotonic() - t0 < 10.0
        parents = h.client.get(f"/v1/artifacts/{chain[-1].digest}").json()["lineage"]["parents"]
        assert [p["digest"] for p in parents] == [a.digest for a in reversed(chain[2:5])]
