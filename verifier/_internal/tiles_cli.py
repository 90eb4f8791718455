"""Backend of ``kvgraft-verify tiles``: read and verify a whole c2sp.org/tlog-tiles log.

    kvgraft-verify tiles (URL | DIR) --log-key VKEY [--origin NAME] [--allow-missing-bundles] [--max-entries N]
                         [--timeout S]

- URL: the log's prefix, ``http(s)://...`` (kvgraft's registry serves it at ``<registry>/tlog/``);
  read with httpx, which a verifier-only install lacks: there, read a directory copy.
- DIR: a directory holding ``checkpoint`` and ``tile/`` (``kvgraft tiles export --out DIR``).
- VKEY: the log's note verifier key, ``<name>+<8 hex key id>+<base64 key>`` (kvgraft's registry
  serves it as ``vkey`` at ``GET /v1/log/key``).
- NAME: the log's origin, which the checkpoint must then name (a key may sign several logs).

Prints the tree size, the root and the number of tiles, bundles and entries verified; with
``--json`` also every entry's index, size and sha256 digest (kvgraft's entry digest).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from .tiles import (
    DEFAULT_FETCH_TIMEOUT,
    DEFAULT_MAX_ENTRIES,
    DirectoryTileSource,
    HttpTileSource,
    TiledLog,
    read_tiled_log,
)


def _cmd_tiles(args: argparse.Namespace) -> dict[str, Any]:
    target: str = args.log
    options: dict[str, Any] = {
        "origin": args.origin, "max_entries": args.max_entries, "allow_missing_bundles": args.allow_missing_bundles,
    }
    if target.startswith(("http://", "https://")):
        with HttpTileSource(target, timeout=args.timeout) as source:
            log = read_tiled_log(source, args.log_key, **options)
    else:
        log = read_tiled_log(DirectoryTileSource(Path(target)), args.log_key, **options)
    return tiled_log_document(log)


def tiled_log_document(log: TiledLog) -> dict[str, Any]:
    """The JSON result of ``kvgraft-verify tiles``."""
    checkpoint = log.checkpoint
    return {
        "verified": "tiles",
        "origin": checkpoint.origin,
        "tree_size": checkpoint.size,
        "root_hash": checkpoint.root_hash.hex(),
        "tiles": log.tiles,
        "bundles": log.bundles,
        "entries": [{"index": e.index, "size": e.size, "digest": e.digest} for e in log.entries],
        "missing_bundles": [t.path for t in log.missing],
        "summary": log.summary(),
    }


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from e
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from e
    if not 0 < value <= 3600:
        raise argparse.ArgumentTypeError(f"{value:g} must be more than 0 and at most 3600 seconds")
    return value


def add_tiles_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``tiles`` to ``kvgraft-verify``'s subcommands."""
    p = sub.add_parser(
        "tiles", help="read a whole c2sp.org/tlog-tiles log (URL prefix or directory) and verify every tile and entry"
    )
    p.add_argument("log", metavar="URL|DIR", help="the log's URL prefix (http[s]://.../tlog/) or a directory copy")
    p.add_argument("--log-key", required=True, metavar="VKEY",
                   help="the log's note verifier key <name>+<key id>+<base64> (GET /v1/log/key: vkey)")
    p.add_argument("--origin", metavar="NAME",
                   help="require the checkpoint to be this log's (default: any log the key signs)")
    p.add_argument("--allow-missing-bundles", action="store_true",
                   help="list entry bundles the log does not serve (entries over 65,535 bytes) instead of failing")
    p.add_argument("--max-entries", type=_positive, default=DEFAULT_MAX_ENTRIES, metavar="N",
                   help=f"refuse a checkpoint of more entries (default {DEFAULT_MAX_ENTRIES})")
    p.add_argument("--timeout", type=_seconds, default=DEFAULT_FETCH_TIMEOUT, metavar="SECONDS",
                   help=f"seconds each HTTP fetch may take in all (default {DEFAULT_FETCH_TIMEOUT:g})")
    p.set_defaults(run=_cmd_tiles)
