"""``kvgraft slot``: sign a llama-server slot file, and verify it (then restore it) before a
server loads it (engine/_internal/slots.py says what is bound and checked)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from ._common import ENGINE, CliError, add_command
from .engine import add_key_options, resolve_trust, signing_key


def _server(args: argparse.Namespace) -> Any:
    from kvgraft.engine import server_identity

    return server_identity(args.server, gguf=args.gguf)


def _cmd_sign(args: argparse.Namespace) -> dict[str, Any]:
    from kvgraft.engine import sign_slot

    server = _server(args)
    key, secret, note = signing_key(args)
    out, keyid = sign_slot(args.slot, server, key, secret)
    return {"envelope": str(out), "keyid": keyid, "gguf_sha256": server.gguf_sha256, "build_info": server.build_info,
            "summary": f"signed {args.slot} as {out}: binds {server.gguf_file.name} ({server.gguf_sha256}) and llama.cpp "
                       f"build {server.build_info}{note}"}


def _cmd_verify(args: argparse.Namespace) -> dict[str, Any]:
    from kvgraft.engine import restore_slot, verify_slot

    trust = resolve_trust(args)
    if trust.keys is None:
        raise CliError("kvgraft slot verify checks a signature: it cannot skip it", hint="drop --insecure-skip-verify")
    checked = verify_slot(args.slot, trust.keys, _server(args))
    result: dict[str, Any] = {"slot": str(args.slot), "signed_by": checked.signers, "tokens": len(checked.predicate.tokens),
                              "cells": [c.cells for c in checked.predicate.caches], "restored": None}
    summary = (f"OK: {args.slot} is signed by {checked.signers} and binds this server's GGUF "
               f"({checked.predicate.gguf_sha256}) and build ({checked.predicate.build_info})")
    if args.restore is not None:
        answer = restore_slot(args.server, checked, args.restore)
        result["restored"] = answer
        summary += f"; restored into slot {args.restore} ({answer.get('n_restored')} cells)"
    return {**result, "summary": summary}


def add_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``slot`` (``sign``, ``verify``) to ``kvgraft``'s subcommands."""
    slot = sub.add_parser("slot", help="sign a llama-server slot file, and check it before the server restores it")
    ssub = slot.add_subparsers(dest="slot_command", required=True, metavar="ACTION")
    examples = (
        ("kvgraft slot sign slots/s1.bin --server http://127.0.0.1:8080",
         "sign a slot llama-server saved (POST /slots/0?action=save) into its --slot-save-path"),
        ("kvgraft slot verify slots/s1.bin --server http://127.0.0.1:8080 --trusted-keys keys.json --restore 0",
         "check signature, bytes and the server's GGUF and build, then restore it into slot 0"),
    )
    for name, command, text in (("sign", _cmd_sign, "sign a slot file saved by llama-server (writes SLOT.dsse.json)"),
                                ("verify", _cmd_verify, "check a signed slot against the server that is to restore it")):
        p = add_command(ssub, name, command, extra=ENGINE, help=text, examples=examples)
        p.add_argument("slot", type=Path, help="the slot file (in the server's --slot-save-path)")
        p.add_argument("--server", required=True, help="the llama-server's URL, e.g. http://127.0.0.1:8080 (its /props names its GGUF and build)")
        p.add_argument("--gguf", type=Path, help="a copy of the server's GGUF, when the path the server reports is not readable here")
        if name == "sign":
            add_key_options(p)
        else:
            p.add_argument("--trusted-keys", type=Path, metavar="FILE", help="verify the slot's signature against these keys")
            p.add_argument("--trust-local-key", action="store_true", help="also trust this machine's local key")
            p.add_argument("--insecure-skip-verify", action="store_true", help=argparse.SUPPRESS)
            p.add_argument("--restore", type=int, metavar="ID", help="after the checks, restore the slot into the server's slot ID")
