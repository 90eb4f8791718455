"""``kvgraft witness serve`` and ``kvgraft witness key``: a c2sp.org/tlog-witness cosigner.

A witness cosigns a log's checkpoints only when each extends the last one it cosigned (docs/witness.md).
Its key is an Ed25519 key made by ``kvgraft keys generate``; ``witness key`` prints the verifier
key (vkey) that registries (``kvgraft serve --witness VKEY=URL``) and witness policies name it by.
Importing this module imports neither litestar nor uvicorn: ``serve`` loads them when it runs.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from kvgraft.verifier import (
    KeyFileError,
    MalformedInputError,
    WitnessKey,
    load_private_key,
    load_public_key,
    open_signing_key,
    require_ed25519,
)

from ._common import MAX_KEY_FILE_BYTES, REGISTRY, CliError, add_command, passphrase


def _witness_key(path: Path, name: str, passphrase_env: str | None) -> WitnessKey:
    """The witness vkey of the Ed25519 key in ``path`` (a private or a public PEM) under ``name``."""
    try:
        with path.open("rb") as f:
            head = f.read(MAX_KEY_FILE_BYTES)
    except OSError as e:
        raise CliError(f"cannot read key file {path}: {e.strerror or e}", hint="pass the PEM 'kvgraft keys generate' wrote") from e
    try:
        public = (
            load_private_key(path, passphrase(passphrase_env)).public_key()
            if b"PRIVATE KEY" in head
            else load_public_key(path)
        )
        return WitnessKey(name, require_ed25519(public, f"witness key {path}"))
    except (KeyFileError, MalformedInputError) as e:
        raise CliError(e.message, hint=e.hint or "pass the Ed25519 key 'kvgraft keys generate' wrote") from e


def _cmd_key(args: argparse.Namespace) -> dict[str, Any]:
    key = _witness_key(args.key, args.name, args.passphrase_env)
    if args.url is None:
        return {"name": key.name, "key_id": key.key_id.hex(), "vkey": key.vkey, "summary": key.vkey}
    line = key.policy_line(args.url)
    return {"name": key.name, "key_id": key.key_id.hex(), "vkey": key.vkey, "policy_line": line, "summary": line}


def _cmd_serve(args: argparse.Namespace) -> dict[str, Any]:
    from kvgraft.registry import WitnessSettings, serve_witness

    _witness_key(args.key, args.name, args.passphrase_env)  # a wrong key or name fails before the server starts
    try:
        settings = WitnessSettings(name=args.name, logs=tuple(args.log), state=args.state, max_body_bytes=args.max_body_bytes)
    except ValueError as e:
        raise CliError(str(e), hint="pass --max-body-bytes as a positive number of bytes") from e
    with open_signing_key(args.key, passphrase(args.passphrase_env)) as signing_key:
        started = serve_witness(signing_key, settings, host=args.host, port=args.port, log_level=args.log_level)
    if not started:
        raise CliError(f"the witness on {args.host}:{args.port} did not start", hint="see the log above (is the port in use?)")
    return {"state": str(args.state), "summary": f"witness {args.name} stopped"}


def add_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``witness serve`` and ``witness key`` to ``kvgraft``'s subcommands."""
    from kvgraft.registry import DEFAULT_WITNESS_MAX_BODY_BYTES

    witness = sub.add_parser("witness", help="run a transparency-log witness that cosigns checkpoints (c2sp.org/tlog-witness)")
    wsub = witness.add_subparsers(dest="witness_command", required=True, metavar="ACTION")

    key = add_command(wsub, "key", _cmd_key, help="print the witness verifier key (vkey) of an Ed25519 key under a name")
    serve = add_command(wsub, "serve", _cmd_serve, extra=REGISTRY,
                        help="serve add-checkpoint: cosign each log checkpoint that extends the last one cosigned")
    for p in (key, serve):
        p.add_argument("--key", type=Path, required=True, metavar="PEM",
                       help="the witness's Ed25519 key ('kvgraft keys generate'); for 'key' a public key also works")
        p.add_argument("--name", required=True,
                       help="the witness's key name, a schema-less URL such as witness.example/w1")
        p.add_argument("--passphrase-env", metavar="VAR", help="the key's passphrase is in this environment variable")
    key.add_argument("--url", metavar="URL",
                     help="the witness's base URL: print its witness policy line, 'witness NAME VKEY URL' (docs/witness.md)")
    serve.add_argument("--state", type=Path, required=True, metavar="DIR",
                       help="where the last cosigned checkpoint of each log is kept (one file per log)")
    serve.add_argument("--log", action="append", required=True, metavar="VKEY",
                       help="a log's note verifier key, <origin>+<id>+<base64> (the vkey of GET /v1/log/key); repeat")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8001, help="port to listen on (default 8001)")
    serve.add_argument("--max-body-bytes", type=int, default=DEFAULT_WITNESS_MAX_BODY_BYTES, metavar="N",
                       help=f"largest add-checkpoint body accepted (default {DEFAULT_WITNESS_MAX_BODY_BYTES})")
    serve.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                       help="uvicorn's log level (default info)")
