"""``kvgraft keys generate``, ``kvgraft keys trust`` and ``kvgraft sign``: keys and signing.

These need only ``kvgraft.schemas`` and ``kvgraft.verifier`` (no engine, no registry): a
verifier-only install can make keys, trust them and sign statements about files.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from kvgraft.schemas import (
    SchemaError,
    Statement,
    Subject,
    SubjectDigest,
    canonical_model,
    check_subject_names,
    hex_of,
    parse_json,
    parse_statement,
    sha256_file,
)
from kvgraft.verifier import (
    KEY_TYPES,
    TrustedKeys,
    envelope_json,
    generate_private_key,
    key_type_label,
    key_type_of,
    keyid_of,
    load_public_key,
    load_trusted_keys,
    open_signing_key,
    save_private_key,
    save_public_key,
    sign_statement,
    trusted_key,
    write_atomic,
)

from ._common import CliError, add_command, passphrase


def _cmd_keys_generate(args: argparse.Namespace) -> dict[str, Any]:
    key = generate_private_key(args.type)
    pub_path = args.out.with_name(args.out.name + ".pub")
    save_private_key(key, args.out, passphrase(args.passphrase_env))
    save_public_key(key.public_key(), pub_path)
    kid = keyid_of(key.public_key())
    return {
        "private_key": str(args.out),
        "public_key": str(pub_path),
        "keyid": kid,
        "type": args.type,
        "summary": f"wrote {args.out} (private, mode 0600) and {pub_path}; {key_type_label(args.type)} key, keyid {kid}",
    }


def _cmd_keys_trust(args: argparse.Namespace) -> dict[str, Any]:
    public = load_public_key(args.public_key)
    new = trusted_key(args.name, public)
    if args.file.exists():
        current = load_trusted_keys(args.file)
        if any(k.keyid == new.keyid for k in current.keys):
            raise CliError(f"{args.file} already trusts key {new.keyid}", hint="nothing to do")
        keys = (*current.keys, new)
        trust = TrustedKeys(keys, args.threshold or current.threshold, current.thresholds, current.payload_types)
    else:
        trust = TrustedKeys((new,), args.threshold or 1)
    if trust.threshold > len(trust.keys):
        raise CliError(f"threshold {trust.threshold} exceeds the {len(trust.keys)} trusted key(s)", hint="lower --threshold")
    write_atomic(args.file, (json.dumps(trust.to_json(), indent=2) + "\n").encode(), 0o644)
    kind = key_type_of(public)
    return {
        "file": str(args.file),
        "keyid": new.keyid,
        "type": kind,
        "summary": f"{args.file} now trusts {args.name} ({key_type_label(kind)}, {new.keyid})",
    }


def _cmd_sign(args: argparse.Namespace) -> dict[str, Any]:
    try:
        predicate = parse_json(args.predicate.read_bytes(), what=f"predicate file {args.predicate}")
    except OSError as e:
        raise CliError(f"cannot read predicate file {args.predicate}: {e.strerror}", hint="pass a JSON file") from e
    if not isinstance(predicate, dict):
        raise CliError(f"predicate file {args.predicate} must hold a JSON object", hint="wrap the fields in {...}")
    try:
        # The one subject-name rule, checked before anything is hashed or signed.
        check_subject_names([path.name for path in args.subject])
    except SchemaError as e:
        raise CliError(f"cannot sign these subjects: {e.message}", hint=e.hint or "rename the files") from e
    subjects = []
    for path in args.subject:
        if not path.is_file():
            raise CliError(f"subject {path} is not a file", hint="name each file the statement is about")
        subjects.append(Subject(name=path.name, digest=SubjectDigest(sha256=hex_of(sha256_file(path)))))
    raw = Statement(subject=subjects, predicate_type=args.predicate_type, predicate=predicate)
    # Re-parse through the typed model for known predicate types, so nothing invalid is signed.
    statement = parse_statement(canonical_model(raw), what="statement to sign")
    with open_signing_key(args.key, passphrase(args.passphrase_env)) as signer:
        envelope = sign_statement(statement, [signer])
        kid = signer.keyid
    write_atomic(args.out, envelope_json(envelope), 0o644)
    return {"envelope": str(args.out), "keyid": kid, "summary": f"signed {len(subjects)} subject(s) as {args.out} with key {kid}"}


def add_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``keys`` (``generate``, ``trust``) and ``sign`` to ``kvgraft``'s subcommands."""
    keys = sub.add_parser("keys", help="manage signing keys (Ed25519, ECDSA P-256/P-384) and trusted-keys files")
    ksub = keys.add_subparsers(dest="keys_command", required=True, metavar="ACTION")
    gen = add_command(ksub, "generate", _cmd_keys_generate, help="write a new private key (PEM) and its .pub beside it")
    gen.add_argument("--out", type=Path, required=True, help="private key path; the public key goes to OUT.pub")
    gen.add_argument("--passphrase-env", metavar="VAR", help="encrypt with the passphrase in this environment variable")
    gen.add_argument(
        "--type",
        choices=KEY_TYPES,
        default="ed25519",
        help="ed25519 (default), p256 (ECDSA P-256, SHA-256) or p384 (ECDSA P-384, SHA-384)",
    )
    trust = add_command(ksub, "trust", _cmd_keys_trust, help="add a public key to a trusted-keys file (created if missing)")
    trust.add_argument("--file", type=Path, required=True, help="the trusted-keys JSON file")
    trust.add_argument("--name", required=True, help="a human name for the key")
    trust.add_argument("--public-key", type=Path, required=True, help="PEM public key (Ed25519, P-256 or P-384)")
    trust.add_argument("--threshold", type=int, help="distinct signatures required (default: keep, or 1)")

    sign = add_command(sub, "sign", _cmd_sign, help="sign an in-toto statement about files, as a DSSE envelope")
    sign.add_argument("--key", type=Path, required=True, help="private key (PEM: Ed25519, P-256 or P-384)")
    sign.add_argument("--passphrase-env", metavar="VAR", help="the key's passphrase is in this environment variable")
    sign.add_argument("--subject", type=Path, action="append", required=True, help="a file the statement is about (repeat)")
    sign.add_argument("--predicate-type", required=True, help="the predicate's type URI")
    sign.add_argument("--predicate", type=Path, required=True, help="JSON file holding the predicate object")
    sign.add_argument("--out", type=Path, required=True, help="where to write the envelope (.dsse.json)")
