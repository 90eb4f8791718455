"""The registry on PostgreSQL: migrations, several ``kvgraft serve`` processes on one database, failover.

Against a real PostgreSQL server (tests/registry/postgres.py, the session's ``postgres``
fixture): the numbered migrations on a new database, then two real server processes sharing
one database and one data directory (blobs, registry key, signed head): one sequences, the
other serves reads, sees new entries at once and refuses publishes naming the sequencer; a
``kill -9`` of the sequencer hands the lease to the other within a bound, and the log goes on
from the last checkpoint, as a client that remembers checkpoints verifies.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest

from kvgraft.registry.client import CheckpointMemory, RegistryClient, registry_key
from kvgraft.schemas import sha256_bytes
from kvgraft.verifier import hash_leaf, verify_checkpoint, verify_inclusion
from tests.registry.conftest import Artifact, Key, Server, artifact, free_port, registry_cli
from tests.registry.postgres import PostgresServer

#: The longest a lease left by a killed sequencer may take to change hands (its tries are 0.5 s apart).
HANDOVER_BOUND = 10.0


# --- migrations ----------------------------------------------------------------------------------


def test_migrations_run_on_postgres_once_with_postgres_types(postgres: PostgresServer, tmp_path: Path) -> None:
    from kvgraft.registry._internal import search  # noqa: F401  (search and cosignatures register their migrations)
    from kvgraft.registry._internal.log import cosignatures  # noqa: F401
    from kvgraft.registry._internal.storage.db import Database
    from kvgraft.registry._internal.storage.ddl import migrations

    url = postgres.database()
    db = Database.open(tmp_path, database=url)
    try:
        assert db.schema_version() == max(m.version for m in migrations())
        assert db.dialect.shared
    finally:
        db.close()
    again = Database.open(tmp_path, database=url)
    try:
        assert again.migrate() == []  # every step applied once, recorded in schema_version
    finally:
        again.close()
    with psycopg.connect(url) as conn:
        types = dict(conn.execute(
            "SELECT column_name, data_type FROM information_schema.columns WHERE table_name = 'entries'"
        ).fetchall())
        versions = [v for (v,) in conn.execute("SELECT version FROM schema_version ORDER BY version").fetchall()]
    assert types["leaf_hash"] == "bytea" and types["envelope"] == "bytea"
    assert types["keyids"] == "ARRAY" and types["log_index"] == "bigint"
    assert versions == [m.version for m in migrations()]
    assert not (tmp_path / "registry.duckdb").exists()  # the data directory holds no DuckDB file


def test_two_processes_migrating_one_new_database_at_once(postgres: PostgresServer, tmp_path: Path) -> None:
    from kvgraft.registry._internal import search  # noqa: F401  (search and cosignatures register their migrations)
    from kvgraft.registry._internal.log import cosignatures  # noqa: F401
    from kvgraft.registry._internal.storage.db import Database
    from kvgraft.registry._internal.storage.ddl import migrations

    url = postgres.database()

    def open_and_close(_: int) -> int:
        db = Database.open(tmp_path, database=url)
        try:
            return db.schema_version()
        finally:
            db.close()

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        assert set(pool.map(open_and_close, range(4))) == {max(m.version for m in migrations())}


def test_a_bad_database_url_is_one_clear_line(tmp_path: Path) -> None:
    done = registry_cli("serve", "--data", tmp_path / "d", "--database", "mysql://x/y", "--port", "1")
    assert done.returncode != 0
    assert "must be a postgresql:// URL" in done.stderr and "Traceback" not in done.stderr
    done = registry_cli("serve", "--data", tmp_path / "d", "--init", "--database", "postgresql://nobody@127.0.0.1:1/none",
                        "--port", str(free_port()))
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert "cannot connect to the registry's PostgreSQL database postgresql://nobody@127.0.0.1:1/none" in done.stderr
    assert not (tmp_path / "d").exists()  # a failed start leaves no new registry behind


# --- several server processes on one database ------------------------------------------------------


def _token(data: Path, url: str, publisher: str, key: Key) -> str:
    """A token made by the admin command straight in the shared database (no server involved)."""
    done = registry_cli("--json", "token", "create", "--data", data, "--database", url, "--publisher", publisher,
                        "--key", key.pub_path)
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    assert doc["via"] == "database"
    return str(doc["token"])


@contextlib.contextmanager
def _servers(data: Path, url: str, count: int) -> Iterator[list[Server]]:
    """``count`` servers on one data directory and one database, started one after the other."""
    servers: list[Server] = []
    try:
        for i in range(count):
            server = Server(data, data.parent / f"server-{i}.log", "--database", url)
            servers.append(server)
            server.wait_ready()
        yield servers
    finally:
        for server in servers:
            server.stop()


def _publish(server: Server, token: str, art: Artifact, key: Key, *, timeout: float = 30) -> httpx.Response:
    auth = {"Authorization": f"Bearer {token}"}
    r = httpx.put(f"{server.url}/v1/blobs/{art.digest}", content=art.tensors, headers=auth, timeout=timeout)
    assert r.status_code in (200, 201), r.text
    return httpx.post(f"{server.url}/v1/entries", content=key.sign(art.statement), headers=auth, timeout=timeout)


def _check_answer(doc: dict[str, Any], public_key: Any, origin: str) -> None:
    """An entry answer's inclusion proof verifies against its checkpoint, signed by the registry key."""
    checkpoint = verify_checkpoint(doc["checkpoint"].encode(), origin, public_key, origin=origin)
    proof = doc["inclusion_proof"]
    assert proof["tree_size"] == checkpoint.size
    verify_inclusion(
        bytes.fromhex(doc["entry"]["leaf_hash"]), doc["entry"]["log_index"], checkpoint.size,
        [bytes.fromhex(h) for h in proof["hashes"]], checkpoint.root_hash,
    )


@pytest.fixture
def cluster(postgres: PostgresServer, tmp_path: Path, keys: dict[str, Key]) -> Iterator[tuple[list[Server], str, str]]:
    """Two servers on one new database: (servers, alice's token, the database URL); the first sequences."""
    url = postgres.database()
    data = tmp_path / "data"
    with _servers(data, url, 2) as servers:
        yield servers, _token(data, url, "alice", keys["alice"]), url


def test_one_sequences_the_other_reads_and_names_it(cluster: tuple[list[Server], str, str], keys: dict[str, Key]) -> None:
    (sequencer, follower), token, _ = cluster
    alice = keys["alice"]
    from kvgraft.verifier import load_public_key

    public = load_public_key(sequencer.data / "registry-key.pub.pem")
    origin = httpx.get(sequencer.url + "/v1/log/key", timeout=10).json()["origin"]

    r = _publish(sequencer, token, artifact("through the sequencer"), alice)
    assert r.status_code == 201, r.text
    first = r.json()
    _check_answer(first, public, origin)

    # The follower has the entry as soon as the publisher has its answer (it catches up on the read).
    index = first["entry"]["log_index"]
    got = httpx.get(f"{follower.url}/v1/entries/{index}", timeout=10)
    assert got.status_code == 200, got.text
    _check_answer(got.json(), public, origin)
    assert httpx.get(f"{follower.url}/v1/entries/{first['entry']['digest']}", timeout=10).status_code == 200
    proof = httpx.get(f"{follower.url}/v1/log/proof/inclusion", params={"index": index, "tree_size": index + 1}, timeout=10)
    assert proof.status_code == 200, proof.text

    # A publish through the follower: 503 with Retry-After, naming the sequencer; nothing logged.
    refused = _publish(follower, token, artifact("through the follower"), alice)
    assert refused.status_code == 503, refused.text
    problem = refused.json()
    assert problem["type"].endswith("/not-sequencer") and refused.headers["retry-after"]
    assert f"the sequencer is process {sequencer.pid}" in problem["detail"]
    assert problem["sequencer"]["pid"] == sequencer.pid and problem["sequencer"]["url"] == sequencer.url
    assert httpx.get(sequencer.url + "/v1/log/key", timeout=10).json()["tree_size"] == index + 1

    # A blob uploaded through the follower is there for the sequencer (one blob store).
    art = artifact("blob through the follower")
    auth = {"Authorization": f"Bearer {token}"}
    assert httpx.put(f"{follower.url}/v1/blobs/{art.digest}", content=art.tensors, headers=auth, timeout=10).status_code == 201
    r = httpx.post(f"{sequencer.url}/v1/entries", content=alice.sign(art.statement), headers=auth, timeout=30)
    assert r.status_code == 201, r.text

    # The follower's latest checkpoint follows within moments (it listens for new heads).
    deadline = time.monotonic() + 5
    while httpx.get(follower.url + "/v1/log/key", timeout=10).json()["tree_size"] != index + 2:
        assert time.monotonic() < deadline, "the follower did not see the new head within 5 s"
        time.sleep(0.05)


def test_a_revocation_through_one_process_holds_in_the_other(
    cluster: tuple[list[Server], str, str], keys: dict[str, Key]
) -> None:
    (sequencer, follower), token, url = cluster
    alice = keys["alice"]
    assert _publish(sequencer, token, artifact("before the revocation"), alice).status_code == 201
    listed = registry_cli("--json", "token", "list", "--data", sequencer.data, "--database", url)
    token_id = json.loads(listed.stdout)["tokens"][0]["token_id"]
    done = registry_cli("--json", "token", "revoke", "--data", sequencer.data, "--database", url, token_id)
    assert done.returncode == 0, done.stderr
    # Was: "(the server was not running)", with two servers running (issue 37).
    summary = json.loads(done.stdout)["summary"]
    assert "every running server refuses it from its next request on" in summary and "not running" not in summary
    # The very next publish is refused by the sequencer (it syncs accounts before each batch).
    r = httpx.post(f"{sequencer.url}/v1/entries", content=alice.sign(artifact("after").statement),
                   headers={"Authorization": f"Bearer {token}"}, timeout=30)
    assert r.status_code == 403, r.text
    deadline = time.monotonic() + 5
    while True:  # the follower forgets the token within moments (notified)
        r = httpx.put(f"{follower.url}/v1/blobs/{sha256_bytes(b'x')}", content=b"x",
                      headers={"Authorization": f"Bearer {token}"}, timeout=10)
        if r.status_code == 403:
            break
        assert time.monotonic() < deadline, f"the follower still takes the revoked token: {r.status_code}"
        time.sleep(0.05)


def test_kill_9_of_the_sequencer_hands_the_lease_over_without_a_fork(
    postgres: PostgresServer, tmp_path: Path, keys: dict[str, Key]
) -> None:
    url = postgres.database()
    data = tmp_path / "data"
    alice = keys["alice"]
    memory = CheckpointMemory(tmp_path / "client-memory")
    with _servers(data, url, 2) as (first, second):
        token = _token(data, url, "alice", alice)
        for i in range(3):
            assert _publish(first, token, artifact(f"before the kill {i}"), alice).status_code == 201
        with RegistryClient(first.url, memory=memory) as client:
            key = registry_key(client, data / "registry-key.pub.pem")
            before, _ = client.signed_head(key)  # verified, and remembered
        assert before.size == 3

        # Publishes in flight while the sequencer dies: each answered 201 is in the log at its index.
        answered: list[dict[str, Any]] = []
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(_publish, first, token, artifact(f"in flight {i}"), alice, timeout=10) for i in range(8)]
            time.sleep(0.05)
            os.kill(first.pid, signal.SIGKILL)
            killed = time.monotonic()
            for f in futures:
                with contextlib.suppress(httpx.HTTPError, AssertionError):
                    r = f.result()
                    if r.status_code == 201:
                        answered.append(r.json())
        first.proc.wait(timeout=10)

        # The other process takes the lease within the bound and publishes on from the last checkpoint.
        while True:
            r = _publish(second, token, artifact("after the kill"), alice)
            if r.status_code == 201:
                break
            assert r.status_code == 503, r.text
            assert time.monotonic() - killed < HANDOVER_BOUND, f"no handover within {HANDOVER_BOUND} s: {r.text}"
            time.sleep(0.1)
        handover = time.monotonic() - killed
        after = r.json()
        assert after["entry"]["log_index"] >= 3 + len(answered)

        # No fork: the remembered client verifies the new head as an extension of the old one, and
        # every entry answered before the kill is in the new tree with the same leaf.
        with RegistryClient(second.url, memory=memory) as client:
            key = registry_key(client, data / "registry-key.pub.pem")
            now, _ = client.signed_head(key)  # consistency proof from the remembered size 3
            assert now.size == after["entry"]["log_index"] + 1
            for doc in answered:
                entry = client.entry(doc["entry"]["log_index"])
                assert entry.entry.leaf_hash == doc["entry"]["leaf_hash"]
        envelopes = httpx.get(f"{second.url}/v1/entries", params={"limit": 100}, timeout=10).json()["items"]
        leaves = [bytes.fromhex(e["leaf_hash"]) for e in envelopes]
        assert len(leaves) == now.size
        for e in envelopes:
            body = httpx.get(f"{second.url}/v1/entries/{e['log_index']}/envelope", timeout=10).content
            assert hash_leaf(body).hex() == e["leaf_hash"]
        assert handover < HANDOVER_BOUND

        # The killed process, started again, serves the whole log and follows the new sequencer.
        with _servers(data, url, 1) as (again,):
            assert httpx.get(again.url + "/v1/log/key", timeout=10).json()["tree_size"] == now.size
            r = _publish(again, token, artifact("to the restarted one"), alice)
            assert r.status_code == 503 and f"the sequencer is process {second.pid}" in r.json()["detail"], r.text


def _publish_until_accepted(server: Server, token: str, alice: Key, what: str, bound: float) -> tuple[dict[str, Any], float]:
    """Publish through ``server`` until it answers 201 (503s meanwhile); the answer and the seconds it took."""
    started = time.monotonic()
    while True:
        with contextlib.suppress(httpx.TransportError):
            r = _publish(server, token, artifact(what), alice, timeout=10)
            if r.status_code == 201:
                return r.json(), time.monotonic() - started
            assert r.status_code == 503, r.text
        assert time.monotonic() - started < bound, f"{server.url} took no publish within {bound} s"
        time.sleep(0.1)


def _refused_naming(server: Server, sequencer: Server, token: str, alice: Key, what: str, *, bound: float) -> None:
    """Publishes through ``server`` are refused (503) until, within ``bound`` seconds, the refusal names ``sequencer``."""
    deadline = time.monotonic() + bound
    while True:
        r = _publish(server, token, artifact(what), alice)
        assert r.status_code == 503, r.text
        if f"the sequencer is process {sequencer.pid}" in r.json()["detail"]:
            return
        assert time.monotonic() < deadline, r.text
        time.sleep(0.1)


def test_a_sequencer_cut_off_from_its_lease_steps_down(
    cluster: tuple[list[Server], str, str], keys: dict[str, Key]
) -> None:
    (first, second), token, url = cluster
    alice = keys["alice"]
    assert _publish(first, token, artifact("before the cut"), alice).status_code == 201
    # End the sequencer's lease session from the database side, as a partition or an operator would.
    with psycopg.connect(url, autocommit=True) as conn:
        ended = conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name LIKE 'kvgraft-registry-lease %' "
            "AND pid IN (SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND objsubid = 2 AND granted)"
        ).fetchall()
    assert ended == [(True,)]
    doc, _ = _publish_until_accepted(second, token, alice, "after the cut", HANDOVER_BOUND)
    # The one cut off refuses at once, and names the new sequencer once it has looked (0.5 s).
    _refused_naming(first, second, token, alice, "to the one cut off", bound=5)
    assert httpx.get(f"{first.url}/v1/entries/{doc['entry']['log_index']}", timeout=10).status_code == 200


def test_a_stopped_sequencer_kept_the_lease_for_good(postgres: PostgresServer, tmp_path: Path, keys: dict[str, Key]) -> None:
    """A SIGSTOPped sequencer keeps its database session, and so the advisory lock: publishes
    stalled until it ran again. Now the follower ends its sessions once its heartbeat is older
    than the expiry (10 s by the database's clock), takes the lease, and the stopped process, run
    again, steps down without committing what it held."""
    url = postgres.database()
    data = tmp_path / "data"
    alice = keys["alice"]
    memory = CheckpointMemory(tmp_path / "client-memory")
    with _servers(data, url, 2) as (first, second):
        token = _token(data, url, "alice", alice)
        assert _publish(first, token, artifact("before the stop"), alice).status_code == 201
        with RegistryClient(first.url, memory=memory) as client:
            before, _ = client.signed_head(registry_key(client, data / "registry-key.pub.pem"))
        os.kill(first.pid, signal.SIGSTOP)
        try:
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                # A publish sent to the stopped process waits in its socket until it runs again.
                held = pool.submit(_publish, first, token, artifact("sent to the stopped one"), alice, timeout=60)
                doc, took = _publish_until_accepted(second, token, alice, "after the stop", 10.0 + HANDOVER_BOUND)
                assert doc["entry"]["log_index"] == 1
                os.kill(first.pid, signal.SIGCONT)
                r = held.result(timeout=60)
        finally:
            os.kill(first.pid, signal.SIGCONT)
        # What the stopped process held was not logged by it: refused, or (sent again by nobody) absent.
        assert r.status_code == 503, r.text
        # The one that was stopped follows, and names the new sequencer.
        _refused_naming(first, second, token, alice, "to the one that was stopped", bound=10)
        with RegistryClient(first.url, memory=memory) as client:
            now, _ = client.signed_head(registry_key(client, data / "registry-key.pub.pem"))  # consistent with before
        assert before.size == 1 and now.size == 2
        assert took > 5.0  # not handed over while the heartbeat was fresh
    log = (data.parent / "server-1.log").read_text()  # the follower's (``_servers``)
    assert f"the sequencer (process {first.pid} on " in log and "has not renewed its lease" in log


def test_a_postgres_restart_is_survived(tmp_path: Path, keys: dict[str, Key]) -> None:
    from tests.registry.postgres import postgres_server

    alice = keys["alice"]
    with postgres_server() as own:  # its own server: the session's keeps running for the other tests
        url = own.database()
        data = tmp_path / "data"
        with _servers(data, url, 1) as (server,):
            token = _token(data, url, "alice", alice)
            before = _publish(server, token, artifact("before the restart"), alice)
            assert before.status_code == 201
            own.restart()
            doc, _ = _publish_until_accepted(server, token, alice, "after the restart", 20)
            assert doc["entry"]["log_index"] == before.json()["entry"]["log_index"] + 1
            got = httpx.get(f"{server.url}/v1/entries/{before.json()['entry']['digest']}", timeout=10)
            assert got.status_code == 200


def test_append_waiting_for_a_held_log_lock_gives_up_with_503(
    postgres: PostgresServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A process holding LOG_LOCK (starting on a long log, or paused) must not stall the sequencer forever."""
    from kvgraft.registry._internal.errors import DatabaseConflictError
    from kvgraft.registry._internal.storage import db as db_module

    monkeypatch.setattr(db_module, "LOG_LOCK_WAIT_SECONDS", 0.5)
    url = postgres.database()
    db = db_module.Database.open(tmp_path, database=url)
    db.release_log()
    try:
        with psycopg.connect(url, autocommit=True) as holder:
            holder.execute("SELECT pg_advisory_lock(%s, %s)", [db_module.LOCK_CLASS, db_module.LOG_LOCK]).fetchall()
            started = time.monotonic()
            with pytest.raises(DatabaseConflictError, match=r"has held the log for more than 0.5 s .*nothing was logged"):
                with db.transaction() as conn:
                    db.dialect.lock_log(conn)
            assert time.monotonic() - started < 10
            # A start (or a take-over) reading the log waits no longer either.
            with pytest.raises(DatabaseConflictError, match=r"has held the log for more than 0.5 s .*the log was not read"):
                db_module.Database.open(tmp_path, database=url)
        with db.transaction() as conn:  # released: the next append gets it at once
            db.dialect.lock_log(conn)
    finally:
        db.close()


def test_append_commit_is_synchronous_even_when_the_server_default_is_off(postgres: PostgresServer, tmp_path: Path) -> None:
    """Publishers are answered once the append commits: a server tuned to synchronous_commit=off
    must not acknowledge that commit before its WAL is flushed."""
    from kvgraft.registry._internal.storage import db as db_module

    url = postgres.database()
    db = db_module.Database.open(tmp_path, database=url)
    db.release_log()
    try:
        db.conn.execute("SET synchronous_commit = off").fetchall()  # what a server-wide tuning gives each session
        with db.transaction() as conn:
            db.dialect.lock_log(conn)
            row = conn.execute("SHOW synchronous_commit").fetchone()
        assert row is not None and row[0] == "on"
        after = db.conn.execute("SHOW synchronous_commit").fetchone()
        assert after is not None and after[0] == "off"  # only the append transaction is changed
    finally:
        db.close()


def _cli_json(*args: str | Path) -> tuple[int, dict[str, Any], str]:
    """``kvgraft --json ARGS``: (exit status, the one JSON line, stderr)."""
    done = registry_cli("--json", *args, timeout=120)
    assert "Traceback" not in done.stderr, done.stderr
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 1, (done.stdout, done.stderr)
    return done.returncode, json.loads(lines[0]), done.stderr


def test_fsck_and_tiles_export_read_a_postgres_registry_while_it_serves(
    cluster: tuple[list[Server], str, str], keys: dict[str, Key], tmp_path: Path
) -> None:
    (sequencer, _), token, url = cluster
    alice = keys["alice"]
    data = sequencer.data
    for i in range(4):
        assert _publish(sequencer, token, artifact(f"before the checks {i}"), alice).status_code == 201

    # Publishes go on while both commands read: each reads one snapshot, never a head ahead of it.
    stop = threading.Event()

    def keep_publishing() -> int:
        n = 0
        while not stop.is_set() and n < 40:
            assert _publish(sequencer, token, artifact(f"during the checks {n}"), alice).status_code == 201
            n += 1
        return n

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        publishing = pool.submit(keep_publishing)
        try:
            for _ in range(2):
                rc, report, stderr = _cli_json("fsck", "--data", data, "--database", url)
                assert rc == 0, (report, stderr)
                assert report["clean"] and report["log"]["tree_size"] >= 4 and report["log"]["checkpoints_checked"] >= 5
            out = tmp_path / "tiles"
            rc, exported, stderr = _cli_json("tiles", "export", "--data", data, "--out", out, "--database", url)
            assert rc == 0, (exported, stderr)
        finally:
            stop.set()
            publishing.result(timeout=120)
    vkey = httpx.get(sequencer.url + "/v1/log/key", timeout=10).json()["vkey"]
    verified = subprocess.run(
        [sys.executable, "-m", "kvgraft.verifier.cli", "--json", "tiles", str(out), "--log-key", vkey],
        capture_output=True, text=True, timeout=120,
    )
    assert verified.returncode == 0, verified.stderr
    assert json.loads(verified.stdout)["tree_size"] == exported["tree_size"] >= 4

    # A changed envelope in the database is named, as on DuckDB.
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("UPDATE entries SET envelope = envelope || '\\x20'::bytea WHERE log_index = 2")
    rc, report, stderr = _cli_json("fsck", "--data", data, "--database", url)
    assert rc == 1 and not report["clean"]
    damaged = [d["name"] for d in report["damaged"]]
    # The entry, every checkpoint over it (roots are recomputed from the envelopes), and the saved head.
    assert damaged[0] == "entry 2" and "checkpoint 2" not in damaged and "log" in damaged
    assert {f"checkpoint {n}" for n in range(3, report["log"]["tree_size"] + 1)} <= set(damaged)
    assert "entry 2" in stderr and "fsck found" in stderr, stderr


def test_fsck_of_a_postgres_database_that_is_not_a_registry_says_so(postgres: PostgresServer, tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    rc, report, stderr = _cli_json("fsck", "--data", data, "--database", postgres.database())
    assert rc == 1, report
    assert "is not a registry database kvgraft can check" in stderr and "kvgraft serve --data DIR --database URL" in stderr


# --- issue 37: the log cannot fork through a follower, a fresh data directory or a restore ----------


def _serve_refused(data: Path, url: str, *extra: str) -> str:
    """``kvgraft serve`` on ``data`` and ``url`` must refuse to start: one line, no traceback; that line."""
    done = registry_cli("serve", "--data", data, "--database", url, "--port", str(free_port()), *extra, timeout=120)
    out = (done.stdout + done.stderr).strip()
    assert done.returncode != 0, out
    assert "Traceback" not in out and len(out.splitlines()) == 1, out
    return out


def _head_file_size(data: Path) -> int:
    return int(json.loads((data / "signed-head.json").read_text())["tree_size"])


def test_a_follower_signed_a_fork_after_the_database_was_restored_regression_postgres_log_fork(
    postgres: PostgresServer, tmp_path: Path, keys: dict[str, Key]
) -> None:
    """Was: a follower never saved the heads it served, and a data directory without signed-head.json
    adopted the database's head with a warning. Restored from an older copy, the database was then
    taken by a restarted follower, which signed a second, different tree at a size already signed.
    Now every process saves what it serves before serving it, and refuses to go below it; a new data
    directory needs --adopt-database-head."""
    url = postgres.database()
    name = url.rsplit("/", 1)[1]
    alice = keys["alice"]
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"

    def copy_key(to: Path) -> None:
        to.mkdir(mode=0o700)
        for f in ("registry-key.pem", "registry-key.pub.pem"):
            (to / f).write_bytes((a / f).read_bytes())
            (to / f).chmod(0o600)

    def both() -> tuple[Server, Server]:
        first = Server(a, tmp_path / "a.log", "--database", url)
        first.wait_ready()
        second = Server(b, tmp_path / "b.log", "--database", url)
        second.wait_ready()
        return first, second

    # A sequencer and a follower, each on a data directory of its own (the same registry key).
    first = Server(a, tmp_path / "a0.log", "--database", url)
    first.wait_ready()
    copy_key(b)
    second = Server(b, tmp_path / "b0.log", "--database", url)  # the log is empty: nothing to adopt
    try:
        second.wait_ready()
        token = _token(a, url, "alice", alice)
        for i in range(2):
            assert _publish(first, token, artifact(f"before the copy {i}"), alice).status_code == 201
    finally:
        second.stop()
        first.stop()
    # The older copy: the database at tree size 2.
    with psycopg.connect(postgres.url(), autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}_copy" TEMPLATE "{name}"')

    first, second = both()
    try:
        for i in range(3):
            assert _publish(first, token, artifact(f"after the copy {i}"), alice).status_code == 201
        deadline = time.monotonic() + 10
        while httpx.get(second.url + "/v1/log/key", timeout=10).json()["tree_size"] != 5:
            assert time.monotonic() < deadline, "the follower did not serve tree size 5"
            time.sleep(0.05)
        # The follower saved the head it serves, in its own data directory, before serving it.
        assert _head_file_size(b) == 5

        # A new data directory on a database with a log is refused, naming the explicit step ...
        copy_key(c)
        line = _serve_refused(c, url)
        assert f"{c} has no signed-head.json, but the shared database already holds a log of 5 entries" in line
        assert "--adopt-database-head" in line and "copy signed-head.json from a running server's data directory" in line
        assert not (c / "signed-head.json").exists()
        # ... which adopts the head loudly, and saves it.
        adopter = Server(c, tmp_path / "c.log", "--database", url, "--adopt-database-head")
        try:
            adopter.wait_ready()
        finally:
            adopter.stop()
        assert "ADOPTING the shared database's log head" in (tmp_path / "c.log").read_text()
        assert _head_file_size(c) == 5
    finally:
        second.stop()  # the follower goes first: it never held the lease
        first.stop()

    # The database is restored from the older copy (tree size 2).
    with psycopg.connect(postgres.url(), autocommit=True) as conn:
        conn.execute(f'DROP DATABASE "{name}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{name}" TEMPLATE "{name}_copy"')

    # No process signs a tree of a size already signed: the follower, the sequencer and the adopter refuse.
    for data in (b, a, c):
        line = _serve_refused(data, url)
        assert "the database holds 2 log entries, but this registry already signed a checkpoint at tree size 5" in line
        assert "restore the PostgreSQL database" in line and "registry.duckdb" not in line, line
        assert _head_file_size(data) == 5
    with psycopg.connect(url) as conn:
        assert conn.execute("SELECT max(tree_size) FROM checkpoints").fetchone() == (2,)


def test_servers_running_while_the_database_is_restored_keep_serving_and_sign_nothing_regression_refused_server(
    postgres: PostgresServer, tmp_path: Path, keys: dict[str, Key]
) -> None:
    """docs/registry.md says a process that finds the database behind what it serves keeps serving
    reads and refuses the lease; the attack saw a refused server exit. Restored from an older copy
    under two running servers: both stay up, serve the head they verified, refuse publishes, and
    no checkpoint is signed past the copy's (a fork)."""
    url = postgres.database()
    name = url.rsplit("/", 1)[1]
    data = tmp_path / "data"
    alice = keys["alice"]
    with _servers(data, url, 2):
        token = _token(data, url, "alice", alice)
    with _servers(data, url, 1) as (server,):
        for i in range(2):
            assert _publish(server, token, artifact(f"in the copy {i}"), alice).status_code == 201
    with psycopg.connect(postgres.url(), autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}_copy" TEMPLATE "{name}"')
    with _servers(data, url, 2) as servers:
        for i in range(2):
            assert _publish(servers[0], token, artifact(f"after the copy {i}"), alice).status_code == 201
        # An envelope whose blob is stored (the blob store is the data directory's), posted after the restore.
        late = artifact("after the restore")
        auth = {"Authorization": f"Bearer {token}"}
        for server in servers:
            r = httpx.put(f"{server.url}/v1/blobs/{late.digest}", content=late.tensors, headers=auth, timeout=30)
            assert r.status_code in (200, 201), r.text
        with psycopg.connect(postgres.url(), autocommit=True) as conn:
            conn.execute(f'DROP DATABASE "{name}" WITH (FORCE)')
            conn.execute(f'CREATE DATABASE "{name}" TEMPLATE "{name}_copy"')
        deadline = time.monotonic() + 5  # ten lease rounds each: every one of them refuses
        while time.monotonic() < deadline:
            for server in servers:
                assert server.proc.poll() is None, "a refused server exited"
                # 503: not-sequencer, or database-unavailable on the first request over a connection the restore ended.
                r = httpx.post(f"{server.url}/v1/entries", content=alice.sign(late.statement), headers=auth, timeout=30)
                assert r.status_code == 503, r.text
                assert httpx.get(server.url + "/v1/log/key", timeout=10).json()["tree_size"] == 4
            time.sleep(0.2)
        with psycopg.connect(url) as conn:
            assert conn.execute("SELECT max(tree_size) FROM checkpoints").fetchone() == (2,)
    logs = "".join((data.parent / f"server-{i}.log").read_text() for i in range(2))
    assert "got the sequencer lease but gives it back" in logs and "the database was rolled back" in logs
