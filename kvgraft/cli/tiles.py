"""``kvgraft tiles export``: write a registry's log to a directory as c2sp.org/tlog-tiles.

    kvgraft tiles export --data DATA_DIR --out DIR

Reads the data directory read-only, as ``kvgraft fsck`` does (refused while a server holds its
DuckDB database: the running server serves the same tiles at ``/tlog/``; with ``--database URL``
a PostgreSQL registry is read in one snapshot while its servers run), and writes ``DIR/checkpoint``,
``DIR/tile/<L>/...`` and ``DIR/tile/entries/...``, so that any static file server over ``DIR``
is a tlog-tiles log. Run again after new entries: full tiles already there are verified and
kept. ``kvgraft-verify tiles DIR --log-key VKEY`` reads it back. Importing this module imports
no duckdb: the command loads ``kvgraft.registry``'s exporter when it runs.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from ._common import REGISTRY, add_command


def _cmd_export(args: argparse.Namespace) -> dict[str, Any]:
    from kvgraft.registry import export_tiles

    report = export_tiles(args.data, args.out, database=args.database)
    return {**report.document(), "summary": report.summary()}


def add_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``tiles export`` to ``kvgraft``'s subcommands."""
    tiles = sub.add_parser("tiles", help="the registry's log as c2sp.org/tlog-tiles (docs/registry.md)")
    tsub = tiles.add_subparsers(dest="tiles_command", required=True, metavar="ACTION")
    export = add_command(
        tsub, "export", _cmd_export, extra=REGISTRY,
        help="write a stopped registry's log (checkpoint, tiles, entry bundles) to a directory for any static server",
    )
    export.add_argument("--data", type=Path, required=True, metavar="DATA_DIR", help="the registry's data directory")
    export.add_argument("--out", type=Path, required=True, metavar="DIR",
                        help="the directory to write (created if missing; an earlier export of the same log is updated)")
    export.add_argument("--database", metavar="URL",
                        help="the registry's PostgreSQL database (postgresql://USER@HOST:PORT/DBNAME), read in one snapshot "
                        "while its servers run; default: the DuckDB file in DATA_DIR, read with the server stopped")
