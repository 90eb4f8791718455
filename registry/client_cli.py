"""The registry client's ``kvgraft`` subcommands: ``publish``, ``pull`` and ``mirror``.

``kvgraft.cli`` calls ``add_client_commands(sub)``. Importing this module imports neither httpx
nor the registry server: each command loads ``kvgraft.registry.client`` when it runs, so the
rest of ``kvgraft`` works without the ``registry`` extra. Each command returns a dict with a
``summary``; failures are one line (``CliError``), as for every other ``kvgraft`` command.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvgraft.schemas import KvgraftError

if TYPE_CHECKING:
    from .client import MirrorResult, PublishResult, PullResult, RegistryClient

#: Where a token is read from when ``--token`` is not given (keeps it out of ``ps`` and history).
TOKEN_ENV = "KVGRAFT_TOKEN"

Command = Callable[[argparse.Namespace], dict[str, Any]]


class ClientCommandError(KvgraftError):
    """A client command failed outside ``kvgraft`` (no ``CliError`` to report it as)."""


def _fail(message: str, hint: str) -> BaseException:
    # Inside `kvgraft`, report as its CliError so that its main prints one line, not a traceback.
    try:
        from kvgraft.cli import CliError
    except ImportError:
        return ClientCommandError(message, hint=hint)
    return CliError(message, hint=hint)


def _guarded(command: Command) -> Command:
    def run(args: argparse.Namespace) -> dict[str, Any]:
        try:
            from . import client
        except ImportError as e:
            raise _fail(f"the registry client is not installed ({e.name} is missing)", "pip install 'kvgraft[registry]'") from e
        try:
            return command(args)
        except client.RegistryClientError as e:
            raise _fail(f"{type(e).__name__}: {e.message}", e.hint) from e
        except (MemoryError, RecursionError) as e:
            # The client bounds what it reads (ClientLimits), but the machine may still have less
            # memory than a limit allows: one line, like every other failure.
            raise _fail(
                f"{type(e).__name__}: the command ran out of {'memory' if isinstance(e, MemoryError) else 'stack'}",
                "lower --max-json-bytes, or run where more memory is free",
            ) from e

    return run


def _token(args: argparse.Namespace, required: bool) -> str | None:
    token = args.token or os.environ.get(TOKEN_ENV) or None
    if required and not token:
        raise _fail("this command needs a registry token", f"pass --token T, or export {TOKEN_ENV}=T")
    return token


def _client(args: argparse.Namespace, url: str, token: str | None) -> RegistryClient:
    from .client import ClientLimits, RegistryClient

    limits = ClientLimits(
        timeout=args.timeout,
        max_json_bytes=args.max_json_bytes,
        max_blob_bytes=args.max_blob_bytes,
        min_rate=args.min_rate,
    )
    return RegistryClient(url, token=token, limits=limits)


# --- publish -----------------------------------------------------------------------------------


def _publish_lines(r: PublishResult) -> list[str]:
    what = f"artifact {r.artifact_digest}" if r.artifact_digest else f"{r.kind} ({r.predicate_type})"
    verb = "published" if r.created else "already published (the same entry came back):"
    lines = [
        f"{verb} {r.directory} ({what}) as entry {r.log_index} of {r.registry}; entry digest {r.entry_digest}; "
        f"tree size {r.tree_size}",
        f"  blobs: {len(r.uploaded)} uploaded ({r.uploaded_bytes} bytes), {len(r.skipped)} already on the registry",
    ]
    lines += [f"  note: {n}" for n in r.notes]
    return lines


def _cmd_publish(args: argparse.Namespace) -> dict[str, Any]:
    from .client import publish

    with _client(args, args.registry, _token(args, True)) as c:
        r = publish(
            c,
            args.directory,
            registry_key_file=args.registry_key,
            publish_parents=not args.no_parents,
            progress=not args.json,
        )
    lines = []
    for p in r.parents:
        lines += [f"parent first: {line.strip()}" if i == 0 else line for i, line in enumerate(_publish_lines(p))]
    lines += _publish_lines(r)
    lines.append(
        f"  verified: leaf = SHA-256(0x00 || envelope), inclusion at tree size {r.tree_size}, "
        f"checkpoint signed by {r.registry_key.describe()}"
    )
    return {**r.to_json(), "summary": "\n".join(lines)}


# --- pull --------------------------------------------------------------------------------------


def _pull_line(r: PullResult) -> str:
    return (
        f"pulled artifact {r.artifact_digest} into {r.directory} ({len(r.files)} file(s), {r.size} bytes); "
        f"entry {r.log_index} of {r.registry}"
    )


def _cmd_pull(args: argparse.Namespace) -> dict[str, Any]:
    from .client import pull

    trusted = None
    if args.trusted_keys is not None:
        from kvgraft.verifier import load_trusted_keys

        trusted = load_trusted_keys(args.trusted_keys)
    with _client(args, args.registry, _token(args, False)) as c:
        r = pull(
            c,
            args.digest,
            args.out,
            trusted_keys=trusted,
            registry_key_file=args.registry_key,
            with_parents=args.with_parents,
            progress=not args.json,
        )
    lines = [_pull_line(r)] + [f"  parent: {_pull_line(p)}" for p in r.parents]
    lines.append(
        f"  verified: every blob's sha256, the files are exactly the statement's subjects, inclusion at tree size "
        f"{r.tree_size}, checkpoint signed by {r.registry_key.describe()}"
    )
    lines.append(f"  {r.signature}" + ("" if r.signature_checked else "; pass --trusted-keys FILE to check it"))
    return {**r.to_json(), "summary": "\n".join(lines)}


# --- mirror ------------------------------------------------------------------------------------


def _cmd_mirror(args: argparse.Namespace) -> dict[str, Any]:
    from .client import mirror

    tokens = list(args.token or [])
    if not tokens and os.environ.get(TOKEN_ENV):
        tokens = [os.environ[TOKEN_ENV]]
    if not tokens:
        raise _fail("mirror needs a token for the target registry", f"pass --token T, or export {TOKEN_ENV}=T")
    with _client(args, args.source, args.from_token) as src, _client(args, args.target, tokens[0]) as dst:
        r = mirror(
            src,
            dst,
            source_key_file=args.registry_key_from,
            target_key_file=args.registry_key_to,
            extra_tokens=tokens[1:],
            progress=not args.json,
        )
    return {**r.to_json(), "summary": _mirror_summary(r)}


def _mirror_summary(r: MirrorResult) -> str:
    lines = [
        f"mirrored {r.source} -> {r.target}: copied {r.copied_entries} entr{'y' if r.copied_entries == 1 else 'ies'} "
        f"[{r.start_size}, {r.copied_size}) and {len(r.blobs_copied)} blob(s) ({r.bytes_copied} bytes); "
        f"{r.blobs_skipped} blob(s) were already there",
        f"  source at size {r.copied_size}: root {r.source_root}, signed by {r.source_key.describe()}",
        f"  target at size {r.copied_size}: root {r.target_root_at_copied} (equal)",
        f"  target at size {r.target_size}: root {r.target_root}, consistency proof from {r.copied_size} verified; "
        f"signed by {r.target_key.describe()}",
    ]
    lines += [f"  note: {n}" for n in r.notes]
    return "\n".join(lines)


# --- wiring ------------------------------------------------------------------------------------


def add_client_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``publish``, ``pull`` and ``mirror`` to ``kvgraft``'s subcommands.

    Each sets ``run(args) -> dict`` with a ``summary``, as the other ``kvgraft`` commands do.
    """

    # The defaults are the client's own (kvgraft.registry.client.ClientLimits); repeated here
    # because importing the client would import httpx before any command runs.
    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--timeout",
            type=float,
            default=60.0,
            metavar="S",
            help="seconds one request may take in all, connect to last byte (default 60); a blob gets S plus its size at --min-rate",
        )
        p.add_argument(
            "--max-json-bytes",
            type=int,
            default=64 << 20,
            metavar="N",
            help="refuse a JSON answer larger than N bytes (default 64 MiB)",
        )
        p.add_argument(
            "--max-blob-bytes",
            type=int,
            default=64 << 30,
            metavar="N",
            help="refuse a blob larger than N bytes before reading it (default 64 GiB)",
        )
        p.add_argument(
            "--min-rate",
            type=int,
            default=1 << 20,
            metavar="B",
            help="bytes per second a blob transfer must average (default 1 MiB/s)",
        )

    pub = sub.add_parser(
        "publish", help="upload an artifact or record directory to a registry (blobs it lacks, then the envelope)"
    )
    pub.add_argument("--registry", required=True, metavar="URL", help="the registry, e.g. http://127.0.0.1:8000")
    pub.add_argument("--token", metavar="T", help=f"a publishing token (default: ${TOKEN_ENV})")
    pub.add_argument(
        "--registry-key",
        type=Path,
        metavar="PEM",
        help="the registry's public key (default: fetch it; trust on first use)",
    )
    pub.add_argument(
        "--no-parents", action="store_true", help="fail instead of publishing a missing parent found locally"
    )
    pub.add_argument(
        "directory",
        type=Path,
        metavar="DIR",
        help="kv.safetensors + statement.dsse.json, or record.dsse.json + its files",
    )
    common(pub)
    pub.set_defaults(run=_guarded(_cmd_publish))

    pl = sub.add_parser(
        "pull", help="download an artifact, verify digests, signature and log inclusion, then write DIR"
    )
    pl.add_argument("--registry", required=True, metavar="URL", help="the registry, e.g. http://127.0.0.1:8000")
    pl.add_argument(
        "--out", type=Path, required=True, metavar="DIR", help="the artifact directory to create (must not exist)"
    )
    pl.add_argument(
        "--trusted-keys", type=Path, metavar="FILE", help="check the envelope's signature against these keys"
    )
    pl.add_argument(
        "--registry-key",
        type=Path,
        metavar="PEM",
        help="the registry's public key (default: fetch it; trust on first use)",
    )
    pl.add_argument(
        "--with-parents", action="store_true", help="pull the parent chain too, into DIR.parent-1, DIR.parent-2, ..."
    )
    pl.add_argument(
        "--token", metavar="T", help=f"a token, for registries whose reads need one (default: ${TOKEN_ENV})"
    )
    pl.add_argument("digest", metavar="sha256:HEX", help="the artifact's kv.safetensors digest")
    common(pl)
    pl.set_defaults(run=_guarded(_cmd_pull))

    mi = sub.add_parser(
        "mirror", help="copy every entry and blob of one registry into another, in log order, and prove it"
    )
    mi.add_argument("--from", dest="source", required=True, metavar="URL", help="the source registry")
    mi.add_argument("--to", dest="target", required=True, metavar="URL", help="the target registry")
    mi.add_argument(
        "--token",
        action="append",
        metavar="T",
        help=f"a token on the target bound to the source publishers' keys; repeat for one per publisher (default: ${TOKEN_ENV})",
    )
    mi.add_argument("--from-token", metavar="T", help="a token for the source, if its reads need one")
    mi.add_argument(
        "--registry-key-from", type=Path, metavar="PEM", help="the source's registry key (default: trust on first use)"
    )
    mi.add_argument(
        "--registry-key-to", type=Path, metavar="PEM", help="the target's registry key (default: trust on first use)"
    )
    common(mi)
    mi.set_defaults(run=_guarded(_cmd_mirror))


def main(argv: Sequence[str] | None = None) -> int:
    """Run a ``kvgraft`` command line (exit status 0 ok, 1 failed, 2 usage).

    These commands are registered on ``kvgraft``'s own parser; ``kvgraft.cli.main`` is the one
    place that prints results and one-line failures.
    """
    from kvgraft.cli import main as kvgraft_main  # lazy: kvgraft.cli imports this module

    return kvgraft_main(argv)
