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
- ``witness``: ``witness serve``, ``witness key`` (a c2sp.org/tlog-witness cosigner, docs/witness.md);
- ``vllm``: ``vllm exactness``, ``vllm prefix-cache`` (run in vLLM's own venv, docs/vllm.md).

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
from kvgraft.verifier.cli import examples_text, walk

from . import engine, flywheel, keys, oms, remote, serve, slot, tiles, vllm, witness
from ._common import CliError, print_failure, print_result, top_parser

__all__ = ["COMMAND_EXAMPLES", "COMMAND_GROUPS", "CliError", "build_parser", "main", "run"]


#: ``kvgraft --help`` lists the commands under these headings (every command in exactly one:
#: tests/cli/test_help.py checks it).
COMMAND_GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("start here", ("models", "keys", "library", "ask")),
    ("engine", ("capture", "graft", "generate", "fresh", "single-pass", "exactness", "engine", "slot", "vllm")),
    ("flywheel", ("eval", "prereg", "replay", "report")),
    ("registry", ("publish", "pull", "mirror", "sign", "oms", "tiles")),
    ("admin", ("serve", "token", "key", "fsck", "witness")),
)

#: The tour of docs/index.md, in ``kvgraft --help``.
EXAMPLES: tuple[tuple[str, str], ...] = (
    ("kvgraft library deposit --model smollm2-135m --dataset data/datasets/gsm8k_train.jsonl --limit 8 --library lib",
     "capture 8 worked solutions the grader confirms as a signed knowledge library"),
    ("kvgraft ask --library lib --trust-local-key --question 'A robe takes 2 bolts of blue fiber ...'",
     "answer from the library: graft the closest entry, decode only what is missing"),
    ("kvgraft capture --model smollm2-135m --text-file notes.txt --out art",
     "run a text once and keep its KV state as a signed artifact"),
    ("kvgraft --json graft --artifact art --text-file question.txt --trust-local-key",
     "restore it at its own positions: logits bit-for-bit equal to a fresh computation"),
    ("kvgraft publish --registry http://127.0.0.1:8000 art", "publish it to a registry (a token in $KVGRAFT_TOKEN)"),
    ("kvgraft pull --registry http://127.0.0.1:8000 --out pulled sha256:1f2e3d4c",
     "pull it back by digest, or by a unique prefix of one; digests, signature and log inclusion checked"),
)


#: Examples at the end of a command's own ``--help`` (tests/cli/test_help.py parses each one).
COMMAND_EXAMPLES: dict[tuple[str, ...], tuple[tuple[str, str], ...]] = {
    ("library", "deposit"): (
        ("kvgraft library deposit --model smollm2-135m --dataset data/datasets/gsm8k_train.jsonl --limit 8 --library lib",
         "the first 8 problems whose worked solutions the grader confirms"),
        ("kvgraft library deposit --model smollm2-135m --dataset data/datasets/aime2025.jsonl --solutions-from-key --library lib",
         "a dataset without worked solutions: store the key's answers"),
    ),
    ("ask",): (
        ("kvgraft ask --library lib --trust-local-key --question 'How many clips did Natalia sell altogether?'",
         "answer from a library deposited with this machine's key"),
        ("kvgraft ask --engine http://127.0.0.1:8000 --question-file q.txt", "ask a running 'kvgraft engine serve'"),
    ),
    ("eval",): (
        ("kvgraft eval --model smollm2-135m --dataset data/datasets/gsm8k_test.jsonl --limit 50 --seed 2025 --out ev",
         "the base arm: the model alone on 50 problems drawn with seed 2025"),
        ("kvgraft eval --model smollm2-135m --dataset data/datasets/gsm8k_test.jsonl --limit 50 --seed 2025 --library lib "
         "--trust-local-key --out ev-lib", "the library arm, on the same problems"),
    ),
    ("capture",): (
        ("kvgraft capture --model smollm2-135m --text-file notes.txt --out art", "a root artifact, signed with the local key"),
        ("kvgraft capture --model smollm2-135m --text-file more.txt --parent art --trust-local-key --out art2",
         "a child continuing its parent's positions"),
    ),
    ("graft",): (
        ("kvgraft --json graft --artifact art --text-file question.txt --trusted-keys trusted.json",
         "its logits_sha256 equals 'kvgraft fresh' on the same texts"),
    ),
    ("publish",): (
        ("kvgraft publish --registry http://127.0.0.1:8000 --registry-key registry-key.pub.pem art",
         "an artifact (its token in $KVGRAFT_TOKEN), the registry's key pinned"),
    ),
    ("pull",): (
        ("kvgraft pull --registry http://127.0.0.1:8000 --trusted-keys trusted.json --out art2 sha256:1f2e3d4c",
         "by a unique start of its digest, as git takes"),
    ),
}


def _add_examples(parser: argparse.ArgumentParser) -> None:
    for path, sub in walk(parser):
        if path in COMMAND_EXAMPLES:
            sub.epilog = examples_text(COMMAND_EXAMPLES[path])


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``kvgraft``: every command sets ``run(args) -> dict`` (see ``_common``)."""
    parser = top_parser(prog="kvgraft", description="Capture, sign, publish and graft KV state: knowledge a frozen "
                        "model reads once, kept as byte-exact signed artifacts in an audited registry.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for group in (keys, oms, engine, slot, vllm, flywheel, serve, remote, tiles, witness):
        group.add_commands(sub)
    parser.set_command_groups(COMMAND_GROUPS, EXAMPLES)
    _add_examples(parser)
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
