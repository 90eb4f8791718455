"""``kvgraft slot``: sign a llama-server slot file, verify it (then restore it) before a server
loads it, and publish it to / pull it from a kvgraft registry (engine/_internal/slots.py says
what is bound and checked; the registry logs a signed slot as a record of kind ``slot``)."""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from ._common import ENGINE, REGISTRY_CLIENT, CliError, add_command
from .engine import add_key_options, resolve_trust, signing_key
from .remote import add_registry_options, registry_session


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


def _cmd_publish(args: argparse.Namespace) -> dict[str, Any]:
    from kvgraft.engine import envelope_path, read_slot
    from kvgraft.registry.client import publish
    from kvgraft.schemas import RECORD_FILE

    envelope = envelope_path(args.slot)
    if not envelope.is_file():
        raise CliError(f"{args.slot} has no signature ({envelope.name} is missing)", hint=f"sign it first: kvgraft slot sign {args.slot} --server URL")
    read_slot(args.slot)  # a file that is not a slot is refused before anything is sent
    with tempfile.TemporaryDirectory(prefix="kvgraft-slot-") as tmp:
        # The registry client publishes a record directory: the envelope as record.dsse.json and
        # the slot under its own name (a hard link where the file system allows, else a copy).
        record = Path(tmp)
        shutil.copyfile(envelope, record / RECORD_FILE)
        try:
            os.link(args.slot, record / args.slot.name)
        except OSError:
            shutil.copyfile(args.slot, record / args.slot.name)
        with registry_session(args, token_required=True) as (client, _):
            r = publish(client, record, registry_key_file=args.registry_key, progress=not args.json)
    verb = "published" if r.created else "already published (the same entry came back):"
    return {**r.to_json(), "directory": str(args.slot),
            "summary": f"{verb} slot {args.slot} as entry {r.log_index} of {r.registry} (entry digest {r.entry_digest}); "
                       f"inclusion at tree size {r.tree_size} verified, checkpoint signed by {r.registry_key.describe()}\n"
                       f"  pull it elsewhere: kvgraft slot pull {r.entry_digest} --registry {r.registry} --out SLOT_SAVE_PATH"}


def _cmd_pull(args: argparse.Namespace) -> dict[str, Any]:
    from kvgraft.registry.client import pull_record
    from kvgraft.schemas import SlotStatement, Statement
    from kvgraft.verifier import load_trusted_keys

    trusted = load_trusted_keys(args.trusted_keys) if args.trusted_keys is not None else None
    args.out.mkdir(parents=True, exist_ok=True)
    staged = args.out / f".kvgraft-slot-pull-{os.getpid()}"

    def beside_its_slot(statement: Statement) -> str:
        return statement.subject[0].name + ".dsse.json"

    with registry_session(args, token_required=False) as (client, _):
        r = pull_record(client, args.entry, staged, statement_type=SlotStatement, trusted_keys=trusted,
                        registry_key_file=args.registry_key, envelope_name=beside_its_slot)
    try:
        # Into the server's slot directory: the slot, then its signature (an unsigned slot is
        # refused by verify, so a stop between the two renames leaves nothing usable unchecked).
        placed = []
        for name in (*r.files, r.envelope.name):
            target = args.out / name
            if target.exists():
                raise CliError(f"{target} already exists", hint="pull into another --out, or move the existing slot away")
            os.replace(staged / name, target)
            placed.append(target)
    finally:
        shutil.rmtree(staged, ignore_errors=True)
    slot = args.out / r.files[0]
    return {**r.to_json(), "slot": str(slot),
            "summary": f"pulled slot {slot} (entry {r.log_index} of {r.registry}); its bytes hashed, inclusion at tree size "
                       f"{r.tree_size} verified; {r.signature}\n  before restoring it: kvgraft slot verify {slot} --server URL "
                       f"--trusted-keys FILE --restore ID"}


def add_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``slot`` (``sign``, ``verify``, ``publish``, ``pull``) to ``kvgraft``'s subcommands."""
    slot = sub.add_parser("slot", help="sign a llama-server slot file, check it before the server restores it, publish and pull it")
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
    registry_examples = (
        ("kvgraft slot publish slots/s1.bin --registry http://127.0.0.1:8000",
         "log a signed slot (slots/s1.bin and slots/s1.bin.dsse.json) in a registry; the token in $KVGRAFT_TOKEN"),
        ("kvgraft slot pull sha256:ENTRY --registry http://127.0.0.1:8000 --out slots --trusted-keys keys.json",
         "fetch it into another server's --slot-save-path, proved to be in the log; then kvgraft slot verify"),
    )
    pub = add_command(ssub, "publish", _cmd_publish, extra=REGISTRY_CLIENT, examples=registry_examples,
                      help="publish a signed slot (the file and SLOT.dsse.json) to a kvgraft registry")
    pub.add_argument("slot", type=Path, help="the slot file; its signature SLOT.dsse.json beside it")
    add_registry_options(pub, required=True)
    pl = add_command(ssub, "pull", _cmd_pull, extra=REGISTRY_CLIENT, examples=registry_examples,
                     help="pull a signed slot from a registry into a directory (e.g. llama-server's --slot-save-path)")
    pl.add_argument("entry", metavar="ENTRY", help="the slot's entry: its sha256: envelope digest or its log index")
    pl.add_argument("--out", type=Path, required=True, metavar="DIR",
                    help="the directory to put the slot and its signature in (made if missing; the files must not exist)")
    pl.add_argument("--trusted-keys", type=Path, metavar="FILE", help="check the signature against these keys while pulling")
    add_registry_options(pl, required=True, token_help="a token, for registries whose reads need one")
