"""The registry's own ``kvgraft`` subcommands: ``serve``, ``token``, ``key`` and ``fsck`` (the admin side).

Importing this module imports neither litestar nor duckdb: each command loads what it needs from
``kvgraft.registry`` when it runs, so the rest of ``kvgraft`` works without the ``registry`` extra.
A registry failure is its own ``RegistryError`` subclass, reported by its real class name.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from kvgraft.registry import RegistrySettings

from ._common import MAX_KEY_FILE_BYTES, REGISTRY, CliError, Command, add_command

#: The defaults of ``kvgraft serve``'s options are the settings' own.
_DEFAULTS = RegistrySettings()

_PUB_HINT = "pass the .pub file 'kvgraft keys generate' wrote"


def _read_pem(path: Path) -> str:
    try:
        if path.stat().st_size > MAX_KEY_FILE_BYTES:
            raise CliError(f"{path} is larger than a public key file can be", hint=_PUB_HINT)
        return path.read_text(encoding="ascii")
    except FileNotFoundError as e:
        raise CliError(f"public key file {path} does not exist", hint=_PUB_HINT) from e
    except (OSError, UnicodeDecodeError) as e:
        raise CliError(f"cannot read public key file {path}: {e}", hint="pass a PEM public key file") from e


# --- serve ---------------------------------------------------------------------------------------


def _witnesses(values: list[str]) -> tuple[tuple[str, str], ...]:
    """``--witness VKEY=URL`` values, each vkey checked now so that a typo fails before the server starts."""
    from kvgraft.registry import parse_witness_option
    from kvgraft.verifier import MalformedInputError, parse_witness_vkey

    pairs = []
    for value in values:
        try:
            vkey, url = parse_witness_option(value)
            parse_witness_vkey(vkey)
        except (ValueError, MalformedInputError) as e:
            raise CliError(f"--witness: {e}", hint="pass VKEY=URL: the vkey 'kvgraft witness key' prints, '=', the witness's URL") from e
        pairs.append((vkey, url))
    return tuple(pairs)


def _blob_store(args: argparse.Namespace) -> dict[str, Any]:
    """The ``blob_store`` and ``s3`` settings of ``--blob-store`` and the ``--s3-*`` options, checked."""
    from kvgraft.registry import S3Settings

    try:
        store: dict[str, Any] = {
            "blob_store": args.blob_store,
            "s3": S3Settings(
                endpoint_url=args.s3_endpoint_url,
                region=args.s3_region,
                access_key_id=args.s3_access_key_id,
                secret_access_key_file=args.s3_secret_access_key_file,
                part_size=args.s3_part_size,
                server_checksum=args.s3_server_checksum,
                timeout=args.s3_timeout,
                max_attempts=args.s3_max_attempts,
                memory_budget=args.s3_memory_budget,
            ),
        }
        RegistrySettings(**store)
    except ValueError as e:
        raise CliError(
            str(e),
            hint="pass --blob-store s3://BUCKET[/PREFIX] with --s3-endpoint-url http(s)://HOST:PORT for a store other "
            "than AWS, --s3-part-size of 5 MiB to 5 GiB, and --s3-memory-budget of at least one part "
            "(docs/registry.md, 'Deploying at scale')",
        ) from e
    return store


def _add_blob_store_options(p: argparse.ArgumentParser) -> None:
    """``--blob-store`` and the ``--s3-*`` options (``serve`` and ``fsck`` take the same)."""
    d = _DEFAULTS.s3
    p.add_argument("--blob-store", metavar="s3://BUCKET[/PREFIX]",
                   help="the registry's blobs are on this S3-compatible object store, under PREFIX/blobs/ (default: DATA/blobs)")
    p.add_argument("--s3-endpoint-url", metavar="URL",
                   help="the S3-compatible store's URL (default: $AWS_ENDPOINT_URL_S3, $AWS_ENDPOINT_URL, else AWS)")
    p.add_argument("--s3-region", metavar="REGION", help="the bucket's region (default: $AWS_REGION, $AWS_DEFAULT_REGION)")
    p.add_argument("--s3-access-key-id", metavar="ID",
                   help="access key id, with --s3-secret-access-key-file (default: $AWS_ACCESS_KEY_ID and the AWS credential chain)")
    p.add_argument("--s3-secret-access-key-file", type=Path, metavar="FILE",
                   help="a file holding the secret access key on its first line (never the secret itself on the command line)")
    p.add_argument("--s3-part-size", type=int, default=d.part_size, metavar="N",
                   help=f"bytes per multipart upload part, 5 MiB to 5 GiB; memory per upload in flight (default {d.part_size})")
    p.add_argument("--s3-memory-budget", type=int, default=d.memory_budget, metavar="BYTES",
                   help="upload buffers held at once across all uploads in flight, at least one part; an upload that "
                   f"finds no room for {d.memory_wait:g} s is answered 503 with Retry-After (default {d.memory_budget})")
    p.add_argument("--s3-timeout", type=float, default=d.timeout, metavar="SECONDS",
                   help=f"seconds to connect, and to wait for each read, before a request is retried (default {d.timeout:g})")
    p.add_argument("--s3-max-attempts", type=int, default=d.max_attempts, metavar="N",
                   help=f"tries per S3 request, with backoff (default {d.max_attempts})")
    p.add_argument("--no-s3-server-checksum", dest="s3_server_checksum", action="store_false",
                   help="do not send x-amz-checksum-sha256 (for a store that refuses it; the registry still checks every digest)")


def _cmd_serve(args: argparse.Namespace) -> dict[str, Any]:
    from kvgraft.registry import serve

    store = {**_blob_store(args), "blob_store_moved": args.blob_store_moved}
    try:
        settings = RegistrySettings(
            **store,
            origin=args.origin,
            max_blob_bytes=args.max_blob_bytes,
            max_envelope_bytes=args.max_envelope_bytes,
            reads_require_token=args.reads_require_token,
            rate_limit=args.rate_limit,
            rate_burst=args.rate_burst,
            max_search_terms=args.max_search_terms,
            max_query_length=args.max_query_length,
            max_signatures=args.max_signatures,
            max_header_bytes=args.max_header_bytes,
            max_header_count=args.max_header_count,
            max_lineage_depth=args.max_lineage_depth,
            max_json_depth=args.max_json_depth,
            public_url=args.public_url,
            scrub_interval=args.scrub_interval,
            verify_on_read_bytes=args.verify_on_read_bytes,
            witnesses=_witnesses(args.witness or []),
            witness_timeout=args.witness_timeout,
            batch_max_entries=args.batch_max_entries,
            batch_wait_ms=args.batch_wait_ms,
            max_publish_queue=args.max_publish_queue,
            max_publish_queue_bytes=args.max_publish_queue_bytes,
            database=args.database,
            adopt_database_head=args.adopt_database_head,
        )
    except ValueError as e:
        raise CliError(
            str(e),
            hint="pass positive sizes and counts, a rate limit >= 0, a burst >= 1, a scrub interval >= 0, a batch wait of 0 to 1000 ms "
            "and --database as postgresql://USER@HOST:PORT/DBNAME",
        ) from e
    started = serve(args.data, host=args.host, port=args.port, settings=settings, log_level=args.log_level, init=args.init)
    if not started:
        raise CliError(f"the registry server on {args.host}:{args.port} did not start", hint="see the log above (is the port in use?)")
    return {"data": str(args.data), "summary": f"registry server for {args.data} stopped"}


# --- key -----------------------------------------------------------------------------------------


def _cmd_key_add(args: argparse.Namespace) -> dict[str, Any]:
    from kvgraft.registry import admin_session

    pem = _read_pem(args.public_key)
    with admin_session(args.data, database=args.database, create=True) as (admin, via):
        result = admin.add_key(args.publisher, pem)
    what = "registered" if result["created"] else "was already registered"
    return {**result, "via": via, "summary": f"key {result['keyid']} {what} for publisher {result['publisher']}"}


def _cmd_key_list(args: argparse.Namespace) -> dict[str, Any]:
    from kvgraft.registry import admin_session

    with admin_session(args.data, database=args.database, create=False) as (admin, via):
        keys = admin.list_keys()
    lines = [f"{'PUBLISHER':<20} {'KEYID':<64} CREATED"]
    lines += [f"{k['publisher']:<20} {k['keyid']:<64} {k['created_at']}" for k in keys]
    return {"keys": keys, "via": via, "summary": "\n".join(lines) if keys else "no keys are registered"}


# --- token ---------------------------------------------------------------------------------------


def _cmd_token_create(args: argparse.Namespace) -> dict[str, Any]:
    from kvgraft.registry import admin_session

    pems = [_read_pem(p) for p in args.key]
    with admin_session(args.data, database=args.database, create=True) as (admin, via):
        result = admin.create_token(args.publisher, pems)
    registered = result.get("registered_keys") or []
    note = f"; registered key(s) {', '.join(registered)} for {result['publisher']}" if registered else ""
    return {
        **result,
        "via": via,
        "summary": f"token {result['token_id']} for publisher {result['publisher']}, bound to "
        f"{', '.join(result['keyids'])}{note}\n{result['token']}\n"
        "(this is the only time the token is shown: store it now)",
    }


def _cmd_token_list(args: argparse.Namespace) -> dict[str, Any]:
    from kvgraft.registry import admin_session

    with admin_session(args.data, database=args.database, create=False) as (admin, via):
        tokens = admin.list_tokens()
    lines = [f"{'TOKEN ID':<17} {'PUBLISHER':<20} {'CREATED':<21} {'REVOKED':<21} KEYS"]
    lines += [
        f"{t['token_id']:<17} {t['publisher']:<20} {t['created_at']:<21} {t['revoked_at'] or '-':<21} "
        + ",".join(k[:16] for k in t["keyids"])
        for t in tokens
    ]
    return {"tokens": tokens, "via": via, "summary": "\n".join(lines) if tokens else "no tokens exist"}


def _cmd_token_revoke(args: argparse.Namespace) -> dict[str, Any]:
    from kvgraft.registry import admin_session

    with admin_session(args.data, database=args.database, create=False) as (admin, via):
        result = admin.revoke_token(args.token_id)
    when = "now" if result["changed"] else f"already, at {result['revoked_at']}"
    if via == "server":
        applies = "from the server's next request on"
    elif args.database is not None:
        # A shared database: servers may be running, and are notified of the change.
        applies = "in the shared database: every running server refuses it from its next request on"
    else:
        applies = "(the server was not running)"
    return {**result, "via": via, "summary": f"token {result['token_id']} of {result['publisher']} revoked {when} {applies}"}


# --- fsck ----------------------------------------------------------------------------------------


def _cmd_fsck(args: argparse.Namespace) -> dict[str, Any]:
    from kvgraft.registry import fsck

    report = fsck(
        args.data, quarantine=not args.no_quarantine, settings=RegistrySettings(**_blob_store(args)), database=args.database
    )
    doc = {**report.document(), "summary": report.summary()}
    if report.ok:
        return doc
    if not args.json:
        # The one-line failure names at most a few things; people get every one on stdout.
        sys.stdout.write(report.summary() + "\n")
    moved = " (quarantined: no longer served)" if report.quarantined else ""
    raise CliError(
        f"fsck found {len(report.damaged)} damaged thing(s) in {args.data}{moved}: {report.names()}",
        hint="upload a damaged blob's right bytes again (PUT /v1/blobs/sha256:<hex>, or 'kvgraft publish') to repair it; "
        "a damaged entry, checkpoint or log means restoring the database (registry.duckdb, or the PostgreSQL database) "
        "from a backup",
        result=doc,  # kvgraft --json prints the whole report with the failure
    )


# --- wiring --------------------------------------------------------------------------------------


def _data_command(sub: argparse._SubParsersAction[argparse.ArgumentParser], name: str, command: Command,
                  help: str) -> argparse.ArgumentParser:
    """A command over a registry data directory (``--data DIR``) and its database (``--database URL``)."""
    p = add_command(sub, name, command, help=help, extra=REGISTRY)
    p.add_argument("--data", type=Path, required=True, metavar="DIR", help="the registry's data directory")
    p.add_argument("--database", metavar="URL",
                   help="a PostgreSQL database (postgresql://USER@HOST:PORT/DBNAME; the password in PGPASSWORD or "
                   "~/.pgpass) shared by several servers; default: registry.duckdb in the data directory")
    return p


def add_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``serve``, ``token``, ``key`` and ``fsck`` to ``kvgraft``'s subcommands."""
    d = _DEFAULTS
    serve = _data_command(sub, "serve", _cmd_serve,
                          help="run the registry server (Litestar under uvicorn) over a data directory")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    serve.add_argument("--init", action="store_true",
                       help="create DATA if it does not exist and start a new registry there (without it a missing "
                       "DATA is refused; an existing empty one is initialised either way)")
    serve.add_argument("--origin", help="the log's name in its checkpoints; fixed at first start (default: from the registry key)")
    serve.add_argument("--max-blob-bytes", type=int, default=d.max_blob_bytes, metavar="N", help="largest blob accepted")
    serve.add_argument("--max-envelope-bytes", type=int, default=d.max_envelope_bytes, metavar="N",
                       help="largest envelope accepted")
    serve.add_argument("--reads-require-token", action="store_true", help="refuse reads without a valid token")
    serve.add_argument("--rate-limit", type=float, default=d.rate_limit, metavar="PER_S",
                       help=f"requests per second each token may make on average; 0: no limit (default {d.rate_limit:g})")
    serve.add_argument("--rate-burst", type=int, default=d.rate_burst, metavar="N",
                       help=f"requests each token may make at once (default {d.rate_burst})")
    for flag, default, what in (
        ("--max-search-terms", d.max_search_terms, "words per search query (q=)"),
        ("--max-query-length", d.max_query_length, "characters in a search query"),
        ("--max-signatures", d.max_signatures, "signatures per posted envelope (more: 413)"),
        ("--max-header-bytes", d.max_header_bytes, "bytes of request line and headers (more: 431)"),
        ("--max-header-count", d.max_header_count, "request headers (more: 431)"),
        ("--max-lineage-depth", d.max_lineage_depth, "parent chain length accepted and walked"),
        ("--max-json-depth", d.max_json_depth, "nesting depth of posted JSON"),
        ("--batch-max-entries", d.batch_max_entries, "publishes appended per batch, under one signed checkpoint"),
        ("--max-publish-queue", d.max_publish_queue, "verified publishes waiting for a batch (more: 503)"),
        ("--max-publish-queue-bytes", d.max_publish_queue_bytes, "envelope bytes waiting for a batch (more: 503)"),
    ):
        serve.add_argument(flag, type=int, default=default, metavar="N", help=f"{what} (default {default})")
    serve.add_argument("--batch-wait-ms", type=float, default=d.batch_wait_ms, metavar="MS",
                       help="milliseconds a batch waits, after its first publish, for more that are being read or verified; "
                       "0: only those already queued "
                       f"(default {d.batch_wait_ms:g})")
    serve.add_argument("--verify-on-read-bytes", type=int, default=d.verify_on_read_bytes, metavar="N",
                       help="re-hash blobs up to this size each time they are served; 0: never "
                       f"(default {d.verify_on_read_bytes})")
    serve.add_argument("--scrub-interval", type=float, default=d.scrub_interval, metavar="SECONDS",
                       help=f"re-hash every stored blob this often in the background; 0: never (default {d.scrub_interval:g})")
    serve.add_argument("--public-url", metavar="URL",
                       help="this registry's public base URL, used in the commands its pages show (default: the listening address)")
    serve.add_argument("--witness", action="append", metavar="VKEY=URL",
                       help="a witness to submit every new checkpoint to, and serve its cosignatures (repeat; docs/witness.md)")
    serve.add_argument("--witness-timeout", type=float, default=d.witness_timeout, metavar="SECONDS",
                       help=f"seconds one request to a witness may take (default {d.witness_timeout:g})")
    _add_blob_store_options(serve)
    serve.add_argument("--blob-store-moved", action="store_true",
                       help="every blob was copied to the store given now (--blob-store, or none for DATA/blobs): record it "
                       "as the log's blob store instead of refusing to start on another one than before")
    serve.add_argument("--adopt-database-head", action="store_true",
                       help="with --database: a data directory without signed-head.json takes the database's log head "
                       "as its own (once, logged); only for a new server joining a database known to be current")
    serve.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                       help="uvicorn's log level (default info)")

    token = sub.add_parser("token", help="create, list and revoke publishing tokens")
    tsub = token.add_subparsers(dest="token_command", required=True, metavar="ACTION")
    create = _data_command(tsub, "create", _cmd_token_create,
                           help="make a bearer token for a publisher, bound to its keys (shown once)")
    create.add_argument("--publisher", required=True, help="the publisher's name")
    create.add_argument("--key", type=Path, action="append", required=True, metavar="PUBKEY.pem",
                        help="a public key the token may publish under (repeat); registered for the publisher if new")
    _data_command(tsub, "list", _cmd_token_list, help="list tokens (ids, publishers, keys; never the tokens)")
    revoke = _data_command(tsub, "revoke", _cmd_token_revoke, help="revoke a token at once")
    revoke.add_argument("token_id", metavar="TOKEN_ID", help="the token's id (tok_...), from 'kvgraft token list'")

    key = sub.add_parser("key", help="register and list publishers' public keys")
    ksub = key.add_subparsers(dest="key_command", required=True, metavar="ACTION")
    add = _data_command(ksub, "add", _cmd_key_add, help="register a publisher's public key (Ed25519, ECDSA P-256 or P-384)")
    add.add_argument("--publisher", required=True, help="the publisher's name (created if new)")
    add.add_argument("--public-key", type=Path, required=True, metavar="PEM", help="the public key file")
    _data_command(ksub, "list", _cmd_key_list, help="list registered keys")

    check = _data_command(sub, "fsck", _cmd_fsck,
                          help="check a registry's data: re-hash every blob (quarantining bad ones), check entries, log leaves "
                          "and roots; exit 1 naming what is damaged (DuckDB: the server stopped; PostgreSQL: "
                          "one snapshot while the servers run)")
    _add_blob_store_options(check)
    check.add_argument("--no-quarantine", action="store_true",
                       help="only report damaged blobs; leave them in place (and served)")
