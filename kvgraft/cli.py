"""``kvgraft``: the producer's command line.

Subcommands here need only the verifier and schemas; engine and registry commands import
their packages lazily, so ``kvgraft keys`` works without torch installed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvgraft.flywheel_cli import add_flywheel_commands
from kvgraft.registry.cli import add_registry_commands
from kvgraft.registry.client_cli import add_client_commands
from kvgraft.schemas import (
    KvgraftError,
    Statement,
    Subject,
    SubjectDigest,
    canonical_model,
    hex_of,
    parse_json,
    parse_statement,
    sha256_file,
)
from kvgraft.verifier import (
    TrustedKeys,
    envelope_json,
    generate_private_key,
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


class CliError(KvgraftError):
    """A user-facing failure of a ``kvgraft`` command (bad options, local files): one line, with a hint."""

    def __init__(self, message: str, *, hint: str) -> None:
        super().__init__(message, hint=hint)


def _passphrase(env_var: str | None) -> bytes | None:
    if env_var is None:
        return None
    value = os.environ.get(env_var)
    if not value:
        raise CliError(f"environment variable {env_var} is empty or unset", hint=f"export {env_var}=... first")
    return value.encode("utf-8")


def _cmd_keys_generate(args: argparse.Namespace) -> dict[str, Any]:
    key = generate_private_key()
    pub_path = args.out.with_name(args.out.name + ".pub")
    save_private_key(key, args.out, _passphrase(args.passphrase_env))
    save_public_key(key.public_key(), pub_path)
    kid = keyid_of(key.public_key())
    return {
        "private_key": str(args.out),
        "public_key": str(pub_path),
        "keyid": kid,
        "summary": f"wrote {args.out} (private, mode 0600) and {pub_path}; keyid {kid}",
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
    return {"file": str(args.file), "keyid": new.keyid, "summary": f"{args.file} now trusts {args.name} ({new.keyid})"}


def _cmd_sign(args: argparse.Namespace) -> dict[str, Any]:
    try:
        predicate = parse_json(args.predicate.read_bytes(), what=f"predicate file {args.predicate}")
    except OSError as e:
        raise CliError(f"cannot read predicate file {args.predicate}: {e.strerror}", hint="pass a JSON file") from e
    if not isinstance(predicate, dict):
        raise CliError(f"predicate file {args.predicate} must hold a JSON object", hint="wrap the fields in {...}")
    subjects = []
    for path in args.subject:
        if not path.is_file():
            raise CliError(f"subject {path} is not a file", hint="name each file the statement is about")
        subjects.append(Subject(name=path.name, digest=SubjectDigest(sha256=hex_of(sha256_file(path)))))
    raw = Statement(subject=subjects, predicate_type=args.predicate_type, predicate=predicate)
    # Re-parse through the typed model for known predicate types, so nothing invalid is signed.
    statement = parse_statement(canonical_model(raw), what="statement to sign")
    with open_signing_key(args.key, _passphrase(args.passphrase_env)) as signer:
        envelope = sign_statement(statement, [signer])
        kid = signer.keyid
    write_atomic(args.out, envelope_json(envelope), 0o644)
    return {"envelope": str(args.out), "keyid": kid, "summary": f"signed {len(subjects)} subject(s) as {args.out} with key {kid}"}


# --- engine commands (torch imported lazily) ---------------------------------------------------


def _engine() -> Any:
    try:
        import kvgraft.engine as engine
    except ImportError as e:
        raise CliError(f"the engine is not installed ({e.name} is missing)", hint="pip install 'kvgraft[engine]' (torch==2.13.0 first)") from e
    return engine


def add_trust_options(p: argparse.ArgumentParser) -> None:
    """The options that say which keys an artifact must be signed by before it is loaded."""
    p.add_argument("--trusted-keys", type=Path, metavar="FILE",
                   help="verify artifact signatures against these keys (default: $KVGRAFT_TRUSTED_KEYS, "
                   "else $KVGRAFT_HOME/trusted-keys.json when it exists)")
    p.add_argument("--trust-local-key", action="store_true",
                   help="also trust this machine's local key ($KVGRAFT_HOME/keys/local.pem.pub)")
    p.add_argument("--insecure-skip-verify", action="store_true",
                   help="do NOT check signatures (prints a warning; never for artifacts from elsewhere)")


def _trust(args: argparse.Namespace) -> Any:
    """The engine's ``Trust`` for this command's options: keys to verify against, or a loud skip.

    Refuses (one line) when no keys are given or configured and the user did not opt out.
    """
    engine = _engine()
    trust = engine.resolve_trust(getattr(args, "trusted_keys", None), trust_local_key=getattr(args, "trust_local_key", False),
                                 insecure_skip_verify=getattr(args, "insecure_skip_verify", False))
    if trust.skip:
        sys.stderr.write(f"kvgraft: {engine.SKIP_WARNING}\n")
        sys.stderr.flush()
    return trust


def _load(engine: Any, directory: Path, model: Any, profile: Any, trust: Any) -> Any:
    return engine.load_artifact(directory, model, profile, trusted=trust.keys, insecure_skip_verify=trust.skip)


def _cmd_models_list(args: argparse.Namespace) -> dict[str, Any]:
    engine = _engine()
    rows = []
    for spec in engine.MODELS.values():
        installed, cached = engine.is_installed(spec), engine.is_cached(spec)
        fingerprint = f"gguf sha256:{spec.gguf_sha256}" if spec.gguf_sha256 else "seeded weights (built in code)"
        rows.append({"name": spec.name, "architecture": spec.architecture, "window": spec.window,
                     "fingerprint": fingerprint, "installed": installed, "cached": cached, "description": spec.description})
    lines = [f"{'NAME':<16} {'ARCH':<7} {'WINDOW':>6}  {'INSTALLED':<9} {'CACHED':<6} FINGERPRINT"]
    lines += [f"{r['name']:<16} {r['architecture']:<7} {r['window']:>6}  {'yes' if r['installed'] else 'no':<9} "
              f"{'yes' if r['cached'] else 'no':<6} {r['fingerprint']}" for r in rows]
    return {"models": rows, "summary": "\n".join(lines)}


def _model_and_profile(engine: Any, name: str, profile: str) -> tuple[Any, Any]:
    return engine.load_model(name), engine.current_profile(profile)


def _cmd_capture(args: argparse.Namespace) -> dict[str, Any]:
    engine = _engine()
    text = engine.read_text(args.text_file)
    # Only a parent is loaded: it is verified like any grafted artifact.
    trust = _trust(args) if args.parent else None
    model, profile = _model_and_profile(engine, args.model, args.profile)
    parent = _load(engine, args.parent, model, profile, trust) if args.parent else None
    note = ""
    key = args.key
    if key is None:
        key, made = engine.ensure_local_key()
        note = f" (signed with the local key {key}{', made now' if made else ''}; pass --key to use yours)"
    captured = engine.capture(model, profile, text, args.out, key=key, parent=parent, passphrase=_passphrase(args.passphrase_env))
    p = captured.statement.predicate
    return {
        "artifact": str(captured.directory), "kv_sha256": captured.kv_digest.removeprefix("sha256:"),
        "positions": [p.positions.start, p.positions.end], "tokens": len(p.tokens.ids), "keyid": captured.keyid,
        "chain_key": p.chain_key, "key": str(key),
        "summary": f"captured {len(p.tokens.ids)} tokens at [{p.positions.start}, {p.positions.end}) of {args.model} "
        f"into {captured.directory}; kv {captured.kv_digest}{note}",
    }


def _cmd_graft(args: argparse.Namespace) -> dict[str, Any]:
    engine = _engine()
    text = engine.read_text(args.text_file)
    trust = _trust(args)
    model_name = _artifact_model(engine, args.artifact, trust)
    model, profile = _model_and_profile(engine, model_name, args.profile)
    artifact = _load(engine, args.artifact, model, profile, trust)
    result = engine.graft(model, profile, artifact, text).summary()
    result["signature"] = artifact.signature
    result["summary"] = f"graft of {args.artifact}: logits_sha256 {result['logits_sha256']} over positions {result['positions']}"
    return result


def _artifact_model(engine: Any, directory: Path, trust: Any) -> str:
    """The model the artifact names (to load it), read from its statement after the signature
    is verified: an unsigned payload is never parsed unless the user skipped the check."""
    statement_path = directory / engine.STATEMENT_FILE
    if not statement_path.is_file():
        raise CliError(f"{directory} has no {engine.STATEMENT_FILE}", hint="pass an artifact directory written by 'kvgraft capture'")
    statement, _ = engine.read_statement(directory, trust.keys, trust.skip)
    return str(statement.predicate.model.name)


def _cmd_fresh(args: argparse.Namespace) -> dict[str, Any]:
    engine = _engine()
    prefix = engine.read_text(args.prefix_file, what="prefix file")
    text = engine.read_text(args.text_file)
    model, profile = _model_and_profile(engine, args.model, args.profile)
    result = engine.fresh(model, profile, prefix, text).summary()
    result["summary"] = f"fresh {args.model}: logits_sha256 {result['logits_sha256']} over positions {result['positions']}"
    return result


def _cmd_single_pass(args: argparse.Namespace) -> dict[str, Any]:
    engine = _engine()
    prefix = engine.read_text(args.prefix_file, what="prefix file")
    text = engine.read_text(args.text_file)
    model, profile = _model_and_profile(engine, args.model, args.profile)
    result = engine.single_pass(model, profile, prefix, text).summary()
    result["summary"] = f"single-pass {args.model}: logits_sha256 {result['logits_sha256']} over positions {result['positions']}"
    return result


def _cmd_generate(args: argparse.Namespace) -> dict[str, Any]:
    engine = _engine()
    if args.max_new_tokens < 1:
        raise CliError("--max-new-tokens must be at least 1", hint="e.g. --max-new-tokens 64")
    text = engine.read_text(args.text_file)
    trust = _trust(args)
    model, profile = _model_and_profile(engine, _artifact_model(engine, args.artifact, trust), args.profile)
    artifact = _load(engine, args.artifact, model, profile, trust)
    result = engine.generate(model, profile, artifact, text, args.max_new_tokens)
    result["signature"] = artifact.signature
    result["summary"] = str(result["text"])
    return result


def _cmd_exactness(args: argparse.Namespace) -> dict[str, Any]:
    engine = _engine()
    from kvgraft.engine._internal.exactness import run_exactness, summary_table

    model, profile = _model_and_profile(engine, args.model, args.profile)
    key = args.key
    if key is None:
        key, _ = engine.ensure_local_key()
    statement = run_exactness(
        model, profile, args.out, samples=args.samples, key=key, shift=args.shifted, seed=args.seed,
        continuation_tokens=args.continuation_tokens, max_tokens=args.max_prefix_tokens,
        keep_artifacts=args.keep_artifacts, passphrase=_passphrase(args.passphrase_env), progress=not args.json,
    )
    s = statement.predicate.summary
    return {
        "record": str(args.out), "model": args.model, "level": statement.predicate.level, "shift": args.shifted,
        "samples": s.samples, "bitwise_equal": s.bitwise_equal, "argmax_agree_all": s.argmax_agree_all,
        "mean_argmax_agreement": s.mean_argmax_agreement, "max_kl_divergence": s.max_kl_divergence,
        "key": str(key), "summary": summary_table(statement) + f"\nrecord written to {args.out} (signed with {key})",
    }


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``kvgraft``."""
    parser = argparse.ArgumentParser(prog="kvgraft", description="Capture, sign, publish and graft KV state.")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a line")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    keys = sub.add_parser("keys", help="manage Ed25519 signing keys and trusted-keys files")
    ksub = keys.add_subparsers(dest="keys_command", required=True, metavar="ACTION")
    gen = ksub.add_parser("generate", help="write a new private key (PEM) and its .pub beside it")
    gen.add_argument("--out", type=Path, required=True, help="private key path; the public key goes to OUT.pub")
    gen.add_argument("--passphrase-env", metavar="VAR", help="encrypt with the passphrase in this environment variable")
    gen.set_defaults(run=_cmd_keys_generate)
    trust = ksub.add_parser("trust", help="add a public key to a trusted-keys file (created if missing)")
    trust.add_argument("--file", type=Path, required=True, help="the trusted-keys JSON file")
    trust.add_argument("--name", required=True, help="a human name for the key")
    trust.add_argument("--public-key", type=Path, required=True, help="PEM public key")
    trust.add_argument("--threshold", type=int, help="distinct signatures required (default: keep, or 1)")
    trust.set_defaults(run=_cmd_keys_trust)

    sign = sub.add_parser("sign", help="sign an in-toto statement about files, as a DSSE envelope")
    sign.add_argument("--key", type=Path, required=True, help="Ed25519 private key (PEM)")
    sign.add_argument("--passphrase-env", metavar="VAR", help="the key's passphrase is in this environment variable")
    sign.add_argument("--subject", type=Path, action="append", required=True, help="a file the statement is about (repeat)")
    sign.add_argument("--predicate-type", required=True, help="the predicate's type URI")
    sign.add_argument("--predicate", type=Path, required=True, help="JSON file holding the predicate object")
    sign.add_argument("--out", type=Path, required=True, help="where to write the envelope (.dsse.json)")
    sign.set_defaults(run=_cmd_sign)

    models = sub.add_parser("models", help="the models kvgraft knows")
    msub = models.add_subparsers(dest="models_command", required=True, metavar="ACTION")
    mlist = msub.add_parser("list", help="name, architecture, window, fingerprint, installed and cached")
    mlist.set_defaults(run=_cmd_models_list)

    def engine_opts(p: argparse.ArgumentParser) -> None:
        p.add_argument("--profile", default="cpu-fp32", help="determinism profile (default cpu-fp32)")
        add_trust_options(p)

    cap = sub.add_parser("capture", help="run a text through a model and write its KV state as a signed artifact")
    cap.add_argument("--model", required=True)
    cap.add_argument("--text-file", type=Path, required=True)
    cap.add_argument("--out", type=Path, required=True, help="the artifact directory to create")
    cap.add_argument("--parent", type=Path, help="an artifact to continue from (a chain)")
    cap.add_argument("--key", type=Path, help="Ed25519 private key (default: a local key under $KVGRAFT_HOME)")
    cap.add_argument("--passphrase-env", metavar="VAR", help="the key's passphrase is in this environment variable")
    engine_opts(cap)
    cap.set_defaults(run=_cmd_capture)

    gr = sub.add_parser("graft", help="restore an artifact at its own positions and run a continuation")
    gr.add_argument("--artifact", type=Path, required=True)
    gr.add_argument("--text-file", type=Path, required=True)
    engine_opts(gr)
    gr.set_defaults(run=_cmd_graft)

    fr = sub.add_parser("fresh", help="recompute a prefix from its text, then run the same continuation")
    fr.add_argument("--model", required=True)
    fr.add_argument("--prefix-file", type=Path, required=True)
    fr.add_argument("--text-file", type=Path, required=True)
    fr.add_argument("--profile", default="cpu-fp32")
    fr.set_defaults(run=_cmd_fresh)

    sp = sub.add_parser("single-pass", help="prefix and continuation in one forward pass (compare under --profile invariant)")
    sp.add_argument("--model", required=True)
    sp.add_argument("--prefix-file", type=Path, required=True)
    sp.add_argument("--text-file", type=Path, required=True)
    sp.add_argument("--profile", default="cpu-fp32")
    sp.set_defaults(run=_cmd_single_pass)

    gen = sub.add_parser("generate", help="decode greedily from a grafted artifact")
    gen.add_argument("--artifact", type=Path, required=True)
    gen.add_argument("--text-file", type=Path, required=True)
    gen.add_argument("--max-new-tokens", type=int, default=64)
    engine_opts(gen)
    gen.set_defaults(run=_cmd_generate)

    ex = sub.add_parser("exactness", help="graft vs fresh on N samples of real text; writes a signed exactness record")
    ex.add_argument("--model", required=True)
    ex.add_argument("--samples", type=int, default=50)
    ex.add_argument("--out", type=Path, required=True, help="the record directory to create")
    ex.add_argument("--shifted", type=int, default=0, metavar="K", help="graft K positions away (approximate, measured)")
    ex.add_argument("--seed", type=int, default=0)
    ex.add_argument("--continuation-tokens", type=int, default=8)
    ex.add_argument("--max-prefix-tokens", type=int, help="longest prefix (default: twice the sliding window, or 768)")
    ex.add_argument("--keep-artifacts", action="store_true", help="keep each sample's artifact in OUT-artifacts/")
    ex.add_argument("--key", type=Path, help="Ed25519 private key (default: the local key)")
    ex.add_argument("--passphrase-env", metavar="VAR")
    ex.add_argument("--profile", default="cpu-fp32")
    ex.set_defaults(run=_cmd_exactness)

    add_flywheel_commands(sub)
    add_registry_commands(sub)
    add_client_commands(sub)
    return parser


def _fail(args: argparse.Namespace, e: BaseException) -> int:
    line = " ".join(str(e).split())
    if args.json:
        # A command that failed after finding things out (fsck) attaches its report as ``result``.
        found = getattr(e, "result", None)
        found = found if isinstance(found, dict) else {}
        doc = {**found, "ok": False, "error": type(e).__name__, "message": line}
        sys.stdout.write(json.dumps(doc, sort_keys=True) + "\n")
    sys.stderr.write(f"kvgraft: {type(e).__name__}: {line}\n")
    return 1


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``kvgraft``; return the exit status (0 ok, 1 failed, 2 usage)."""
    args = build_parser().parse_args(argv)
    try:
        result = args.run(args)
    except Exception as e:
        # Every kvgraft failure is a KvgraftError: one line, no traceback. Anything else is a bug.
        if isinstance(e, KvgraftError):
            return _fail(args, e)
        raise
    if args.json:
        sys.stdout.write(json.dumps({"ok": True, **result}, sort_keys=True) + "\n")
    else:
        sys.stdout.write(result["summary"] + "\n")
    return 0


def run() -> None:
    """Console-script entry point."""
    raise SystemExit(main())
