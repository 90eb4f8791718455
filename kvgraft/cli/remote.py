"""The registry client's ``kvgraft`` subcommands: ``publish``, ``pull``, ``mirror`` and ``report``;
and the registry session the flywheel commands publish through.

Importing this module imports neither httpx nor the registry server: each command loads
``kvgraft.registry.client`` when it runs, so the rest of ``kvgraft`` works without the
``registry`` extra. A client failure is the client's own ``RegistryClientError`` subclass, which
``kvgraft`` reports by its real class name (``kvgraft: ListingError: ...``).
"""

from __future__ import annotations

import argparse
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvgraft.schemas import REPORT_DATASETS_DIR, TRUSTED_KEYS_FILE

from ._common import REGISTRY_CLIENT, TOKEN_ENV, CliError, Command, add_command, needs, token

if TYPE_CHECKING:
    from kvgraft.registry.client import (
        CheckpointMemory,
        MirrorResult,
        PublishResult,
        PullResult,
        RegistryClient,
        RegistryKey,
    )

#: The client bounds what it reads, so running out of memory means a limit above what is free.
_OUT_OF_MEMORY_HINT = "lower --max-json-bytes, or run where more memory is free"


def add_registry_options(p: argparse.ArgumentParser, *, required: bool, token_help: str = "a publishing token") -> None:
    """``--registry URL``, ``--token T`` and ``--registry-key PEM``: which registry, as whom, pinned how."""
    p.add_argument("--registry", required=required, metavar="URL", help="a kvgraft registry, e.g. http://127.0.0.1:8000")
    p.add_argument("--token", metavar="T", help=f"{token_help} (default: ${TOKEN_ENV})")
    p.add_argument("--registry-key", type=Path, metavar="PEM",
                   help="the registry's public key (default: fetch it; trust on first use)")
    _add_accept_new_origin(p)


def _add_accept_new_origin(p: argparse.ArgumentParser) -> None:
    p.add_argument("--accept-new-origin", action="store_true",
                   help="accept a log whose registry key this machine verified under another origin (the operator "
                   "renamed the log on purpose); refused as a possible fork otherwise")


def _memory(args: argparse.Namespace) -> CheckpointMemory:
    """The checkpoint memory under $KVGRAFT_HOME, accepting a new origin for a known key only with --accept-new-origin."""
    from kvgraft.registry.client import CheckpointMemory

    return CheckpointMemory.default(accept_new_origin=getattr(args, "accept_new_origin", False))


@contextmanager
def registry_session(args: argparse.Namespace, *, token_required: bool) -> Iterator[tuple[RegistryClient, RegistryKey]]:
    """A client of ``--registry`` (the client's default limits) and the key its checkpoints must be
    signed with (``--registry-key``, else trusted on first use), cosigned as ``$KVGRAFT_WITNESS_POLICY``
    requires when it is set."""
    with needs(REGISTRY_CLIENT):
        from kvgraft.registry.client import RegistryClient, registry_key, witness_policy_from
    secret = token(args.token, required=token_required, what="publishing")
    policy = witness_policy_from(getattr(args, "witness_policy", None))
    with RegistryClient(args.registry, token=secret, witness_policy=policy, memory=_memory(args)) as client:
        yield client, registry_key(client, args.registry_key)


def _client(args: argparse.Namespace, url: str, secret: str | None, *, witnessed: bool = True) -> RegistryClient:
    """A client of ``url`` under the command's ``--timeout``, ``--max-json-bytes``, ... limits and,
    when ``witnessed``, its witness policy (``--witness-policy``, else ``$KVGRAFT_WITNESS_POLICY``)."""
    from kvgraft.registry.client import ClientLimits, RegistryClient, witness_policy_from

    limits = ClientLimits(timeout=args.timeout, max_json_bytes=args.max_json_bytes, max_blob_bytes=args.max_blob_bytes,
                          min_rate=args.min_rate)
    policy = witness_policy_from(args.witness_policy) if witnessed else None
    return RegistryClient(url, token=secret, limits=limits, witness_policy=policy, witness_wait=args.witness_wait,
                          memory=_memory(args))


# --- publish -------------------------------------------------------------------------------------


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
    from kvgraft.registry.client import publish

    with _client(args, args.registry, token(args.token, required=True)) as c:
        r = publish(c, args.directory, registry_key_file=args.registry_key, publish_parents=not args.no_parents,
                    progress=not args.json)
    lines = []
    for p in r.parents:
        lines += [f"parent first: {line.strip()}" if i == 0 else line for i, line in enumerate(_publish_lines(p))]
    lines += _publish_lines(r)
    lines.append(
        f"  verified: leaf = SHA-256(0x00 || envelope), inclusion at tree size {r.tree_size}, "
        f"checkpoint signed by {r.registry_key.describe()}"
    )
    return {**r.to_json(), "summary": "\n".join(lines)}


# --- pull ----------------------------------------------------------------------------------------


def _pull_line(r: PullResult) -> str:
    return (
        f"pulled artifact {r.artifact_digest} into {r.directory} ({len(r.files)} file(s), {r.size} bytes); "
        f"entry {r.log_index} of {r.registry}"
    )


def _cmd_pull(args: argparse.Namespace) -> dict[str, Any]:
    from kvgraft.registry.client import pull
    from kvgraft.verifier import load_trusted_keys

    trusted = load_trusted_keys(args.trusted_keys) if args.trusted_keys is not None else None
    with _client(args, args.registry, token(args.token, required=False)) as c:
        # A short digest (a unique start of one, as git takes) is resolved by the registry first.
        r = pull(c, c.resolve_digest(args.digest), args.out, trusted_keys=trusted, registry_key_file=args.registry_key,
                 with_parents=args.with_parents, progress=not args.json)
    lines = [_pull_line(r)] + [f"  parent: {_pull_line(p)}" for p in r.parents]
    lines.append(
        f"  verified: every blob's sha256, the files are exactly the statement's subjects, inclusion at tree size "
        f"{r.tree_size}, checkpoint signed by {r.registry_key.describe()}"
    )
    lines.append(f"  {r.signature}" + ("" if r.signature_checked else "; pass --trusted-keys FILE to check it"))
    return {**r.to_json(), "summary": "\n".join(lines)}


# --- mirror --------------------------------------------------------------------------------------


def _cmd_mirror(args: argparse.Namespace) -> dict[str, Any]:
    from kvgraft.registry.client import mirror

    tokens = list(args.token or [])
    if not tokens and os.environ.get(TOKEN_ENV):
        tokens = [os.environ[TOKEN_ENV]]
    if not tokens:
        raise CliError("mirror needs a token for the target registry", hint=f"pass --token T, or export {TOKEN_ENV}=T")
    # The witness policy is the source's: the target is another log, proved equal to it here.
    with _client(args, args.source, args.from_token) as src, _client(args, args.target, tokens[0], witnessed=False) as dst:
        r = mirror(src, dst, source_key_file=args.registry_key_from, target_key_file=args.registry_key_to,
                   extra_tokens=tokens[1:], progress=not args.json)
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


# --- report --------------------------------------------------------------------------------------


def _cmd_report(args: argparse.Namespace) -> dict[str, Any]:
    from kvgraft.registry.report import fetch_report

    with registry_session(args, token_required=False) as (client, reg_key):
        if args.entry:
            refs = args.entry
        else:
            # Every entry up to one verified checkpoint: a listing that never ends stops there
            # (and the client refuses one that does not advance).
            head, _ = client.signed_head(reg_key)
            refs = [str(e["log_index"]) for e in client.iter_entries(below=head.size)]
        made = fetch_report(client, reg_key, refs, args.out)
    try:
        if args.trusted_keys is not None:
            shutil.copyfile(args.trusted_keys, args.out / TRUSTED_KEYS_FILE)
        if args.dataset:
            (args.out / REPORT_DATASETS_DIR).mkdir(exist_ok=True)
            for d in args.dataset:
                if not d.is_file():
                    raise CliError(f"dataset {d} is not a file", hint="pass the dataset files the evaluations name")
                shutil.copyfile(d, args.out / REPORT_DATASETS_DIR / d.name)
    except OSError as e:
        raise CliError(f"cannot copy into the report {args.out}: {e.strerror or e}",
                       hint="check the --trusted-keys and --dataset files and the free space") from e
    counts = {k: len(v) for k, v in made.items()}
    return {"report": str(args.out), "entries": counts,
            "summary": f"{args.out}: " + ", ".join(f"{n} {k}" for k, n in sorted(counts.items())) +
            f" from {args.registry}, with log proofs; check it with: kvgraft-verify audit {args.out} "
            f"--trusted-keys {args.trusted_keys or 'PUBLISHERS_KEYS.json'} --registry-key {args.registry_key or 'REGISTRY_KEY.pem'} "
            "(keys from outside the folder: the copies inside it are not trusted)"}


# --- wiring --------------------------------------------------------------------------------------


def _add_limit_options(p: argparse.ArgumentParser) -> None:
    # The defaults are the client's own (kvgraft.registry.client.ClientLimits); repeated here
    # because importing the client would import httpx before any command runs.
    p.add_argument("--timeout", type=float, default=60.0, metavar="S",
                   help="seconds one request may take in all, connect to last byte (default 60); "
                   "a blob gets S plus its size at --min-rate")
    p.add_argument("--max-json-bytes", type=int, default=64 << 20, metavar="N",
                   help="refuse a JSON answer larger than N bytes (default 64 MiB)")
    p.add_argument("--max-blob-bytes", type=int, default=64 << 30, metavar="N",
                   help="refuse a blob larger than N bytes before reading it (default 64 GiB)")
    p.add_argument("--min-rate", type=int, default=1 << 20, metavar="B",
                   help="bytes per second a blob transfer must average (default 1 MiB/s)")
    p.add_argument("--witness-policy", type=Path, metavar="FILE",
                   help="accept only checkpoints cosigned as this c2sp.org/tlog-policy file requires (docs/witness.md; "
                   "default: $KVGRAFT_WITNESS_POLICY; for mirror, the source's checkpoints)")
    p.add_argument("--witness-wait", type=float, default=30.0, metavar="S",
                   help="with a witness policy, seconds to wait for the witnesses to cosign a checkpoint holding the "
                   "entry (default 30)")


def _add_client_command(sub: argparse._SubParsersAction[argparse.ArgumentParser], name: str, command: Command,
                        help: str) -> argparse.ArgumentParser:
    """A command that transfers from or to a registry: a memory limit the machine cannot meet is one line too."""
    return add_command(sub, name, command, help=help, extra=REGISTRY_CLIENT, out_of_memory_hint=_OUT_OF_MEMORY_HINT)


def add_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``publish``, ``pull``, ``mirror`` and ``report`` to ``kvgraft``'s subcommands."""
    pub = _add_client_command(sub, "publish", _cmd_publish,
                              help="upload an artifact or record directory to a registry (blobs it lacks, then the envelope)")
    add_registry_options(pub, required=True)
    pub.add_argument("--no-parents", action="store_true", help="fail instead of publishing a missing parent found locally")
    pub.add_argument("directory", type=Path, metavar="DIR",
                     help="kv.safetensors + statement.dsse.json, or record.dsse.json + its files")
    _add_limit_options(pub)

    pl = _add_client_command(sub, "pull", _cmd_pull,
                             help="download an artifact, verify digests, signature and log inclusion, then write DIR")
    add_registry_options(pl, required=True, token_help="a token, for registries whose reads need one")
    pl.add_argument("--out", type=Path, required=True, metavar="DIR", help="the artifact directory to create (must not exist)")
    pl.add_argument("--trusted-keys", type=Path, metavar="FILE", help="check the envelope's signature against these keys")
    pl.add_argument("--with-parents", action="store_true",
                    help="pull the parent chain too, into DIR.parent-1, DIR.parent-2, ...")
    pl.add_argument("digest", metavar="sha256:HEX",
                    help="the artifact's kv.safetensors digest, or a unique start of it (at least 4 hex digits), as git takes")
    _add_limit_options(pl)

    mi = _add_client_command(sub, "mirror", _cmd_mirror,
                             help="copy every entry and blob of one registry into another, in log order, and prove it")
    mi.add_argument("--from", dest="source", required=True, metavar="URL", help="the source registry")
    mi.add_argument("--to", dest="target", required=True, metavar="URL", help="the target registry")
    mi.add_argument("--token", action="append", metavar="T",
                    help="a token on the target bound to the source publishers' keys; repeat for one per publisher "
                    f"(default: ${TOKEN_ENV})")
    mi.add_argument("--from-token", metavar="T", help="a token for the source, if its reads need one")
    mi.add_argument("--registry-key-from", type=Path, metavar="PEM", help="the source's registry key (default: trust on first use)")
    mi.add_argument("--registry-key-to", type=Path, metavar="PEM", help="the target's registry key (default: trust on first use)")
    _add_accept_new_origin(mi)
    _add_limit_options(mi)

    rep = add_command(sub, "report", _cmd_report, extra=REGISTRY_CLIENT,
                      help="pull entries and their blobs into an audit folder, with log proofs")
    rep.add_argument("--out", type=Path, required=True, metavar="DIR",
                     help="the report folder to create ('kvgraft-verify audit DIR' checks it offline)")
    rep.add_argument("--entry", action="append", help="a log index or envelope digest (repeat; default: every entry)")
    rep.add_argument("--trusted-keys", type=Path, metavar="FILE", help="copied into the report as trusted-keys.json")
    rep.add_argument("--dataset", type=Path, action="append", metavar="FILE",
                     help="a dataset file the evaluations name, copied for the audit's regrading (repeat)")
    add_registry_options(rep, required=True)
