"""``kvgraft-verify``: the standalone, offline verifier's command line.

Imports only ``kvgraft.verifier`` and ``kvgraft.schemas``. Every failure ends with exit status 1
and one line on stderr saying what failed and what to do; success prints one line on stdout
(or one JSON object with ``--json``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from enum import IntEnum
from pathlib import Path
from typing import Any, cast

from kvgraft.schemas import (
    MODEL_SIG_FILE,
    STATEMENT_FILE,
    InvalidDigestError,
    KvArtifactStatement,
    SchemaError,
    Sha256Digest,
    parse_sha256,
    sha256_bytes,
)

from ._internal.audit import audit_report, outside_keys_hint
from ._internal.cliparse import HelpFormatter, ToolParser, did_you_mean, examples_text, suggestions, walk
from ._internal.design import verify_follows_design
from ._internal.dsse import read_envelope, verify_envelope, verify_statement_envelope
from ._internal.errors import DigestMismatchError, MalformedInputError, VerificationError
from ._internal.evaluation import verify_evaluation_record
from ._internal.exactness import verify_exactness_record
from ._internal.grading import load_dataset
from ._internal.keys import TrustedKeys, load_public_key, load_trusted_keys, read_limited, trusted_key
from ._internal.lineage import verify_artifact_lineage
from ._internal.oms import (
    UncheckedModelSignature,
    VerifiedModelSignature,
    check_model_signature_beside,
    verify_model_signature,
)
from ._internal.replay import load_checkpoint, verify_replay
from ._internal.subjects import verify_subjects
from ._internal.tiles_cli import add_tiles_parser
from ._internal.tlog_cli import add_log_parser

__all__ = [
    "COMMAND_EXAMPLES", "COMMAND_GROUPS", "DATASET_HELP", "ExitCode", "HelpFormatter", "ToolParser", "VerifyParser", "build_parser",
    "did_you_mean", "examples_text", "main", "run", "suggestions", "walk",
]

#: The dataset formats ``load_dataset`` accepts, for every ``--dataset`` option's help (both tools).
DATASET_HELP = (
    "a JSONL file, one problem per line, all of one kind: AIME {\"prompt\": str, \"answer\": int}; "
    "GSM8K {\"question\": str, \"answer\": \"...#### N\"} (the number after the last ####); "
    "qa {\"question\": str, \"answer\": str or int}; at most 256 MiB (data/datasets/ holds examples)"
)


class ExitCode(IntEnum):
    """The verifier's exit statuses."""

    OK = 0
    #: Verification failed, or an input was malformed: one line on stderr says which.
    FAILED = 1
    #: The command line itself was wrong (argparse's convention).
    USAGE = 2


def _parent_statement(parent_dir: Path, trusted: TrustedKeys) -> KvArtifactStatement:
    """The parent artifact's statement: signed by ``trusted``, about the files in ``parent_dir``,
    and its own token digest (and chain key, for a root) recomputed."""
    envelope_path = parent_dir / STATEMENT_FILE
    _, statement = verify_statement_envelope(read_envelope(envelope_path), trusted)
    if not isinstance(statement, KvArtifactStatement):
        raise MalformedInputError(f"{envelope_path} is a {statement.predicate_type} statement, not a KV artifact",
                                  hint="pass the parent artifact's directory as --parent-dir")
    verify_subjects(statement, parent_dir, exclude=[envelope_path])
    try:
        verify_artifact_lineage(statement)
    except DigestMismatchError as e:
        raise type(e)(f"the parent artifact {parent_dir}: {e.message}", hint=e.hint) from e
    return statement


def _cmd_envelope(args: argparse.Namespace) -> dict[str, Any]:
    trusted = load_trusted_keys(args.trusted_keys)
    envelope = read_envelope(args.envelope)
    if args.parent_dir is not None and args.artifact_dir is None:
        raise MalformedInputError("--parent-dir checks an artifact's chain key, which needs --artifact-dir",
                                  hint="pass the artifact's directory as --artifact-dir too")
    if args.dsse_only:
        if args.artifact_dir is not None:
            raise MalformedInputError(
                "--artifact-dir needs the statement, which --dsse-only does not read",
                hint="drop one of the two options",
            )
        verified = verify_envelope(envelope, trusted)
        signers = ", ".join(f"{k.name} ({k.keyid[:16]})" for k in verified.signers)
        return {
            "verified": "dsse",
            "payload_type": verified.payload_type,
            "payload_sha256": sha256_bytes(verified.payload),
            "signers": [{"name": k.name, "keyid": k.keyid} for k in verified.signers],
            "summary": f"OK: DSSE envelope ({verified.payload_type}, {len(verified.payload)} payload bytes) "
            f"signed by {signers}",
        }
    verified, statement = verify_statement_envelope(envelope, trusted)
    result: dict[str, Any] = {
        "verified": "envelope",
        "predicate_type": statement.predicate_type,
        "signers": [{"name": k.name, "keyid": k.keyid} for k in verified.signers],
        "subjects": [s.name for s in statement.subject],
    }
    lineage = ""
    if args.artifact_dir is not None:
        result["subjects_checked"] = verify_subjects(statement, args.artifact_dir, exclude=[args.envelope])
        if isinstance(statement, KvArtifactStatement):
            parent = _parent_statement(args.parent_dir, trusted) if args.parent_dir is not None else None
            checked_lineage = verify_artifact_lineage(statement, parent)
            result["token_digest"] = "matches"
            result["chain_key"] = checked_lineage.chain_key
            lineage = "; " + checked_lineage.describe()
        elif args.parent_dir is not None:
            raise MalformedInputError(f"--parent-dir is for KV artifacts; this is a {statement.predicate_type} statement",
                                      hint="drop --parent-dir")
        # A model.sig beside the subjects is checked too when a trusted key signed it; one by
        # another key, or of a kind not checked here, is reported and passed over (oms.py).
        beside = check_model_signature_beside(args.artifact_dir, trusted)
        if isinstance(beside, UncheckedModelSignature):
            result["model_sig"] = {"checked": False, "signature": str(beside.signature), "reason": beside.reason}
            lineage += f"; {MODEL_SIG_FILE} not checked: {beside.reason}"
        elif beside is not None:
            result["model_sig"] = {"checked": True, **_model_sig_result(beside)}
            lineage += "; " + beside.describe()
    signers = ", ".join(f"{k.name} ({k.keyid[:16]})" for k in verified.signers)
    checked = f"; {len(result['subjects_checked'])} subject file(s) match{lineage}" if "subjects_checked" in result else ""
    result["summary"] = f"OK: {statement.predicate_type} statement signed by {signers}{checked}"
    return result


def _model_sig_result(verified: VerifiedModelSignature) -> dict[str, Any]:
    return {
        "signature": str(verified.signature),
        "signer": {"name": verified.signer.name, "keyid": verified.signer.keyid},
        "model_name": verified.model_name,
        "root_digest": verified.root_digest,
        "files": list(verified.files),
        "ignore_paths": list(verified.ignore_paths),
        "unsigned_paths": list(verified.unsigned_paths),
    }


def _cmd_oms(args: argparse.Namespace) -> dict[str, Any]:
    if args.public_key is not None:
        trusted = TrustedKeys((trusted_key(str(args.public_key), load_public_key(args.public_key)),))
    else:
        trusted = load_trusted_keys(args.trusted_keys)
    verified = verify_model_signature(args.directory, trusted, signature=args.signature,
                                      ignore_git_paths=not args.no_ignore_git_paths)
    return {
        "verified": "model_signing",
        **_model_sig_result(verified),
        "summary": f"OK: {args.directory}: {verified.describe()}; every file's sha256 matches, none missing, none extra",
    }


def _cmd_exactness(args: argparse.Namespace) -> dict[str, Any]:
    statement, signers = verify_exactness_record(args.record, load_trusted_keys(args.trusted_keys))
    p = statement.predicate
    s = p.summary
    return {
        "verified": "exactness",
        "model": p.model.name,
        "level": p.level,
        "shift": p.shift,
        "samples": s.samples,
        "bitwise_equal": s.bitwise_equal,
        "argmax_agree_all": s.argmax_agree_all,
        "max_kl_divergence": s.max_kl_divergence,
        "signers": signers,
        "summary": f"OK: {p.level} exactness record for {p.model.name}, signed by {', '.join(signers)}: "
        f"{s.bitwise_equal}/{s.samples} bitwise equal, argmax {s.argmax_agree_all}/{s.samples}, "
        f"max KL {s.max_kl_divergence!r}; every hash, KL and argmax recomputed",
    }


def _cmd_eval(args: argparse.Namespace) -> dict[str, Any]:
    trusted = load_trusted_keys(args.trusted_keys)
    verified = verify_evaluation_record(args.record, load_dataset(args.dataset), trusted)
    p = verified.statement.predicate
    a = p.aggregates
    design: dict[str, Any] | None = None
    if args.design is not None or p.design is not None:
        # An arm of a design counts only with its design, logged first: both are checked or nothing passes.
        if args.design is None or args.checkpoint is None or args.registry_key is None:
            named = f"names design {p.design.envelope_digest} (arm {p.design.arm})" if p.design else "was given --design"
            raise MalformedInputError(f"the evaluation {named}; checking it needs --design DIR, --checkpoint FILE and --registry-key PEM",
                                      hint="pass the design's directory, the registry's signed checkpoint and its public key")
        arm = verify_follows_design(args.record, verified, args.design, trusted, load_checkpoint(args.checkpoint, args.registry_key))
        design = {"arm": arm.arm.name, "design_log_index": arm.design.log_index, "log_index": arm.log_index}
    follows = (f"; arm {design['arm']} follows its design, logged at index {design['log_index']} after the design at "
               f"{design['design_log_index']}" if design else "")
    return {
        "design": design,
        "verified": "evaluation",
        "model": p.model.name,
        "dataset": {"name": p.dataset.name, "digest": p.dataset.digest},
        "items": a.items,
        "correct": a.correct,
        "accuracy": a.accuracy,
        "prompt_tokens": a.prompt_tokens,
        "decode_tokens": a.decode_tokens,
        "signers": list(verified.signers),
        "summary": f"OK: evaluation of {p.model.name} on {p.dataset.name}, signed by {', '.join(verified.signers)}: "
        f"{a.correct}/{a.items} correct (accuracy {a.accuracy!r}), {a.decode_tokens} decode tokens; "
        f"every hash, grade and aggregate recomputed{follows}",
    }


def _cmd_replay(args: argparse.Namespace) -> dict[str, Any]:
    trusted = load_trusted_keys(args.trusted_keys)
    checkpoint = load_checkpoint(args.checkpoint, args.registry_key)
    verified = verify_replay(args.replay, args.pre_registration, trusted, checkpoint)
    outcome = "reproduced every" if verified.reproduced else "did NOT reproduce the"
    return {
        "verified": "replay",
        "reproduced": verified.reproduced,
        "outputs": verified.outputs,
        "pre_registration_log_index": verified.pre_registration_log_index,
        "log_index": verified.log_index,
        "tree_size": checkpoint.size,
        "signers": list(verified.signers),
        "summary": f"OK: replay {outcome} pre-registered output ({verified.outputs} outputs); pre-registration "
        f"logged at index {verified.pre_registration_log_index} before the replay at {verified.log_index} "
        f"(checkpoint size {checkpoint.size}), signed by {', '.join(verified.signers)}",
    }


def _cmd_audit(args: argparse.Namespace) -> dict[str, Any]:
    trusted = load_trusted_keys(args.trusted_keys) if args.trusted_keys is not None else None
    if args.registry_key is not None:
        load_public_key(args.registry_key)  # an unreadable key is one error, before any line
    report = audit_report(args.report, trusted_keys=trusted, registry_key=args.registry_key)
    lines = [line.render() for line in report.lines]
    confirmed, unconfirmed, refuted = len(report.confirmed), len(report.unconfirmed), len(report.refuted)
    ok = refuted == 0 and unconfirmed == 0 and confirmed > 0
    if ok:
        verdict, error = f"OK: audit of {args.report}: all {confirmed} checks confirmed", None
    elif refuted or not unconfirmed:
        verdict, error = f"FAILED: audit of {args.report}: {refuted} refuted, {confirmed} confirmed", "AuditRefuted"
        if unconfirmed:
            verdict += f", {unconfirmed} unconfirmed"
    else:
        verdict, error = (
            f"UNCONFIRMED: audit of {args.report}: {unconfirmed} checks hold only by "
            f"{' and '.join(report.inside_keys)} from inside the folder, which whoever wrote it chose "
            f"(hint: {outside_keys_hint(report.inside_keys)})",
            "AuditUnconfirmed",
        )
    return {
        "ok": ok,
        "verified": "audit",
        "confirmed": [{"what": x.what, "value": x.detail} for x in report.confirmed],
        "unconfirmed": [{"what": x.what, "value": x.detail} for x in report.unconfirmed],
        "refuted": [{"what": x.what, "why": x.detail} for x in report.refuted],
        # Read by main() when ok is false: the one line on stderr.
        "error": error,
        "message": verdict.split(": ", 1)[1],
        "summary": "\n".join([*lines, verdict]),
    }


def _artifact_arg(value: str) -> Path | Sha256Digest:
    # The conformance protocol: "sha256:<hex>" is a digest when it is well formed and no file
    # of that name exists; anything else is a path.
    if value.startswith("sha256:") and not Path(value).exists():
        try:
            return parse_sha256(value)
        except InvalidDigestError:
            return Path(value)
    return Path(value)


def _cmd_verify_bundle(args: argparse.Namespace) -> dict[str, Any]:
    # Imported here: sigstore is only needed for bundles, and is slow to import.
    from ._internal.bundles import CertificateIdentity, ManagedKey, verify_bundle

    policy: CertificateIdentity | ManagedKey
    if args.key is not None and (args.certificate_identity is not None or args.certificate_oidc_issuer is not None):
        raise MalformedInputError(
            "verify-bundle got both --key and a certificate identity; a bundle is verified one way",
            hint="pass --key PEM for managed-key bundles, or --certificate-identity and --certificate-oidc-issuer",
        )
    if args.key is not None:
        policy = ManagedKey(read_limited(args.key, 64 * 1024, "key file"))
    else:
        if args.certificate_identity is None or args.certificate_oidc_issuer is None:
            raise MalformedInputError(
                "verify-bundle needs --certificate-identity and --certificate-oidc-issuer, or --key",
                hint="name the signer you expect",
            )
        policy = CertificateIdentity(args.certificate_identity, args.certificate_oidc_issuer)
    verified = verify_bundle(
        args.bundle, _artifact_arg(args.artifact), policy, trusted_root=args.trusted_root, staging=args.staging
    )
    return {
        "verified": "bundle",
        "kind": verified.kind,
        "signer": verified.signer,
        "summary": f"OK: {verified.kind} bundle {args.bundle} verified for {verified.signer}",
    }


class VerifyParser(ToolParser):
    """``kvgraft-verify``'s parsers: ``--json`` is accepted anywhere on the command line."""

    GLOBAL_OPTIONS = (("--json", "print one JSON object instead of a line"),)


#: ``kvgraft-verify --help`` lists the commands under these headings.
COMMAND_GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("signatures", ("envelope", "oms", "verify-bundle")),
    ("records", ("exactness", "eval", "replay", "audit")),
    ("logs", ("log", "tiles")),
)

EXAMPLES: tuple[tuple[str, str], ...] = (
    ("kvgraft-verify audit report/ --trusted-keys keys.json --registry-key registry.pub.pem",
     "re-check every record and number of a report folder ('kvgraft report' writes one) against keys from outside it"),
    ("kvgraft-verify envelope art/statement.dsse.json --trusted-keys trusted-keys.json --artifact-dir art",
     "an artifact's signature, its files and its token digest"),
    ("kvgraft-verify --json exactness record --trusted-keys trusted-keys.json",
     "an exactness record, every hash, KL and argmax recomputed; one JSON object out"),
)


#: Examples at the end of a command's own ``--help`` (tests/cli/test_help.py parses each one).
COMMAND_EXAMPLES: dict[str, tuple[tuple[str, str], ...]] = {
    "audit": (
        ("kvgraft-verify audit report --trusted-keys trusted.json --registry-key registry-key.pub.pem",
         "every record and number of the folder, against keys you got from outside it"),
    ),
    "envelope": (
        ("kvgraft-verify envelope art/statement.dsse.json --trusted-keys trusted.json --artifact-dir art",
         "the signature, the files and the token digest of an artifact"),
        ("kvgraft-verify envelope child/statement.dsse.json --trusted-keys trusted.json --artifact-dir child --parent-dir art",
         "a child artifact, its chain key recomputed from its parent's"),
    ),
    "eval": (
        ("kvgraft-verify eval ev --dataset data/datasets/gsm8k_test.jsonl --trusted-keys trusted.json",
         "every hash, grade and aggregate of an evaluation recomputed"),
        ("kvgraft-verify eval results/capability/arms/flywheel --dataset data/datasets/gsm8k_test.jsonl --trusted-keys "
         "results/capability/trusted-keys.json --design results/capability/design --checkpoint results/capability/checkpoint.txt "
         "--registry-key results/capability/registry-key.pub.pem",
         "and that an arm follows its pre-registered design, logged after it"),
    ),
    "exactness": (
        ("kvgraft-verify exactness record --trusted-keys trusted.json", "every logits hash, KL and argmax recomputed with numpy"),
    ),
}


def _version() -> str:
    # The distribution's version (no import of the kvgraft package's CLI).
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kvgraft")
    except PackageNotFoundError:  # a source tree that was never installed
        return "0+unknown"


def build_parser() -> ToolParser:
    """The argument parser (exposed for the docs and tests)."""
    parser = VerifyParser.top(
        prog="kvgraft-verify",
        description="Verify kvgraft artifacts, records and Sigstore bundles offline, without the engine.",
        version=_version(),
    )
    # Its parsers are VerifyParsers (add_subparsers uses the parent's class); the helpers that add
    # subcommands take any ArgumentParser's.
    sub = cast("argparse._SubParsersAction[argparse.ArgumentParser]",
               parser.add_subparsers(dest="command", required=True, metavar="COMMAND"))

    env = sub.add_parser("envelope", help="verify a DSSE envelope against trusted keys (and its subjects)")
    env.add_argument("envelope", type=Path, help="the .dsse.json envelope")
    env.add_argument("--trusted-keys", type=Path, required=True, help="trusted-keys JSON file")
    env.add_argument(
        "--artifact-dir",
        type=Path,
        help="check that this directory holds exactly the subjects (and, when there, that its model.sig verifies "
        "if one of the same trusted keys signed it); for a KV artifact also recompute its token digest, and a root's chain key",
    )
    env.add_argument(
        "--parent-dir",
        type=Path,
        help="with --artifact-dir: the parent artifact's directory (its envelope verified with the same keys); "
        "recompute the child's chain key from the parent's",
    )
    env.add_argument(
        "--dsse-only",
        action="store_true",
        help="check the DSSE signatures and threshold only; do not read the payload as an in-toto statement",
    )
    env.set_defaults(run=_cmd_envelope)

    om = sub.add_parser(
        "oms",
        help=f"verify an OpenSSF model signing signature ({MODEL_SIG_FILE}) against the files of a directory",
    )
    om.add_argument("directory", type=Path, metavar="DIR", help="the signed directory")
    om.add_argument("--signature", type=Path, help=f"the model_signing bundle (default: DIR/{MODEL_SIG_FILE})")
    om.add_argument("--no-ignore-git-paths", action="store_true",
                    help="check the top-level .git, .gitattributes, .github and .gitignore too, for a signature made "
                    "with model_signing's --no-ignore-git-paths or kvgraft oms sign's (ignored by default, as "
                    "model_signing does; paths the signature itself lists as ignored stay ignored)")
    om_keys = om.add_mutually_exclusive_group(required=True)
    om_keys.add_argument("--public-key", type=Path, help="the signer's ECDSA P-256 or P-384 public key (PEM)")
    om_keys.add_argument("--trusted-keys", type=Path, help="trusted-keys JSON file (its ECDSA keys are tried by hint)")
    om.set_defaults(run=_cmd_oms)

    vb = sub.add_parser(
        "verify-bundle",
        help="verify a Sigstore bundle (sigstore-conformance client protocol)",
    )
    vb.add_argument("--bundle", type=Path, required=True, help="the Sigstore bundle JSON")
    vb.add_argument("--certificate-identity", help="the signing certificate's expected SAN")
    vb.add_argument("--certificate-oidc-issuer", help="the signing certificate's expected OIDC issuer")
    vb.add_argument("--key", type=Path, help="a PEM public key, for bundles signed by a managed key")
    vb.add_argument("--trusted-root", type=Path, help="trusted_root.json (default: the shipped production root)")
    vb.add_argument("--staging", action="store_true", help="use the shipped staging trusted root")
    vb.add_argument("artifact", metavar="FILE_OR_sha256:HEX", help="the signed file, or its sha256 digest")
    vb.set_defaults(run=_cmd_verify_bundle)

    ex = sub.add_parser("exactness", help="re-check an exactness record and its logits files (numpy only)")
    ex.add_argument("record", type=Path, help="the record directory (record.dsse.json and logits/)")
    ex.add_argument("--trusted-keys", type=Path, required=True, help="trusted-keys JSON file")
    ex.set_defaults(run=_cmd_exactness)

    ev = sub.add_parser("eval", help="re-check an evaluation record: hashes, grades and aggregates")
    ev.add_argument("record", type=Path, help="the record directory (record.dsse.json and outputs.jsonl)")
    ev.add_argument("--dataset", type=Path, required=True, help="the dataset the evaluation ran on: " + DATASET_HELP)
    ev.add_argument("--trusted-keys", type=Path, required=True, help="trusted-keys JSON file")
    ev.add_argument("--design", type=Path, metavar="DIR",
                    help="the pre-registered design the record is an arm of: checks it follows it and was logged after it")
    ev.add_argument("--checkpoint", type=Path, help="with --design: the registry's signed checkpoint")
    ev.add_argument("--registry-key", type=Path, metavar="PEM", help="with --design: the registry's Ed25519 public key (PEM)")
    ev.set_defaults(run=_cmd_eval)

    rp = sub.add_parser("replay", help="re-check a replay against its pre-registration and the log order")
    rp.add_argument("replay", type=Path, help="the replay directory (record.dsse.json, outputs.jsonl, log.json)")
    rp.add_argument("--pre-registration", type=Path, required=True, help="the pre-registration directory")
    rp.add_argument("--trusted-keys", type=Path, required=True, help="trusted-keys JSON file")
    rp.add_argument("--checkpoint", type=Path, required=True, help="the registry's signed checkpoint")
    rp.add_argument("--registry-key", type=Path, required=True, help="the registry's Ed25519 public key (PEM)")
    rp.set_defaults(run=_cmd_replay)

    au = sub.add_parser("audit", help="re-check every record and number in a report folder; one line per number")
    au.add_argument("report", type=Path, help="the report folder (see docs/records.md)")
    au.add_argument(
        "--trusted-keys", type=Path,
        help="the publishers' trusted-keys file, from outside the folder; without it the folder's own "
        "trusted-keys.json is used and every signature check is UNCONFIRMED (exit 1)",
    )
    au.add_argument(
        "--registry-key", type=Path,
        help="the registry's Ed25519 public key (PEM), from outside the folder; without it the folder's "
        "registry-key.pub.pem is used and every log check is UNCONFIRMED (exit 1)",
    )
    au.set_defaults(run=_cmd_audit)

    add_log_parser(sub)
    add_tiles_parser(sub)
    parser.set_command_groups(COMMAND_GROUPS, EXAMPLES)
    for path, command_parser in walk(parser):
        if len(path) == 1 and path[0] in COMMAND_EXAMPLES:
            command_parser.epilog = examples_text(COMMAND_EXAMPLES[path[0]])
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``kvgraft-verify``; return the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        result = args.run(args)
    except VerificationError as e:
        return _fail(args, type(e).__name__, str(e))
    except SchemaError as e:
        return _fail(args, "MalformedInputError", f"{e} (hint: pass the file the producer wrote, unmodified)")
    except Exception as e:  # noqa: BLE001 - last resort: an auditor must never see a traceback
        if os.environ.get("KVGRAFT_DEBUG"):
            raise
        return _fail(args, "InternalError", f"unexpected {type(e).__name__}: {e} (this is a bug in kvgraft-verify; set KVGRAFT_DEBUG=1 for a traceback and report it)")
    # Only the audit reports failure as a result (it prints every line first); others raise.
    ok = result.pop("ok", True)
    error, message = result.pop("error", None), result.pop("message", None)
    if args.json:
        sys.stdout.write(json.dumps({"ok": ok, **result}, sort_keys=True) + "\n")
    else:
        sys.stdout.write(result["summary"] + "\n")
    if not ok:
        sys.stderr.write(f"kvgraft-verify: {error}: {message}\n")
        return ExitCode.FAILED
    return ExitCode.OK


def _fail(args: argparse.Namespace, error: str, message: str) -> int:
    line = " ".join(message.split())
    if args.json:
        sys.stdout.write(json.dumps({"ok": False, "error": error, "message": line}, sort_keys=True) + "\n")
    sys.stderr.write(f"kvgraft-verify: {error}: {line}\n")
    return ExitCode.FAILED


def run() -> None:
    """Console-script entry point."""
    raise SystemExit(main())


if __name__ == "__main__":
    run()
