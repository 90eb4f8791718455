"""The log as c2sp.org/tlog-tiles: tile paths, tile contents, entry bundles, and a tile reader.

A tiled log is a set of static resources under a URL prefix (or a directory)::

    <prefix>/checkpoint                     the signed checkpoint (c2sp.org/tlog-checkpoint)
    <prefix>/tile/<L>/<N>[.p/<W>]           hash tiles, level L = 0..63
    <prefix>/tile/entries/<N>[.p/<W>]       entry bundles

- Tiles have height 8: a full tile holds 256 hashes (8,192 bytes). The ``i``-th hash (``i`` from
  0 to 255) of tile ``N`` at level ``L`` is ``MTH(D[(N * 256 + i) * 256**L : (N * 256 + i + 1) *
  256**L])``: level 0 holds leaf hashes, level ``L + 1`` one hash per *full* level-``L`` tile.
  So a level-``L`` tile is ``MerkleTree.subtree_hashes(8 * L, N * 256, N * 256 + W)``.
- ``N`` is written in 3-digit path elements, all but the last prefixed ``x``: 1234067 is
  ``x001/x234/067``. ``L`` and ``W`` are decimal with no leading zeros.
- A tree of size ``s`` has, at each level ``L``, ``floor(s / 256**(L+1))`` full tiles and, when
  ``W = floor(s / 256**L) mod 256`` is not 0, one partial tile ``.p/<W>`` of ``W`` hashes. Empty
  tiles do not exist. The partial tile of width ``W`` belongs to every tree size whose checkpoint
  produced it, so a log that serves the partial tiles of every size up to its latest (as
  kvgraft's registry does) has the partial tile ``(L, N, W)`` exactly when
  ``(N * 256 + W) * 256**L <= s`` (``Tile.min_tree_size``).
- An entry bundle holds the entries of one level-0 tile, in order, each as a big-endian uint16
  length and that many bytes; entry ``i`` hashes (RFC 6962 leaf hash) to hash ``i`` of the tile.
  So no entry can be longer than 65,535 bytes: a log holding a longer one cannot serve the bundle
  that would hold it (kvgraft's registry answers 404 there and serves the entry itself elsewhere;
  docs/registry.md, "The log as tiles").

Full tiles and full bundles never change. Parsing is strict: a path is accepted only in its one
canonical spelling, and only when some tree of at most 2^64-1 entries has that tile; a tile or
bundle must have exactly its width's hashes or entries and nothing after them.

``read_tiled_log`` reads a whole tiled log from a ``TileSource`` (a directory, or an HTTP
prefix; httpx is imported only for the latter, so the verifier still installs without it),
verifies the checkpoint with the log's note verifier key, recomputes the root from the level-0
tiles, checks every higher tile against the hashes below it, and checks every bundled entry
against its leaf hash. It raises ``TileError`` (a ``LogProofError``) naming the tile at fault.
"""

from __future__ import annotations

import re
import time
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from kvgraft.schemas import Sha256Digest, sha256_bytes

from .errors import MalformedInputError, TileError
from .tlog import (
    HASH_SIZE,
    MAX_NOTE_BYTES,
    MAX_TREE_SIZE,
    Checkpoint,
    MerkleTree,
    hash_leaf,
    parse_vkey,
    verify_checkpoint,
)

#: Tile height: each tile spans 8 levels of the binary tree.
TILE_HEIGHT = 8
#: Hashes in a full tile (entries in a full bundle): 2**TILE_HEIGHT.
TILE_WIDTH = 1 << TILE_HEIGHT
#: The highest level a tile path may name (the spec's bound; no tree of 2^64-1 entries goes past 7).
MAX_TILE_LEVEL = 63
#: The longest entry an entry bundle can hold: its length prefix is a uint16.
MAX_ENTRY_BYTES = 0xFFFF
#: The largest full tile, and the largest entry bundle, in bytes.
MAX_TILE_BYTES = TILE_WIDTH * HASH_SIZE
MAX_BUNDLE_BYTES = TILE_WIDTH * (2 + MAX_ENTRY_BYTES)
#: The checkpoint's path under the prefix, and the level element of entry bundles.
TILES_CHECKPOINT = "checkpoint"
ENTRIES_LEVEL = "entries"
#: The largest tree ``read_tiled_log`` reads unless told otherwise: it keeps about two hashes per entry.
DEFAULT_MAX_ENTRIES = 1_000_000
#: Seconds one HTTP fetch may take in all, by default.
DEFAULT_FETCH_TIMEOUT = 60.0

_DECIMAL = re.compile(r"0|[1-9][0-9]{0,19}", re.ASCII)
_INDEX_ELEMENT = re.compile(r"x?[0-9]{3}", re.ASCII)
_PATH_SHOWN = 120
#: 1000**7 > 2^64: no tile index needs more path elements.
_MAX_INDEX_ELEMENTS = 7


def _span(level: int) -> int:
    # Entries under one hash of a level-`level` tile.
    return 1 << (TILE_HEIGHT * level)


@dataclass(frozen=True)
class Tile:
    """One tile (``level`` 0..63) or entry bundle (``level`` None) of a tiled log.

    ``index`` is N, the tile's number within its level; ``width`` is how many hashes (entries)
    it holds, 1..256, 256 for a full tile. Only tiles some tree of at most 2^64-1 entries has
    can be made.
    """

    level: int | None
    index: int
    width: int = TILE_WIDTH

    def __post_init__(self) -> None:
        for what, value, low, high in (
            ("level", 0 if self.level is None else self.level, 0, MAX_TILE_LEVEL),
            ("index", self.index, 0, MAX_TREE_SIZE),
            ("width", self.width, 1, TILE_WIDTH),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise ValueError(f"a tile's {what} must be an int between {low} and {high}, got {value!r}")
        if self.min_tree_size > MAX_TREE_SIZE:
            raise ValueError(f"no tree of at most 2^64-1 entries has {self.path}")

    @property
    def is_bundle(self) -> bool:
        """Whether this is an entry bundle rather than a hash tile."""
        return self.level is None

    @property
    def is_full(self) -> bool:
        """Whether it holds all 256 hashes (entries): then it never changes."""
        return self.width == TILE_WIDTH

    @property
    def hash_level(self) -> int:
        """The tile level whose hashes it holds (0 for a bundle: its entries hash to level 0)."""
        return 0 if self.level is None else self.level

    @property
    def start(self) -> int:
        """The index of the first entry it spans."""
        return self.index * _span(self.hash_level + 1)

    @property
    def min_tree_size(self) -> int:
        """The smallest tree size with this tile (its width): it exists in every tree at least this large."""
        return (self.index * TILE_WIDTH + self.width) * _span(self.hash_level)

    @property
    def path(self) -> str:
        """The tile's path under the log's prefix, e.g. ``tile/0/x001/234.p/7`` or ``tile/entries/000``."""
        level = ENTRIES_LEVEL if self.level is None else str(self.level)
        suffix = "" if self.is_full else f".p/{self.width}"
        return f"tile/{level}/{encode_tile_index(self.index)}{suffix}"

    def __str__(self) -> str:
        return self.path


def encode_tile_index(index: int) -> str:
    """N as tlog-tiles writes it: 3-digit elements, all but the last prefixed ``x`` (1234067: ``x001/x234/067``)."""
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise ValueError(f"a tile index must be a non-negative int, got {index!r}")
    elements = [f"{index % 1000:03d}"]
    index //= 1000
    while index:
        elements.append(f"x{index % 1000:03d}")
        index //= 1000
    return "/".join(reversed(elements))


def _bad_path(path: str, why: str) -> MalformedInputError:
    shown = path if len(path) <= _PATH_SHOWN else path[:_PATH_SHOWN] + "..."
    return MalformedInputError(
        f"{shown!r} is not a tlog-tiles path: {why}",
        hint="tiles are tile/<L>/<N>[.p/<W>] and entry bundles tile/entries/<N>[.p/<W>] (c2sp.org/tlog-tiles), "
        "N in 3-digit elements such as x001/x234/067",
    )


def parse_tile_path(path: str) -> Tile:
    """The tile named by ``path`` (relative to the prefix, e.g. ``tile/1/000.p/3``).

    Strict: the one canonical spelling only (no leading zeros in L or W, every element of N three
    digits with ``x`` on all but the last and no leading ``x000``, ``.p/<W>`` only with W from 1
    to 255), and only tiles that some tree of at most 2^64-1 entries has. Raises
    ``MalformedInputError`` saying what is wrong.
    """
    if not isinstance(path, str):
        raise MalformedInputError(f"a tile path must be a string, got {type(path).__name__}")
    parts = path.split("/")
    if len(parts) < 3 or parts[0] != "tile":
        raise _bad_path(path, "it does not start with tile/<L>/")
    level_text, rest = parts[1], parts[2:]
    level: int | None
    if level_text == ENTRIES_LEVEL:
        level = None
    elif _DECIMAL.fullmatch(level_text) and int(level_text) <= MAX_TILE_LEVEL:
        level = int(level_text)
    else:
        raise _bad_path(path, f"the level {level_text[:20]!r} is not 'entries' or a decimal 0 to {MAX_TILE_LEVEL} without leading zeros")
    width = TILE_WIDTH
    if len(rest) >= 2 and rest[-2].endswith(".p"):
        width_text = rest[-1]
        if not _DECIMAL.fullmatch(width_text) or not 1 <= int(width_text) < TILE_WIDTH:
            raise _bad_path(path, f"the partial width {width_text[:20]!r} is not a decimal 1 to 255 without leading zeros")
        width = int(width_text)
        rest = [*rest[:-2], rest[-2][: -len(".p")]]
    if len(rest) > _MAX_INDEX_ELEMENTS:
        raise _bad_path(path, f"N has {len(rest)} elements; no tree of at most 2^64-1 entries needs more than {_MAX_INDEX_ELEMENTS}")
    index = 0
    for n, element in enumerate(rest):
        last = n == len(rest) - 1
        if not _INDEX_ELEMENT.fullmatch(element) or element.startswith("x") == last:
            raise _bad_path(path, "N must be 3-digit elements, each but the last starting with 'x'")
        index = index * 1000 + int(element.removeprefix("x"))
    if index > MAX_TREE_SIZE:
        raise _bad_path(path, "N is larger than any tree of at most 2^64-1 entries has")
    try:
        tile = Tile(level, index, width)
    except ValueError as e:
        raise _bad_path(path, str(e)) from e
    if tile.path != path:
        raise _bad_path(path, f"it is not canonical; the same tile is {tile.path}")
    return tile


def tiles_for_size(size: int) -> list[Tile]:
    """Every hash tile of a tree of ``size`` entries, level by level, full tiles then the partial one.

    About ``size / 255`` tiles: bound ``size`` first (``read_tiled_log`` takes ``max_entries``).
    """
    _check_size(size)
    tiles: list[Tile] = []
    level = 0
    while (hashes := size // _span(level)) > 0:
        tiles.extend(_level_tiles(level, hashes))
        level += 1
    return tiles


def bundles_for_size(size: int) -> list[Tile]:
    """Every entry bundle of a tree of ``size`` entries: the full ones, then the partial one."""
    _check_size(size)
    return _level_tiles(None, size)


def _level_tiles(level: int | None, hashes: int) -> list[Tile]:
    full, partial = divmod(hashes, TILE_WIDTH)
    tiles = [Tile(level, n) for n in range(full)]
    if partial:
        tiles.append(Tile(level, full, partial))
    return tiles


def _check_size(size: int) -> None:
    if isinstance(size, bool) or not isinstance(size, int) or not 0 <= size <= MAX_TREE_SIZE:
        raise ValueError(f"a tree size must be an int between 0 and 2^64-1, got {size!r}")


# --- contents ----------------------------------------------------------------------------------


def tile_data(tree: MerkleTree, tile: Tile) -> bytes:
    """The bytes of hash tile ``tile`` of ``tree``: its ``width`` hashes, concatenated.

    ``tree`` must have ``tile`` (``tile.min_tree_size <= tree.size``); raises ``ValueError`` otherwise.
    """
    if tile.level is None:
        raise ValueError(f"{tile} is an entry bundle, not a hash tile: build it with encode_bundle")
    if tile.min_tree_size > tree.size:
        raise ValueError(f"{tile} is not in a tree of size {tree.size} (it needs {tile.min_tree_size} entries)")
    first = tile.index * TILE_WIDTH
    return b"".join(tree.subtree_hashes(TILE_HEIGHT * tile.level, first, first + tile.width))


def tile_hashes(tile: Tile, data: bytes) -> list[bytes]:
    """The hashes of hash tile ``tile`` from its bytes; ``TileError`` unless it has exactly ``width`` of them."""
    want = tile.width * HASH_SIZE
    if len(data) != want:
        raise TileError(f"{tile} is {len(data)} bytes, not the {want} of {tile.width} hash(es) its width needs")
    return [data[i : i + HASH_SIZE] for i in range(0, want, HASH_SIZE)]


def encode_bundle(entries: Iterable[bytes]) -> bytes:
    """An entry bundle: each entry as a big-endian uint16 length, then its bytes.

    Raises ``ValueError`` for an entry over ``MAX_ENTRY_BYTES`` (65,535): check first, a log
    cannot bundle such an entry at all.
    """
    out = bytearray()
    for n, entry in enumerate(entries):
        if not isinstance(entry, bytes):
            raise ValueError(f"entry {n} must be bytes, got {type(entry).__name__}")
        if len(entry) > MAX_ENTRY_BYTES:
            raise ValueError(f"entry {n} is {len(entry)} bytes; an entry bundle holds entries of at most {MAX_ENTRY_BYTES}")
        out += len(entry).to_bytes(2, "big") + entry
    return bytes(out)


def parse_bundle(tile: Tile, data: bytes) -> list[bytes]:
    """The entries of entry bundle ``tile`` from its bytes.

    Exactly ``tile.width`` length-prefixed entries and nothing after them, in at most
    ``MAX_BUNDLE_BYTES``; raises ``TileError`` naming the entry where it goes wrong.
    """
    if not tile.is_bundle:
        raise ValueError(f"{tile} is a hash tile, not an entry bundle")
    if len(data) > MAX_BUNDLE_BYTES:
        raise TileError(f"{tile} is {len(data)} bytes, more than any bundle of 256 entries can be ({MAX_BUNDLE_BYTES})")
    entries: list[bytes] = []
    at = 0
    for n in range(tile.width):
        index = tile.start + n
        if len(data) - at < 2:
            raise TileError(
                f"{tile} ends after {n} of its {tile.width} entries: entry {index} has no length prefix (truncated)"
            )
        length = int.from_bytes(data[at : at + 2], "big")
        at += 2
        if len(data) - at < length:
            raise TileError(
                f"{tile}: entry {index} claims {length} bytes but only {len(data) - at} remain (truncated or altered)"
            )
        entries.append(data[at : at + length])
        at += length
    if at != len(data):
        raise TileError(f"{tile} has {len(data) - at} byte(s) after its {tile.width} entries")
    return entries


# --- sources -----------------------------------------------------------------------------------


class TileSource(Protocol):
    """Where a tiled log's resources come from: a directory or an HTTP prefix."""

    def describe(self) -> str:
        """The source, for messages (a directory or URL prefix)."""
        ...

    def fetch(self, path: str, max_bytes: int) -> bytes | None:
        """The resource at ``path`` under the prefix; None when there is none (404, no file).

        Raises ``MalformedInputError`` when it cannot be read, or is longer than ``max_bytes``.
        """
        ...


class DirectoryTileSource:
    """A tiled log exported to a directory (``kvgraft tiles export``, or any static copy)."""

    def __init__(self, root: Path) -> None:
        if not root.is_dir():
            raise MalformedInputError(
                f"{root} is not a directory",
                hint="pass the directory 'kvgraft tiles export --out' wrote, or the log's URL prefix",
            )
        self.root = root

    def describe(self) -> str:
        return str(self.root)

    def fetch(self, path: str, max_bytes: int) -> bytes | None:
        target = self.root / path
        try:
            with target.open("rb") as f:
                data = f.read(max_bytes + 1)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except IsADirectoryError as e:
            raise MalformedInputError(f"{target} is a directory, not a file") from e
        except OSError as e:
            raise MalformedInputError(f"cannot read {target}: {e.strerror or e}") from e
        if len(data) > max_bytes:
            raise MalformedInputError(f"{target} is larger than the {max_bytes} bytes a {_kind(path)} can be")
        return data


class HttpTileSource:
    """A tiled log at an HTTP(S) URL prefix, read with httpx (imported only here).

    Every fetch has one total deadline of ``timeout`` seconds and reads at most its ``max_bytes``
    (after gzip, which it accepts as the spec asks, inflated incrementally so that no body costs
    more than its limit); redirects are not followed. Use it as a context manager.
    """

    def __init__(self, prefix: str, *, timeout: float = DEFAULT_FETCH_TIMEOUT) -> None:
        try:
            import httpx
        except ImportError as e:  # pragma: no cover (the test environment has httpx)
            raise MalformedInputError(
                "reading tiles over HTTP needs httpx, which is not installed",
                hint="pip install httpx (or kvgraft[registry]), or read a directory copy of the tiles",
            ) from e
        if not prefix.startswith(("http://", "https://")):
            raise MalformedInputError(f"{prefix[:80]!r} is not an http:// or https:// URL")
        self.prefix = prefix if prefix.endswith("/") else prefix + "/"
        self.timeout = timeout
        self._client = httpx.Client(
            timeout=timeout, follow_redirects=False, headers={"Accept-Encoding": "gzip, identity"}
        )

    def __enter__(self) -> HttpTileSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the connection pool."""
        self._client.close()

    def describe(self) -> str:
        return self.prefix

    def fetch(self, path: str, max_bytes: int) -> bytes | None:
        import httpx  # already loaded by __init__

        url = self.prefix + path
        deadline = time.monotonic() + self.timeout
        try:
            with self._client.stream("GET", url) as response:
                if response.status_code == 404:
                    return None
                if response.status_code != 200:
                    raise MalformedInputError(
                        f"GET {url} answered {response.status_code}, not 200",
                        hint="check the URL prefix (it ends before 'checkpoint' and 'tile/') and that the log is up",
                    )
                encoding = response.headers.get("content-encoding", "identity").strip().lower() or "identity"
                if encoding not in ("identity", "gzip"):
                    raise MalformedInputError(
                        f"GET {url} answered in Content-Encoding {encoding[:40]!r}, which this reader did not ask for",
                        hint="serve tiles as gzip or identity (c2sp.org/tlog-tiles), or read a directory copy",
                    )
                # Raw bytes, inflated here at most one byte past the limit: httpx would inflate a whole
                # network read at once, and a few KiB of gzip can be tens of MiB.
                inflate = zlib.decompressobj(16 + zlib.MAX_WBITS) if encoding == "gzip" else None
                data = bytearray()
                for chunk in response.iter_raw():
                    if time.monotonic() > deadline:
                        raise MalformedInputError(f"GET {url} took longer than {self.timeout:g} s")
                    data += chunk if inflate is None else inflate.decompress(chunk, max_bytes + 1 - len(data))
                    if len(data) > max_bytes:
                        raise MalformedInputError(f"GET {url}: more than the {max_bytes} bytes a {_kind(path)} can be")
                if inflate is not None and not inflate.eof:
                    raise MalformedInputError(f"GET {url}: the gzip body ends early (truncated)")
                return bytes(data)
        except zlib.error as e:
            raise MalformedInputError(f"GET {url}: the gzip body is corrupt ({e})") from e
        except httpx.HTTPError as e:
            raise MalformedInputError(
                f"GET {url} failed: {e}", hint="check the URL and that the log is reachable, then retry"
            ) from e


def _kind(path: str) -> str:
    if path == TILES_CHECKPOINT:
        return "checkpoint"
    return "entry bundle" if path.startswith(f"tile/{ENTRIES_LEVEL}/") else "tile"


# --- the reader --------------------------------------------------------------------------------


@dataclass(frozen=True)
class TiledEntry:
    """An entry read from a bundle and checked against its leaf hash."""

    index: int
    digest: Sha256Digest
    size: int


@dataclass(frozen=True)
class TiledLog:
    """What ``read_tiled_log`` verified: the checkpoint, how many tiles and bundles, every entry read.

    ``missing`` lists the entry bundles the source does not have (only with
    ``allow_missing_bundles``): their entries' leaf hashes are proven, their bytes were not read.
    ``read`` counts the entries read and verified (``entries`` is empty with ``keep_entries=False``).
    """

    checkpoint: Checkpoint
    note: bytes
    tiles: int
    bundles: int
    entries: tuple[TiledEntry, ...]
    missing: tuple[Tile, ...]
    read: int

    def summary(self) -> str:
        """One line for people."""
        missing = ""
        if self.missing:
            count = sum(t.width for t in self.missing)
            missing = f"; {count} entr{'y' if count == 1 else 'ies'} in {len(self.missing)} missing bundle(s) not read"
        return (
            f"OK: tlog-tiles log {self.checkpoint.origin} at tree size {self.checkpoint.size}, root "
            f"{self.checkpoint.root_hash.hex()}: {self.tiles} tile(s) and {self.bundles} entry bundle(s) verified, "
            f"{self.read} entries read{missing}"
        )


def read_tiled_log(
    source: TileSource,
    vkey: str,
    *,
    origin: str | None = None,
    max_entries: int = DEFAULT_MAX_ENTRIES,
    allow_missing_bundles: bool = False,
    on_entry: Callable[[int, bytes], None] | None = None,
    keep_entries: bool = True,
) -> TiledLog:
    """Read and verify the whole tiled log at ``source``, whose checkpoints ``vkey`` signs.

    ``vkey`` is the log's note verifier key (``<name>+<key id>+<base64 key>``; kvgraft's
    registry serves it as ``vkey`` at ``GET /v1/log/key``). In order: the checkpoint's
    signature; the root recomputed from the level-0 tiles against the checkpoint's; every
    higher tile against the full tiles below it; every entry of every bundle against its leaf
    hash (``on_entry(index, bytes)`` sees each one, in log order). With ``origin`` the checkpoint
    must be that log's (one key may sign several logs). A checkpoint of more than ``max_entries``
    is refused before any tile is fetched. A missing bundle is a ``TileError`` unless
    ``allow_missing_bundles`` (then it is listed in ``missing``). ``keep_entries=False`` leaves
    ``entries`` empty, for callers that only need the verdict (it is the largest part of the result).
    """
    name, public_key = parse_vkey(vkey)
    where = source.describe()
    note = fetch_checkpoint(source)
    if note is None:
        raise TileError(
            f"{where} has no {TILES_CHECKPOINT}", hint="pass the log's prefix: the URL or directory holding checkpoint and tile/"
        )
    checkpoint = verify_checkpoint(note, name, public_key, origin=origin)
    size = checkpoint.size
    if size > max_entries:
        raise TileError(
            f"the checkpoint at {where} is for {size} entries, more than the {max_entries} this reader accepts",
            hint="raise --max-entries if you mean to read a log that large (the reader keeps every leaf hash in memory)",
        )
    tiles = tiles_for_size(size)
    leaves: list[bytes] = []
    for tile in (t for t in tiles if t.level == 0):
        leaves.extend(tile_hashes(tile, _fetch(source, tile, where)))
    tree = MerkleTree(leaves)
    if tree.root() != checkpoint.root_hash:
        raise TileError(
            f"the level-0 tiles at {where} make root {tree.root().hex()}, not the checkpoint's "
            f"{checkpoint.root_hash.hex()} at size {size}: a level-0 tile was altered, or belongs to another tree"
        )
    for tile in (t for t in tiles if t.hash_level > 0):
        data = _fetch(source, tile, where)
        tile_hashes(tile, data)
        if data != tile_data(tree, tile):
            raise TileError(
                f"{tile} at {where} does not hold the hashes of the level-{tile.hash_level - 1} tiles below it: it was altered"
            )
    entries: list[TiledEntry] = []
    missing: list[Tile] = []
    bundles = 0
    for bundle in bundles_for_size(size):
        found = source.fetch(bundle.path, MAX_BUNDLE_BYTES)
        if found is None:
            if not allow_missing_bundles:
                raise TileError(
                    f"{where} has no {bundle} (entries {bundle.start} to {bundle.start + bundle.width - 1})",
                    hint=f"a log cannot bundle an entry over {MAX_ENTRY_BYTES} bytes; kvgraft's registry serves such an "
                    "entry at /v1/entries/<index>/envelope instead (pass --allow-missing-bundles to check the rest)",
                )
            missing.append(bundle)
            continue
        for n, entry in enumerate(parse_bundle(bundle, found)):
            index = bundle.start + n
            if hash_leaf(entry) != leaves[index]:
                raise TileError(
                    f"entry {index} in {bundle} at {where} does not hash to leaf {index} of the level-0 tile: "
                    "the bundle was altered, or belongs to another log"
                )
            if on_entry is not None:
                on_entry(index, entry)
            if keep_entries:
                entries.append(TiledEntry(index, sha256_bytes(entry), len(entry)))
        bundles += 1
    read = size - sum(t.width for t in missing)
    return TiledLog(checkpoint, note, len(tiles), bundles, tuple(entries), tuple(missing), read)


def fetch_checkpoint(source: TileSource) -> bytes | None:
    """The (unverified) checkpoint note at ``source``, at most a note's size; None when there is none."""
    return source.fetch(TILES_CHECKPOINT, MAX_NOTE_BYTES)


def _fetch(source: TileSource, tile: Tile, where: str) -> bytes:
    data = source.fetch(tile.path, MAX_TILE_BYTES)
    if data is None:
        raise TileError(
            f"{where} has no {tile}, which a tree of size {tile.min_tree_size} or more has",
            hint="the log (or its copy) is incomplete; fetch or export it again",
        )
    return data

