"""c2sp.org/tlog-tiles: paths, tile contents, entry bundles, and the tile reader (kvgraft.verifier).

The vectors are the spec's own (c2sp.org/tlog-tiles: index 1234067 is x001/x234/067; a tree of
70,000 entries; a tree of 256) and Go's tlog package documentation (tile.go: 123456789 is
x123/x456/789). The tiles the registry serves are cross-checked against Go's tlog in
tests/registry/test_tiles.py.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import json
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from kvgraft.verifier import (
    MAX_ENTRY_BYTES,
    TILE_WIDTH,
    Checkpoint,
    DirectoryTileSource,
    HttpTileSource,
    LogProofError,
    MalformedInputError,
    MerkleTree,
    Tile,
    TileError,
    bundles_for_size,
    encode_bundle,
    ephemeral_signing_key,
    format_vkey,
    generate_private_key,
    hash_leaf,
    merkle_root,
    parse_bundle,
    parse_tile_path,
    read_tiled_log,
    sign_checkpoint,
    tile_data,
    tiles_for_size,
)
from kvgraft.verifier.cli import ExitCode, main

ORIGIN = "example.com/tiles-test"


# --- paths ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("tile", "path"),
    [
        (Tile(0, 0), "tile/0/000"),
        (Tile(0, 1234067), "tile/0/x001/x234/067"),  # the spec's example
        (Tile(4, 1234067, 1), "tile/4/x001/x234/067.p/1"),  # Go's tile.go example, at height 8
        (Tile(1, 123456789), "tile/1/x123/x456/789"),  # Go's path encoding comment
        (Tile(2, 1000, 255), "tile/2/x001/000.p/255"),
        (Tile(None, 5, 7), "tile/entries/005.p/7"),
        (Tile(None, 999), "tile/entries/999"),
    ],
)
def test_paths_encode_and_parse_back(tile: Tile, path: str) -> None:
    assert tile.path == path
    assert parse_tile_path(path) == tile


@pytest.mark.parametrize(
    ("path", "why"),
    [
        ("tile/00/000", "the level '00' is not 'entries' or a decimal 0 to 63"),
        ("tile/64/000", "the level '64'"),
        ("tile/-1/000", "the level '-1'"),
        ("tile/data/000", "the level 'data'"),
        ("tile/8/0/000", "N must be 3-digit elements"),  # Go's own spelling, with the height
        ("tile/0/0", "N must be 3-digit elements"),
        ("tile/0/0000", "N must be 3-digit elements"),
        ("tile/0/x000", "N must be 3-digit elements"),
        ("tile/0/001/234", "N must be 3-digit elements"),
        ("tile/0/x001/x234", "N must be 3-digit elements"),
        ("tile/0/x000/001", "it is not canonical; the same tile is tile/0/001"),
        ("tile/0/000.p/0", "the partial width '0'"),
        ("tile/0/000.p/256", "the partial width '256'"),
        ("tile/0/000.p/07", "the partial width '07'"),
        ("tile/0/000.p", "N must be 3-digit elements"),
        ("tile/0/000.p/5/", "N must be 3-digit elements"),
        ("tile/0/000/", "N must be 3-digit elements"),
        ("tile/0", "it does not start with tile/<L>/"),
        ("tiles/0/000", "it does not start with tile/<L>/"),
        ("/tile/0/000", "it does not start with tile/<L>/"),
        ("tile/0/x001/x002/x003/x004/x005/x006/x007/008", "N has 8 elements"),
        ("tile/8/000", "no tree of at most 2^64-1 entries has tile/8/000"),
        ("tile/7/000", "no tree of at most 2^64-1 entries has tile/7/000"),
        ("tile/6/255", "no tree of at most 2^64-1 entries has tile/6/255"),
        ("tile/0/x072/x057/x594/x037/x927/935", "no tree of at most 2^64-1 entries"),
    ],
)
def test_bad_paths_are_refused_saying_why(path: str, why: str) -> None:
    with pytest.raises(MalformedInputError, match="is not a tlog-tiles path") as e:
        parse_tile_path(path)
    assert why in e.value.message


def test_the_largest_tiles_of_a_uint64_tree() -> None:
    # A tree of 2^64-1 entries has a partial level-7 tile of width 255 and no level 8.
    assert parse_tile_path("tile/7/000.p/255").min_tree_size == 255 << 56
    assert parse_tile_path("tile/6/254").min_tree_size == 255 << 56
    assert parse_tile_path("tile/0/x072/x057/x594/x037/x927/934").min_tree_size == (1 << 64) - 256


def test_the_spec_example_of_a_tree_of_70000() -> None:
    tiles = tiles_for_size(70_000)
    by_level = {level: [t for t in tiles if t.level == level] for level in (0, 1, 2)}
    assert len(tiles) == sum(len(v) for v in by_level.values())
    assert [t.is_full for t in by_level[0]].count(True) == 273
    assert by_level[0][-1] == Tile(0, 273, 112)
    assert by_level[1] == [Tile(1, 0), Tile(1, 1, 17)]
    assert by_level[2] == [Tile(2, 0, 1)]
    assert bundles_for_size(70_000)[-1] == Tile(None, 273, 112)
    # "a tree of size 256 will be represented by a full level 0 tile and a partial level 1 tile of width 1"
    assert tiles_for_size(256) == [Tile(0, 0), Tile(1, 0, 1)]
    assert tiles_for_size(0) == [] and bundles_for_size(0) == []


def test_min_tree_size_is_when_a_tile_first_exists() -> None:
    assert Tile(0, 0, 1).min_tree_size == 1
    assert Tile(0, 1).min_tree_size == 512
    assert Tile(1, 0, 1).min_tree_size == 256
    assert Tile(1, 1, 17).min_tree_size == 273 * 256
    assert Tile(None, 2, 3).min_tree_size == 515 and Tile(None, 2, 3).start == 512
    for size in (1, 255, 256, 300, 70_000):
        assert all(t.min_tree_size <= size for t in [*tiles_for_size(size), *bundles_for_size(size)])


# --- contents ------------------------------------------------------------------------------------


def _leaves(n: int) -> list[bytes]:
    return [hash_leaf(i.to_bytes(4, "big")) for i in range(n)]


def test_tile_hashes_are_the_spec_formula() -> None:
    # MTH(D[(n * 256 + i) * 256**l : (n * 256 + i + 1) * 256**l]) for i in 0..width-1.
    leaves = _leaves(70_000)
    tree = MerkleTree(leaves)
    for tile in (Tile(0, 3), Tile(0, 273, 112), Tile(1, 0), Tile(1, 1, 17), Tile(2, 0, 1)):
        span = TILE_WIDTH**tile.hash_level
        first = tile.index * TILE_WIDTH
        want = b"".join(merkle_root(leaves[(first + i) * span : (first + i + 1) * span]) for i in range(tile.width))
        assert tile_data(tree, tile) == want, tile
    # A partial tile is a prefix of the wider ones (and of the full tile) at the same index.
    assert tile_data(tree, Tile(0, 2, 5)) == tile_data(tree, Tile(0, 2))[: 5 * 32]
    with pytest.raises(ValueError, match="is not in a tree of size 70000"):
        tile_data(tree, Tile(1, 1, 18))


def test_bundles_round_trip_at_the_length_limit() -> None:
    entries = [b"", b"a", bytes(range(256)) * 3, b"x" * MAX_ENTRY_BYTES]
    data = encode_bundle(entries)
    assert data[:2] == b"\x00\x00" and data[2:5] == b"\x00\x01a"
    assert parse_bundle(Tile(None, 0, 4), data) == entries
    with pytest.raises(ValueError, match="entry 1 is 65536 bytes; an entry bundle holds entries of at most 65535"):
        encode_bundle([b"", b"x" * (MAX_ENTRY_BYTES + 1)])


@pytest.mark.parametrize(
    ("data", "width", "message"),
    [
        (b"\x00\x01a\x00", 2, "tile/entries/000.p/2 ends after 1 of its 2 entries: entry 1 has no length prefix"),
        (b"\x00\x05abc", 1, "entry 0 claims 5 bytes but only 3 remain"),
        (b"\x00\x01a\x00\x00z", 2, "has 1 byte(s) after its 2 entries"),
        (b"", 1, "ends after 0 of its 1 entries"),
    ],
)
def test_malformed_bundles_are_refused(data: bytes, width: int, message: str) -> None:
    with pytest.raises(TileError) as e:
        parse_bundle(Tile(None, 0, width), data)
    assert message in e.value.message


# --- the reader ----------------------------------------------------------------------------------


@dataclass
class TiledDir:
    root: Path
    vkey: str
    entries: list[bytes]

    def path(self, tile: Tile | str) -> Path:
        return self.root / (tile if isinstance(tile, str) else tile.path)


def write_tiled_log(root: Path, entries: list[bytes]) -> TiledDir:
    """A tiled log written by hand from the spec: checkpoint, every tile and every bundle."""
    key = generate_private_key()
    tree = MerkleTree([hash_leaf(e) for e in entries])
    for tile in tiles_for_size(tree.size):
        _write(root / tile.path, tile_data(tree, tile))
    for bundle in bundles_for_size(tree.size):
        _write(root / bundle.path, encode_bundle(entries[bundle.start : bundle.start + bundle.width]))
    with ephemeral_signing_key(key) as signer:
        note = sign_checkpoint(Checkpoint(ORIGIN, tree.size, tree.root()), ORIGIN, signer)
    _write(root / "checkpoint", note)
    return TiledDir(root, format_vkey(ORIGIN, key.public_key()), entries)


def _write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


@pytest.fixture
def tiled(tmp_path: Path) -> Iterator[TiledDir]:
    # 600 entries: full and partial level-0 tiles and bundles, a partial level-1 tile.
    yield write_tiled_log(tmp_path / "log", [f"entry {i} ".encode() * (1 + i % 7) for i in range(600)])


def test_the_reader_verifies_every_tile_and_entry(tiled: TiledDir) -> None:
    seen: list[tuple[int, bytes]] = []
    log = read_tiled_log(DirectoryTileSource(tiled.root), tiled.vkey, on_entry=lambda i, e: seen.append((i, e)))
    assert log.checkpoint.size == 600 and log.checkpoint.origin == ORIGIN
    assert log.checkpoint.root_hash == merkle_root([hash_leaf(e) for e in tiled.entries])
    assert (log.tiles, log.bundles, log.missing) == (4, 3, ())
    assert seen == list(enumerate(tiled.entries))
    assert [e.digest for e in log.entries] == ["sha256:" + hashlib.sha256(e).hexdigest() for e in tiled.entries]
    assert "at tree size 600" in log.summary() and "4 tile(s) and 3 entry bundle(s) verified, 600 entries read" in log.summary()


def _flip(path: Path, at: int = 0) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 1
    path.write_bytes(bytes(data))


def _refused(tiled: TiledDir, message: str, error: type[Exception] = TileError, **kwargs: object) -> None:
    with pytest.raises(error) as e:
        read_tiled_log(DirectoryTileSource(tiled.root), tiled.vkey, **kwargs)  # type: ignore[arg-type]
    assert message in str(e.value), str(e.value)


def test_a_tampered_level_0_tile_is_refused(tiled: TiledDir) -> None:
    _flip(tiled.path("tile/0/001"), 100)
    _refused(tiled, "the level-0 tiles at")
    _refused(tiled, "a level-0 tile was altered, or belongs to another tree")


def test_a_tampered_level_1_tile_is_refused(tiled: TiledDir) -> None:
    _flip(tiled.path("tile/1/000.p/2"), 40)
    _refused(tiled, "tile/1/000.p/2 at")
    _refused(tiled, "does not hold the hashes of the level-0 tiles below it: it was altered")


def test_a_tampered_bundle_entry_is_refused(tiled: TiledDir) -> None:
    path = tiled.path("tile/entries/001")
    _flip(path, 2 + 3)  # a byte of entry 256's body, not its length
    _refused(tiled, "entry 256 in tile/entries/001 at")
    _refused(tiled, "does not hash to leaf 256 of the level-0 tile: the bundle was altered")


def test_truncated_and_missing_tiles_are_refused(tiled: TiledDir) -> None:
    tile = tiled.path("tile/0/002.p/88")
    tile.write_bytes(tile.read_bytes()[:-1])
    _refused(tiled, "tile/0/002.p/88 is 2815 bytes, not the 2816 of 88 hash(es) its width needs")
    tile.unlink()
    _refused(tiled, "has no tile/0/002.p/88, which a tree of size 600 or more has")
    bundle = tiled.path("tile/entries/000")
    bundle.write_bytes(bundle.read_bytes() + b"\x00")
    (tiled.root / "checkpoint").unlink()
    _refused(tiled, "has no checkpoint")


def test_a_truncated_bundle_is_refused(tiled: TiledDir) -> None:
    bundle = tiled.path("tile/entries/002.p/88")
    bundle.write_bytes(bundle.read_bytes()[:-3])
    _refused(tiled, "tile/entries/002.p/88: entry 599 claims")


def test_a_checkpoint_by_another_key_or_altered_is_refused(tiled: TiledDir, tmp_path: Path) -> None:
    other = write_tiled_log(tmp_path / "other", tiled.entries)
    (tiled.root / "checkpoint").write_bytes((other.root / "checkpoint").read_bytes())
    _refused(tiled, f"the note has no signature by {ORIGIN}+", LogProofError)
    note = (other.root / "checkpoint").read_bytes().replace(b"\n600\n", b"\n599\n")
    (other.root / "checkpoint").write_bytes(note)
    _refused(other, "does not verify over the note text: the note was altered after signing", LogProofError)


def test_a_log_larger_than_the_limit_is_refused_before_any_tile(tiled: TiledDir) -> None:
    for tile in tiles_for_size(600):
        tiled.path(tile).unlink()
    _refused(tiled, "is for 600 entries, more than the 599 this reader accepts", max_entries=599)


def test_missing_bundles_fail_unless_allowed(tiled: TiledDir) -> None:
    tiled.path("tile/entries/001").unlink()
    _refused(tiled, "has no tile/entries/001 (entries 256 to 511)")
    _refused(tiled, "a log cannot bundle an entry over 65535 bytes")
    log = read_tiled_log(DirectoryTileSource(tiled.root), tiled.vkey, allow_missing_bundles=True)
    assert log.missing == (Tile(None, 1),) and len(log.entries) == 600 - 256
    assert "256 entries in 1 missing bundle(s) not read" in log.summary()


def test_the_origin_is_checked_when_given(tiled: TiledDir) -> None:
    log = read_tiled_log(DirectoryTileSource(tiled.root), tiled.vkey, origin=ORIGIN, keep_entries=False)
    assert log.entries == () and log.read == 600 and "600 entries read" in log.summary()
    _refused(tiled, f"the checkpoint is for log {ORIGIN!r}, not 'example.com/other'", LogProofError, origin="example.com/other")


# --- over HTTP -----------------------------------------------------------------------------------


@contextlib.contextmanager
def http_log(root: Path, body: Callable[[str, bytes], tuple[bytes, str]]) -> Iterator[str]:
    """A real HTTP server on 127.0.0.1 over ``root``; ``body(path, file bytes)`` gives what to send
    and its Content-Encoding. Yields the URL prefix."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            path = self.path.lstrip("/")
            target = root / path
            if not target.is_file():
                self.send_error(404)
                return
            data, encoding = body(path, target.read_bytes())
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            if encoding:
                self.send_header("Content-Encoding", encoding)
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def test_the_reader_takes_gzip_as_the_spec_asks(tiled: TiledDir) -> None:
    with http_log(tiled.root, lambda path, data: (gzip.compress(data), "gzip")) as url:
        with HttpTileSource(url, timeout=10) as source:
            log = read_tiled_log(source, tiled.vkey)
    assert log.checkpoint.size == 600 and log.read == 600 and log.bundles == 3


@pytest.mark.parametrize(
    ("body", "message"),
    [
        # 8 KiB of gzip that inflates to 8 MiB: refused at the tile limit, never inflated whole.
        (lambda data: (gzip.compress(b"\0" * (8 << 20)), "gzip"), "more than the 8192 bytes a tile can be"),
        (lambda data: (gzip.compress(data)[:-12], "gzip"), "the gzip body ends early (truncated)"),
        (lambda data: (b"\x1f\x8b" + b"not gzip" * 4, "gzip"), "the gzip body is corrupt"),
        (lambda data: (data, "br"), "answered in Content-Encoding 'br', which this reader did not ask for"),
    ],
)
def test_the_reader_refuses_bad_encodings(
    tiled: TiledDir, body: Callable[[bytes], tuple[bytes, str]], message: str
) -> None:
    def send(path: str, data: bytes) -> tuple[bytes, str]:
        return body(data) if path == "tile/0/000" else (data, "")

    with http_log(tiled.root, send) as url, HttpTileSource(url, timeout=10) as source:
        with pytest.raises(MalformedInputError) as e:
            read_tiled_log(source, tiled.vkey)
    assert f"GET {url}tile/0/000" in e.value.message and message in e.value.message


def test_an_empty_log_reads_as_empty(tmp_path: Path) -> None:
    tiled = write_tiled_log(tmp_path / "empty", [])
    log = read_tiled_log(DirectoryTileSource(tiled.root), tiled.vkey)
    assert (log.checkpoint.size, log.tiles, log.bundles, log.entries) == (0, 0, 0, ())


# --- kvgraft-verify tiles -------------------------------------------------------------------------


def test_kvgraft_verify_tiles_reads_a_directory(tiled: TiledDir, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["tiles", str(tiled.root), "--log-key", tiled.vkey]) == ExitCode.OK
    out = capsys.readouterr().out
    assert out.startswith(f"OK: tlog-tiles log {ORIGIN} at tree size 600, root ")
    assert main(["--json", "tiles", str(tiled.root), "--log-key", tiled.vkey]) == ExitCode.OK
    doc = json.loads(capsys.readouterr().out)
    assert doc["ok"] and doc["verified"] == "tiles" and doc["tree_size"] == 600
    assert doc["entries"][5] == {"index": 5, "size": len(tiled.entries[5]), "digest": "sha256:" + hashlib.sha256(tiled.entries[5]).hexdigest()}


def test_kvgraft_verify_tiles_fails_in_one_line(tiled: TiledDir, capsys: pytest.CaptureFixture[str]) -> None:
    _flip(tiled.path("tile/entries/000"), 9)
    assert main(["tiles", str(tiled.root), "--log-key", tiled.vkey]) == ExitCode.FAILED
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("kvgraft-verify: TileError: entry ")
    assert main(["tiles", str(tiled.root / "nope"), "--log-key", tiled.vkey]) == ExitCode.FAILED
    assert "is not a directory" in capsys.readouterr().err
    assert main(["tiles", str(tiled.root), "--log-key", "not-a-vkey"]) == ExitCode.FAILED
    assert "MalformedInputError: a verifier key has the form" in capsys.readouterr().err
    assert main(["tiles", str(tiled.root), "--log-key", tiled.vkey, "--origin", "example.com/other"]) == ExitCode.FAILED
    assert f"LogProofError: the checkpoint is for log {ORIGIN!r}, not 'example.com/other'" in capsys.readouterr().err
