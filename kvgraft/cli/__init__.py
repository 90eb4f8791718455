"""``kvgraft``: the producer's command line (entry point ``kvgraft.cli:run``).

One module per command group, each adding its subcommands with ``add_commands(sub)``:

- ``keys``: ``keys generate``, ``keys trust``, ``sign`` (verifier and schemas only);
- ``oms``: ``oms sign``, an OpenSSF model signing ``model.sig`` (verifier and schemas only);
- ``engine``: ``models list``, ``models install``, ``capture``, ``graft``, ``fresh``, ``single-pass``, ``generate``, ``exactness``,
  ``engine serve`` (docs/engine-serve.md);
- ``flywheel``: ``library deposit``, ``ask``, ``eval``, ``prereg``, ``replay`` (docs/flywheel.md);
- ``serve``: ``serve``, ``token``, ``key``, ``fsck`` (the registry's admin side);
- ``remote``: ``publish``, ``pull``, ``mirror``, ``report`` (the registry client);
- ``tiles``: ``tiles export``, the registry's log as a static c2sp.org/tlog-tiles directory;
- ``witness``: ``witness serve``, ``witness key`` (a c2sp.org/tlog-witness cosigner, docs/witness.md).

``_common`` holds what they share (``CliError``, the global options, the guard for optional
extras, the output). The engine and the registry are imported only when a command runs, so
``kvgraft --help`` and ``kvgraft keys`` import neither torch nor httpx. Global options (``--json``)
are accepted before or after the subcommand: ``kvgraft --json ask ...`` and ``kvgraft ask ... --json``.
No package below (``registry``, ``engine``, ``verifier``, ``schemas``) imports this one.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from kvgraft.schemas import KvgraftError

from . import engine, flywheel, keys, oms, remote, serve, tiles, witness
from ._common import CliError, print_failure, print_result, top_parser

__all__ = ["CliError", "build_parser", "main", "run"]


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``kvgraft``: every command sets ``run(args) -> dict`` (see ``_common``)."""
    parser = top_parser(prog="kvgraft", description="Capture, sign, publish and graft KV state.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for group in (keys, oms, engine, flywheel, serve, remote, tiles, witness):
        group.add_commands(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``kvgraft``; return the exit status (0 ok, 1 failed, 2 usage)."""
    args = build_parser().parse_args(argv)
    try:
        result = args.run(args)
    except KvgraftError as e:
        # Every kvgraft failure is a KvgraftError: one line, no traceback. Anything else is a bug.
        return print_failure(e, as_json=args.json)
    print_result(result, as_json=args.json)
    return 0


def run() -> None:
    """Console-script entry point."""
    raise SystemExit(main())
