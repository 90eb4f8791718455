"""The data directory: migrations, the registry key and origin, log integrity at start, known answers."""

from __future__ import annotations

import ast
import os
import stat
import subprocess
import sys
from pathlib import Path

import duckdb
import pytest

from kvgraft.registry import RegistrySettings
from kvgraft.registry._internal.admin import admin_session
from kvgraft.registry._internal.datadir import DataDir, SignedHead, read_signed_head, write_signed_head
from kvgraft.registry._internal.errors import (
    AdminUnavailableError,
    ConfigError,
    DatabaseLockedError,
    DataDirError,
    LogIntegrityError,
    LogRollbackError,
    SchemaVersionError,
)
from kvgraft.registry._internal.log.tree import TransparencyLog
from kvgraft.registry._internal.service import Registry
from kvgraft.registry._internal.storage.db import Database
from kvgraft.registry._internal.storage.ddl import Migration, migrations
from kvgraft.verifier import ephemeral_signing_key, generate_private_key
from kvgraft.verifier._internal.tlog import hash_leaf

from ..verifier.test_tlog import KAT_CONSISTENCY, KAT_INCLUSION, KAT_LEAVES, KAT_ROOTS
from .conftest import Key, artifact, harness


def test_a_new_data_dir_is_initialised(tmp_path: Path) -> None:
    data = tmp_path / "data"
    with Registry.open(data, RegistrySettings()) as registry:
        assert registry.log.size == 0
        assert registry.log.origin.startswith("kvgraft-registry/")
        versions = registry.db.query("SELECT version FROM schema_version ORDER BY version")
        assert [v for (v,) in versions] == [m.version for m in migrations()]
    assert stat.S_IMODE((data / "registry-key.pem").stat().st_mode) == 0o600
    assert stat.S_IMODE(data.stat().st_mode) == 0o700
    assert (data / "registry-key.pub.pem").is_file()
    assert (data / "blobs" / "sha256").is_dir()
    assert not (data / "admin.json").exists()


def test_migrations_apply_in_order_once(tmp_path: Path) -> None:
    db = Database.open(tmp_path)
    n = migrations()[-1].version
    try:
        extra = (*migrations(), Migration(n + 1, "add a column", ("ALTER TABLE meta ADD COLUMN note VARCHAR",)))
        assert db.migrate(extra) == [n + 1]
        assert db.migrate(extra) == []
        assert db.schema_version() == n + 1
        broken = (*extra, Migration(n + 2, "broken", ("CREATE TABLE t3 (x INT)", "SELECT * FROM nowhere")))
        with pytest.raises(SchemaVersionError, match=f"migration {n + 2} .broken. failed"):
            db.migrate(broken)
        # The failed step left nothing behind.
        assert db.schema_version() == n + 1
        assert not db.query("SELECT * FROM information_schema.tables WHERE table_name = 't3'")
    finally:
        db.close()
    # This kvgraft knows only versions up to n: a database at version n + 1 is refused.
    with pytest.raises(SchemaVersionError, match=f"has schema version {n + 1}, newer than this kvgraft knows"):
        Database.open(tmp_path)


def _open_in_fresh_process(data: Path, imports: str) -> subprocess.CompletedProcess[str]:
    """``Database.open(data)`` in a fresh interpreter that imported only ``imports``; prints the
    schema version, or the RuntimeError's message."""
    code = (
        f"import sys\nfrom pathlib import Path\n{imports}\n"
        "from kvgraft.registry._internal.storage.db import Database\n"
        "try:\n    print(Database.open(Path(sys.argv[1])).schema_version())\n"
        "except RuntimeError as e:\n    print(e)\n"
    )
    return subprocess.run([sys.executable, "-c", code, str(data)], capture_output=True, text=True, timeout=120)


def test_a_database_opened_before_every_feature_registered_is_refused_regression_ddl_registry(tmp_path: Path) -> None:
    # db.py no longer imports the features that own tables (issue 38: no import circle); a process
    # that imported only db.py must not create a database without the search and cosignature
    # tables and record it as up to date.
    r = _open_in_fresh_process(tmp_path, "")
    assert r.returncode == 0, r.stderr
    assert "schema migrations [2, 3] are not registered" in r.stdout
    assert "search.py, log/cosignatures.py" in r.stdout
    assert not (tmp_path / "registry.duckdb").exists()
    # Imported, they register theirs: the same open makes every table.
    r = _open_in_fresh_process(
        tmp_path, "from kvgraft.registry._internal import search\nfrom kvgraft.registry._internal.log import cosignatures"
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(migrations()[-1].version)


def test_the_origin_is_fixed_at_first_start(tmp_path: Path) -> None:
    data = tmp_path / "data"
    with Registry.open(data, RegistrySettings(origin="registry.example.com/kvgraft")) as registry:
        assert registry.log.origin == "registry.example.com/kvgraft"
    with Registry.open(data, RegistrySettings()) as registry:
        assert registry.log.origin == "registry.example.com/kvgraft"
    with pytest.raises(ConfigError, match="cannot be renamed to 'other.example/log'"), Registry.open(data, RegistrySettings(origin="other.example/log")):
        pass
    with pytest.raises(ConfigError, match="is not acceptable"), Registry.open(tmp_path / "d2", RegistrySettings(origin="has space")):
        pass


def test_a_readable_registry_key_is_refused(tmp_path: Path) -> None:
    data = tmp_path / "data"
    with Registry.open(data, RegistrySettings()):
        pass
    os.chmod(data / "registry-key.pem", 0o644)
    with pytest.raises(DataDirError, match="other users may read it"), Registry.open(data, RegistrySettings()):
        pass


def test_a_replaced_registry_key_is_refused(tmp_path: Path) -> None:
    data = tmp_path / "data"
    with Registry.open(data, RegistrySettings()):
        pass
    os.unlink(data / "registry-key.pem")
    os.unlink(data / "registry-key.pub.pem")
    with pytest.raises(DataDirError, match="is not the key this log's checkpoints are signed with"), Registry.open(data, RegistrySettings()):
        pass


def test_a_log_that_disagrees_with_its_checkpoint_is_not_served(tmp_path: Path, keys: dict[str, Key]) -> None:
    data = tmp_path / "data"
    with harness(data, keys) as h:
        for i in range(3):
            h.publish_artifact(artifact(f"integrity {i}"), keys["alice"])
    conn = duckdb.connect(str(data / "registry.duckdb"))
    conn.execute("UPDATE entries SET leaf_hash = ? WHERE log_index = 1", [b"\x00" * 32])
    conn.close()
    with pytest.raises(LogIntegrityError, match="the stored entries make a tree of size 3 with root"), Registry.open(data, RegistrySettings()):
        pass
    conn = duckdb.connect(str(data / "registry.duckdb"))
    conn.execute("DELETE FROM entries WHERE log_index = 1")
    conn.close()
    with pytest.raises(LogIntegrityError, match="has no entry 1 but has entry 2"), Registry.open(data, RegistrySettings()):
        pass


def test_a_second_opener_waits_then_names_the_holder(tmp_path: Path) -> None:
    import subprocess
    import sys

    holder = subprocess.Popen(
        [sys.executable, "-c", f"import duckdb, sys, time; c = duckdb.connect({str(tmp_path / 'registry.duckdb')!r}); print('ok', flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "ok"
        with pytest.raises(DatabaseLockedError, match=f"is in use by process {holder.pid}"):
            Database.open(tmp_path, wait_seconds=0.3)
        # Admin commands fall back to the server's admin API, and say so when there is none.
        with pytest.raises(AdminUnavailableError, match="no running server left an admin handle"), admin_session(tmp_path, create=False):
            pass
    finally:
        holder.communicate("", timeout=30)


def test_admin_commands_need_an_existing_dir_to_read(tmp_path: Path) -> None:
    with pytest.raises(AdminUnavailableError, match="does not exist"), admin_session(tmp_path / "nope", create=False):
        pass
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataDirError, match="holds no registry database"), admin_session(tmp_path / "empty", create=False):
        pass


# --- the log against RFC 6962 / RFC 9162 known answers ---------------------------------------------


@pytest.fixture
def kat_log():  # type: ignore[no-untyped-def]
    with ephemeral_signing_key(generate_private_key()) as key:
        yield TransparencyLog("kvgraft.test/kat", key, [hash_leaf(d) for d in KAT_LEAVES])


def test_the_log_reproduces_the_known_roots(kat_log: TransparencyLog) -> None:
    for size in range(1, len(KAT_LEAVES) + 1):
        assert kat_log.root(size) == KAT_ROOTS[size - 1]
        assert kat_log.sign(size).root_hash == KAT_ROOTS[size - 1]


@pytest.mark.parametrize(("index", "size", "path"), KAT_INCLUSION)
def test_the_log_serves_the_known_inclusion_proofs(kat_log: TransparencyLog, index: int, size: int, path: list[bytes]) -> None:
    assert kat_log.inclusion(index, size) == {"log_index": index, "tree_size": size, "hashes": [p.hex() for p in path]}


@pytest.mark.parametrize(("old", "new", "proof"), KAT_CONSISTENCY)
def test_the_log_serves_the_known_consistency_proofs(kat_log: TransparencyLog, old: int, new: int, proof: list[bytes]) -> None:
    assert kat_log.consistency(old, new) == {"old_size": old, "new_size": new, "hashes": [p.hex() for p in proof]}


def test_stale_signed_head_write_cannot_move_the_head_back(tmp_path: Path, keys: dict[str, Key]) -> None:
    """A stale sequencer (or a follower starting) sharing the data directory writes an older head
    after a newer one: the file keeps the newer head, so a database rolled back to the older size
    is still refused at start."""
    data = tmp_path / "data"
    with harness(data, keys) as h:
        for i in range(2):
            h.publish_artifact(artifact(f"stale head {i}"), keys["alice"])
        older = read_signed_head(DataDir(data))
        for i in range(2, 4):
            h.publish_artifact(artifact(f"stale head {i}"), keys["alice"])
    assert older is not None and older.tree_size == 2
    assert write_signed_head(DataDir(data), older) is False
    saved = read_signed_head(DataDir(data))
    assert saved is not None and saved.tree_size == 4
    # A newer head is still written (the same size too: the start-up check compares its root).
    assert write_signed_head(DataDir(data), saved) is True


def test_a_different_tree_at_a_saved_size_was_written_over_the_head_regression_signed_head_fork(
    kat_log: TransparencyLog, tmp_path: Path
) -> None:
    """Was: a head of the saved size with another root, or a larger tree that does not hold the saved
    one, replaced signed-head.json (a fork any process sharing the directory could write). Now
    refused, and the file is left as it was."""
    data = DataDir(tmp_path)
    head = kat_log.sign(4)
    saved = SignedHead(kat_log.origin, 4, head.root_hash, head.note)
    assert write_signed_head(data, saved, root_at=kat_log.root) is True
    before = data.signed_head_path.read_bytes()
    with ephemeral_signing_key(generate_private_key()) as key:
        other = TransparencyLog(kat_log.origin, key, [hash_leaf(b"another %d" % i) for i in range(6)])
        for size in (4, 6):
            forked = other.sign(size)
            with pytest.raises(LogRollbackError, match=r"already signed or served the tree of size 4 .* does not extend it"):
                write_signed_head(data, SignedHead(kat_log.origin, size, forked.root_hash, forked.note), root_at=other.root)
    assert data.signed_head_path.read_bytes() == before
    # The same tree, grown, is written.
    grown = kat_log.sign(6)
    assert write_signed_head(data, SignedHead(kat_log.origin, 6, grown.root_hash, grown.note), root_at=kat_log.root) is True


def test_registry_open_builds_the_serving_workers_and_stops_them_regression_lifespan_patching(tmp_path: Path) -> None:
    # The app's lifespan set the sequencer, the lease, the witness hook and the scrubber on the
    # registry after constructing it (issue 38); Registry.open(serving=True) builds them now.
    with Registry.open(tmp_path / "plain", RegistrySettings()) as plain:
        assert plain.publisher.sequencer is None and plain.scrubber is None
    with Registry.open(tmp_path / "served", RegistrySettings(scrub_interval=60), serving=True) as served:
        sequencer, scrubber = served.publisher.sequencer, served.scrubber
        assert sequencer is not None and scrubber is not None
        assert sequencer._thread.is_alive() and scrubber._thread.is_alive()
        assert served.cluster is None  # DuckDB: no lease to hold
    assert not sequencer._thread.is_alive() and not scrubber._thread.is_alive()


def test_the_http_wing_sets_nothing_on_the_registry() -> None:
    http = Path(__file__).resolve().parents[2] / "registry" / "_internal" / "http"
    assigned = [
        f"{path.name}:{node.lineno}"
        for path in sorted(http.glob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign)
        for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
        if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "registry"
        or isinstance(target, ast.Attribute) and isinstance(target.value, ast.Attribute) and target.value.attr == "registry"
    ]
    assert assigned == [], f"set on the registry outside Registry.open: {assigned}"
