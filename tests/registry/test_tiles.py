"""The registry's log as c2sp.org/tlog-tiles: served under /tlog/, exported to a directory, and
read back by an implementation kvgraft did not write.

The independent reader is Go's golang.org/x/mod/sumdb/tlog and sumdb/note (Debian's
golang-golang-x-mod-dev; scripts/system-packages.sh installs it for ``make test``), driven by
tests/registry/tlogtiles/main.go: it verifies the checkpoint, reads every leaf hash through
``tlog.TileHashReader`` (which authenticates each tile against the tree hash), recomputes the root
with ``tlog.TreeHash``, rebuilds every tile of the tree from the leaf hashes alone, and reads
every entry bundle (its own uint16 parser, each entry checked with ``tlog.RecordHash``). Here
Go's tiles are compared byte for byte with the registry's (served, and exported then served by
``python -m http.server``), Go's root with the checkpoint's, and Go's entries with the envelopes
as published (as are the bundles split by the few lines of ``_split_bundle`` below, the spec's
uint16 length prefixes, not kvgraft's parser).

The log has 300 entries: a full level-0 tile and bundle, partial ones of width 44, and a partial
level-1 tile; it is built in-process (the service's publish, without HTTP, for speed), then
served by a real ``kvgraft serve``.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvgraft.registry import export_tiles
from kvgraft.registry._internal.errors import DatabaseLockedError, DataDirError, LogIntegrityError
from kvgraft.verifier import hash_leaf

from .conftest import (
    REPO,
    Harness,
    Key,
    Server,
    artifact,
    free_port,
    harness,
    pre_registration,
    registry_cli,
    running_server,
)

GO_PROGRAM = Path(__file__).parent / "tlogtiles"
#: Debian's golang-golang-x-mod-dev puts golang.org/x/mod here, for GOPATH builds.
GOPATH = Path("/usr/share/gocode")
ENTRIES = 300
DATASET = b'{"question": "1 + 1", "answer": "2"}\n'


# --- the log ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Log:
    """A registry data directory (``data``, served by the tests), an untouched copy of it
    (``pristine``, for exports), its note verifier key, and its envelopes in log order."""

    data: Path
    pristine: Path
    vkey: str
    envelopes: list[bytes]
    note: bytes


def _registry(h: Harness) -> Any:
    return h.client.app.state.registry


def publish_pre_registrations(h: Harness, key: Key, start: int, count: int) -> list[bytes]:
    """``count`` small distinct entries, published through the service (no HTTP): their envelopes."""
    assert h.put_blob(DATASET).status_code in (200, 201)
    registry = _registry(h)
    info = registry.authenticate(f"Bearer {h.tokens['alice']}")
    envelopes = []
    base = pre_registration(DATASET)
    for n in range(start, start + count):
        statement = base.model_copy(update={"predicate": base.predicate.model_copy(update={"settings": {"n": n}})})
        envelope = key.sign(statement)
        assert registry.publisher.publish(envelope, info).created
        envelopes.append(envelope)
    return envelopes


@pytest.fixture(scope="module")
def log(tmp_path_factory: pytest.TempPathFactory, keys: dict[str, Key]) -> Log:
    base = tmp_path_factory.mktemp("tiles")
    data = base / "data"
    with harness(data, keys) as h:
        envelopes = publish_pre_registrations(h, keys["alice"], 0, ENTRIES)
        vkey = h.client.get("/v1/log/key").json()["vkey"]
        note = h.client.get("/v1/log/checkpoint").content
    pristine = base / "pristine"
    shutil.copytree(data, pristine)
    return Log(data, pristine, vkey, envelopes, note)


@pytest.fixture(scope="module")
def server(log: Log) -> Iterator[Server]:
    with running_server(log.data) as s:
        yield s


@pytest.fixture
def data_copy(log: Log, tmp_path: Path) -> Path:
    """A stopped copy of the log's data directory, for the exports."""
    return Path(shutil.copytree(log.pristine, tmp_path / "data"))


# --- the independent reader ------------------------------------------------------------------------


@pytest.fixture(scope="session")
def tlogtiles(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tests/registry/tlogtiles built with Debian's Go and golang.org/x/mod, offline."""
    go = shutil.which("go")
    if go is None or not (GOPATH / "src/golang.org/x/mod/sumdb/tlog").is_dir():
        pytest.fail(
            "Go and golang.org/x/mod are needed to cross-check the tiles: apt-get install -y golang-go "
            "golang-golang-x-mod-dev (scripts/system-packages.sh test installs them)"
        )
    out = tmp_path_factory.mktemp("go")
    binary = out / "tlogtiles"
    env = {
        **os.environ, "GO111MODULE": "off", "GOPATH": str(GOPATH), "GOCACHE": str(out / "cache"), "GOFLAGS": "",
        "CGO_ENABLED": "0", "GOTOOLCHAIN": "local",
    }
    built = subprocess.run([go, "build", "-o", str(binary), "."], cwd=GO_PROGRAM, env=env, capture_output=True,
                           text=True, timeout=300)
    assert built.returncode == 0, built.stderr
    return binary


def go_read(binary: Path, where: str | Path, vkey: str) -> dict[str, Any]:
    """What Go's tlog makes of the tiled log at ``where`` (URL prefix or directory)."""
    ran = subprocess.run([str(binary), "-log", str(where), "-vkey", vkey], capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0, ran.stderr
    return dict(json.loads(ran.stdout))


def _split_bundle(data: bytes) -> list[bytes]:
    """A tlog-tiles entry bundle's entries: big-endian uint16 length, then the bytes (the spec, directly)."""
    entries, at = [], 0
    while at < len(data):
        length = int.from_bytes(data[at : at + 2], "big")
        entries.append(data[at + 2 : at + 2 + length])
        at += 2 + length
    assert at == len(data)
    return entries


def _b64(h: bytes) -> str:
    return base64.b64encode(h).decode()


def _check_against_go(go: dict[str, Any], log: Log, read: Any, *, every_partial: bool) -> None:
    """Go's root, leaves and tiles against the checkpoint, the envelopes, and ``read(path)``'s bytes.

    Go lists every tile the tree ever had, each partial width included; the registry serves them
    all (``every_partial``), an export only those of its tree size (None from ``read``)."""
    checkpoint = read("checkpoint").decode().split("\n")
    assert go["size"] == ENTRIES == int(checkpoint[1])
    assert go["root"] == go["tree_hash"] == checkpoint[2]
    assert go["leaves"] == [_b64(hash_leaf(e)) for e in log.envelopes]
    assert go["entries"] == [_b64(e) for e in log.envelopes]
    compared = 0
    for path, tile in go["tiles"].items():
        ours = read(path)
        if ours is None:
            assert not every_partial, path
            continue
        assert ours == base64.b64decode(tile), path
        compared += 1
    # 300 entries: tile/0/000, tile/0/001.p/1..44 and tile/1/000.p/1.
    assert len(go["tiles"]) == 46 and compared == (46 if every_partial else 3)
    entries = _split_bundle(read("tile/entries/000")) + _split_bundle(read("tile/entries/001.p/44"))
    assert entries == log.envelopes


def test_served_tiles_are_those_go_computes(server: Server, log: Log, tlogtiles: Path) -> None:
    go = go_read(tlogtiles, server.url + "/tlog/", log.vkey)

    def read(path: str) -> bytes | None:
        r = httpx.get(f"{server.url}/tlog/{path}", timeout=30)
        return r.content if r.status_code == 200 else None

    _check_against_go(go, log, read, every_partial=True)


@contextlib.contextmanager
def static_server(directory: Path) -> Iterator[str]:
    """``python -m http.server`` over ``directory`` on 127.0.0.1: a plain static file server."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1", "--directory", str(directory)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}/"
    try:
        deadline = time.monotonic() + 30
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "checkpoint", timeout=2).status_code == 200:
                    break
            assert time.monotonic() < deadline and proc.poll() is None, "http.server did not start"
            time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_an_export_served_statically_is_the_log_go_reads(data_copy: Path, log: Log, tlogtiles: Path, tmp_path: Path) -> None:
    out = tmp_path / "tiles"
    done = registry_cli("tiles", "export", "--data", data_copy, "--out", out, "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert (report["tree_size"], report["written"], report["kept"], report["skipped_bundles"]) == (ENTRIES, 6, 0, [])
    files = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    assert files == ["checkpoint", "tile/0/000", "tile/0/001.p/44", "tile/1/000.p/1", "tile/entries/000", "tile/entries/001.p/44"]
    assert (out / "checkpoint").read_bytes() == log.note
    with static_server(out) as url:
        go = go_read(tlogtiles, url, log.vkey)
        verified = subprocess.run(
            [sys.executable, "-m", "kvgraft.verifier.cli", "--json", "tiles", url, "--log-key", log.vkey],
            capture_output=True, text=True, timeout=120, cwd=REPO,
        )
    assert go == go_read(tlogtiles, out, log.vkey)

    def read(path: str) -> bytes | None:
        return (out / path).read_bytes() if (out / path).is_file() else None

    _check_against_go(go, log, read, every_partial=False)
    assert verified.returncode == 0, verified.stderr
    doc = json.loads(verified.stdout)
    assert doc["tree_size"] == ENTRIES and doc["tiles"] == 3 and doc["bundles"] == 2
    assert [e["digest"] for e in doc["entries"]] == ["sha256:" + hashlib.sha256(e).hexdigest() for e in log.envelopes]


# --- HTTP ------------------------------------------------------------------------------------------


def _problem(r: httpx.Response, status: int, slug: str) -> dict[str, Any]:
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/problem+json"
    doc = dict(r.json())
    assert doc["type"] == f"https://kvgraft.dev/problems/{slug}", doc
    return doc


def test_the_checkpoint_is_the_api_checkpoint_as_text(server: Server) -> None:
    r = httpx.get(server.url + "/tlog/checkpoint")
    assert r.status_code == 200 and r.headers["content-type"] == "text/plain; charset=utf-8"
    assert r.headers["cache-control"] == "no-cache"
    assert r.content == httpx.get(server.url + "/v1/log/checkpoint").content
    assert r.text.split("\n")[1] == str(ENTRIES)


def test_tiles_and_bundles_are_cached_as_the_spec_says(server: Server, log: Log) -> None:
    url = server.url + "/tlog/"
    full = httpx.get(url + "tile/0/000")
    assert full.status_code == 200 and full.headers["content-type"] == "application/octet-stream"
    assert full.headers["cache-control"] == "public, max-age=31536000, immutable"
    assert full.headers["etag"] == f'"sha256:{hashlib.sha256(full.content).hexdigest()}"'
    assert full.content == b"".join(hash_leaf(e) for e in log.envelopes[:256])
    again = httpx.get(url + "tile/0/000", headers={"If-None-Match": full.headers["etag"]})
    assert again.status_code == 304 and again.headers["etag"] == full.headers["etag"] and again.content == b""
    head = httpx.head(url + "tile/0/000")
    assert head.status_code == 200 and head.headers["content-length"] == "8192" and head.content == b""

    partial = httpx.get(url + "tile/0/001.p/44")
    assert partial.status_code == 200 and partial.headers["cache-control"] == "public, max-age=60"
    assert len(partial.content) == 44 * 32
    # Every partial width a checkpoint produced is still served, and is a prefix of the widest.
    older = httpx.get(url + "tile/0/001.p/10")
    assert older.status_code == 200 and older.content == partial.content[: 10 * 32]
    assert httpx.get(url + "tile/0/000.p/7").content == full.content[: 7 * 32]

    bundle = httpx.get(url + "tile/entries/000")
    assert bundle.status_code == 200 and bundle.headers["content-type"] == "application/octet-stream"
    assert bundle.headers["cache-control"] == "public, max-age=31536000, immutable"
    # A bundle's ETag is its level-0 tile's digest: it fixes every entry, and costs no envelope read.
    assert bundle.headers["etag"] == f'"entries-sha256:{hashlib.sha256(full.content).hexdigest()}"'
    assert _split_bundle(bundle.content) == log.envelopes[:256]
    assert httpx.get(url + "tile/entries/000", headers={"If-None-Match": bundle.headers["etag"]}).status_code == 304
    tail = httpx.get(url + "tile/entries/001.p/44")
    assert tail.headers["cache-control"] == "public, max-age=60" and _split_bundle(tail.content) == log.envelopes[256:]
    assert httpx.head(url + "tile/entries/001.p/44").headers["content-length"] == str(len(tail.content))


@pytest.mark.parametrize(
    ("path", "detail"),
    [
        ("tile/0/001.p/45", "tile/0/001.p/45 is not in this log yet: it needs a tree of 301 entries and the latest checkpoint has 300"),
        ("tile/0/001", "tile/0/001 is not in this log yet: it needs a tree of 512 entries"),
        ("tile/1/000.p/2", "tile/1/000.p/2 is not in this log yet: it needs a tree of 512 entries"),
        ("tile/entries/002.p/1", "tile/entries/002.p/1 is not in this log yet: it needs a tree of 513 entries"),
        ("tile/00/000", "'tile/00/000' is not a tlog-tiles path: the level '00'"),
        ("tile/0/1", "'tile/0/1' is not a tlog-tiles path: N must be 3-digit elements"),
        ("tile/0/000.p/0", "the partial width '0' is not a decimal 1 to 255"),
        ("tile/0/000.p/256", "the partial width '256'"),
        ("tile/8/0/000", "is not a tlog-tiles path"),
        ("tile/data/000", "the level 'data'"),
        ("tile/0/000/", "N must be 3-digit elements"),  # the router alone would drop the slash
        ("tile//0/000", "the level ''"),  # and merge the "//"
        ("tile/0/%2e%2e/000", "N must be 3-digit elements"),
        ("tile/0/%30%30%30", "N must be 3-digit elements"),  # 000, percent-encoded
        ("tile/entries/x000/000", "it is not canonical; the same tile is tile/entries/000"),
    ],
)
def test_tiles_the_log_does_not_have_are_404(server: Server, path: str, detail: str) -> None:
    doc = _problem(httpx.get(f"{server.url}/tlog/{path}"), 404, "tile-not-found")
    assert detail in doc["detail"]
    assert "fetch /tlog/checkpoint first" in doc["hint"] or "tile/<L>/<N>" in doc["hint"]


def test_the_tile_routes_are_not_in_the_openapi_document(server: Server) -> None:
    paths = httpx.get(server.url + "/schema/openapi.json").json()["paths"]
    assert not any(p.startswith("/tlog") for p in paths)
    assert "/v1/log/checkpoint" in paths


def test_export_is_refused_while_the_server_holds_the_database(server: Server, log: Log, tmp_path: Path) -> None:
    out = tmp_path / "tiles"
    with pytest.raises(DatabaseLockedError, match="kvgraft tiles export needs it to itself") as e:
        export_tiles(log.data, out)
    assert e.value.hint is not None and "/tlog/" in e.value.hint
    done = registry_cli("tiles", "export", "--data", log.data, "--out", out)
    assert done.returncode == 1
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvgraft: DatabaseLockedError: the registry database "), done.stderr
    assert not out.exists()


# --- exports ---------------------------------------------------------------------------------------


def _files(out: Path) -> set[str]:
    return {str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()}


def test_export_again_keeps_full_tiles_and_retires_superseded_partials(
    data_copy: Path, log: Log, keys: dict[str, Key], tmp_path: Path, tlogtiles: Path
) -> None:
    out = tmp_path / "tiles"
    first = export_tiles(data_copy, out)
    assert (first.tree_size, first.previous_size, len(first.written)) == (ENTRIES, None, 6)
    # Unchanged log: everything is verified and kept; only the checkpoint is written (last) again.
    same = export_tiles(data_copy, out)
    assert same.previous_size == ENTRIES and same.written == ["checkpoint"] and len(same.kept) == 5
    with harness(data_copy, keys) as h:
        more = publish_pre_registrations(h, keys["alice"], ENTRIES, 515 - ENTRIES)
    grown = export_tiles(data_copy, out)
    assert (grown.previous_size, grown.tree_size) == (ENTRIES, 515)
    assert set(grown.kept) == {"tile/0/000", "tile/entries/000"}
    assert set(grown.written) == {
        "tile/entries/001", "tile/entries/002.p/3", "tile/0/001", "tile/0/002.p/3", "tile/1/000.p/2", "checkpoint",
    }
    # Tile 1 is full now: its partials (and the partial bundle) go; tile/1/000.p/1 stays (level 1 is not full).
    assert sorted(grown.removed) == ["tile/0/001.p", "tile/entries/001.p"]
    assert _files(out) == {
        "checkpoint", "tile/0/000", "tile/0/001", "tile/0/002.p/3", "tile/1/000.p/1", "tile/1/000.p/2",
        "tile/entries/000", "tile/entries/001", "tile/entries/002.p/3",
    }
    go = go_read(tlogtiles, out, log.vkey)
    assert go["size"] == 515 and go["leaves"] == [_b64(hash_leaf(e)) for e in log.envelopes + more]
    assert go["entries"] == [_b64(e) for e in log.envelopes + more]
    for path in _files(out) - {"checkpoint"}:
        if not path.startswith("tile/entries/"):
            assert (out / path).read_bytes() == base64.b64decode(go["tiles"][path]), path
    bundles = [_split_bundle((out / p).read_bytes()) for p in ("tile/entries/000", "tile/entries/001", "tile/entries/002.p/3")]
    assert sum(bundles, []) == log.envelopes + more


def test_export_refuses_a_directory_holding_another_log(data_copy: Path, tmp_path: Path) -> None:
    out = tmp_path / "tiles"
    export_tiles(data_copy, out)
    tile = out / "tile/0/000"
    good = tile.read_bytes()
    tile.write_bytes(good[:-1] + bytes([good[-1] ^ 1]))
    with pytest.raises(LogIntegrityError, match="is not this log's tile/0/000: the directory holds another log's files"):
        export_tiles(data_copy, out)
    assert tile.read_bytes() != good  # never overwritten
    tile.write_bytes(good)
    checkpoint = (out / "checkpoint").read_bytes()
    (out / "checkpoint").write_bytes(checkpoint.replace(b"\n300\n", b"\n299\n"))
    with pytest.raises(LogIntegrityError, match="is not a checkpoint of this log .* signed by this registry"):
        export_tiles(data_copy, out)
    # A partial tile is rewritten (its name fixes its bytes; the read-back proves them).
    (out / "checkpoint").write_bytes(checkpoint)
    (out / "tile/0/001.p/44").write_bytes(b"\x00" * 44 * 32)
    assert "tile/0/001.p/44" in export_tiles(data_copy, out).written


# --- entries too large for a bundle ----------------------------------------------------------------


def test_an_entry_over_65535_bytes_has_no_bundle_and_says_where_it_is(
    tmp_path: Path, keys: dict[str, Key], capsys: pytest.CaptureFixture[str]
) -> None:
    data = tmp_path / "data"
    with harness(data, keys) as h:
        small = publish_pre_registrations(h, keys["alice"], 0, 1)
        big = artifact("word " * 14_000)
        h.publish_artifact(big, keys["alice"])
        small += publish_pre_registrations(h, keys["alice"], 1, 1)
        vkey = h.client.get("/v1/log/key").json()["vkey"]
        envelope = h.client.get("/v1/entries/1/envelope").content
        assert len(envelope) > 65_535
        assert _split_bundle(h.client.get("/tlog/tile/entries/000.p/1").content) == small[:1]
        for path in ("tile/entries/000.p/2", "tile/entries/000.p/3"):
            doc = _problem(h.client.get("/tlog/" + path), 404, "entry-too-large-for-tiles")
            assert doc["detail"] == (
                f"{path} would hold entry 1, whose envelope is {len(envelope)} bytes: a tlog-tiles entry bundle holds "
                "entries of at most 65535 bytes (a uint16 length), so this bundle does not exist"
            )
            assert doc["hint"].startswith("read entry 1 at /v1/entries/1/envelope")
            assert (doc["entry"], doc["size"], doc["limit"], doc["envelope_url"]) == (1, len(envelope), 65535, "/v1/entries/1/envelope")
        # The level-0 tile still proves the entry served elsewhere.
        level0 = h.client.get("/tlog/tile/0/000.p/3").content
        assert level0[32:64] == hash_leaf(h.client.get(doc["envelope_url"]).content)

    out = tmp_path / "tiles"
    report = export_tiles(data, out)
    assert [s.document() for s in report.skipped] == [{
        "bundle": "tile/entries/000.p/3", "entry": 1, "size": len(envelope), "limit": 65535,
        "envelope_url": "/v1/entries/1/envelope",
    }]
    assert f"note: tile/entries/000.p/3 not written: entry 1 is {len(envelope)} bytes" in report.summary()
    assert _files(out) == {"checkpoint", "tile/0/000.p/3"}

    from kvgraft.verifier.cli import main as verify_main

    assert verify_main(["tiles", str(out), "--log-key", vkey]) == 1
    assert "TileError: " in capsys.readouterr().err
    assert verify_main(["--json", "tiles", str(out), "--log-key", vkey, "--allow-missing-bundles"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["missing_bundles"] == ["tile/entries/000.p/3"] and doc["entries"] == []


def test_export_refuses_a_database_it_cannot_read_read_only(data_copy: Path, tmp_path: Path) -> None:
    import duckdb

    conn = duckdb.connect(str(data_copy / "registry.duckdb"))
    newest = conn.execute("SELECT max(version) FROM schema_version").fetchone()[0]
    conn.execute("DELETE FROM schema_version WHERE version = ?", [newest])
    conn.close()
    with pytest.raises(DataDirError, match=f"has schema version {newest - 1}; this kvgraft reads version {newest}") as e:
        export_tiles(data_copy, tmp_path / "tiles")
    assert e.value.hint is not None and "to migrate it, then export" in e.value.hint
    with pytest.raises(DataDirError, match="holds no registry database"):
        export_tiles(tmp_path / "nothing", tmp_path / "tiles")
    assert not (tmp_path / "tiles").exists()
