"""The flywheel's ``kvgraft`` subcommands: ``library deposit``, ``ask``, ``eval``, ``prereg``,
``replay`` and ``report`` (docs/flywheel.md).

``kvgraft.cli`` calls ``add_flywheel_commands(sub)``; torch and httpx are imported only when a
command runs. Each command returns a dict with a ``summary``; failures are one line.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

TOKEN_ENV = "KVGRAFT_TOKEN"

Command = Callable[[argparse.Namespace], dict[str, Any]]


def _cli() -> Any:
    import kvgraft.cli as cli  # the module that owns CliError and the engine loader

    return cli


def _key(args: argparse.Namespace) -> tuple[Path, bytes | None]:
    cli = _cli()
    key = args.key
    if key is None:
        key, _ = cli._engine().ensure_local_key()
    return key, cli._passphrase(args.passphrase_env)


@contextmanager
def _registry(args: argparse.Namespace, *, token_required: bool) -> Iterator[tuple[Any, Any]]:
    """A registry client and its checkpoint key, with client errors reported as one line."""
    cli = _cli()
    try:
        from kvgraft.registry import client as rc
    except ImportError as e:
        raise cli.CliError(f"the registry client is not installed ({e.name} is missing)", hint="pip install 'kvgraft[registry]'") from e
    token = getattr(args, "token", None) or os.environ.get(TOKEN_ENV) or None
    if token_required and not token:
        raise cli.CliError("publishing needs a registry token", hint=f"pass --token T, or export {TOKEN_ENV}=T")
    try:
        with rc.RegistryClient(args.registry, token=token) as client:
            yield client, rc.registry_key(client, getattr(args, "registry_key", None))
    except rc.RegistryClientError as e:
        raise cli.CliError(f"{type(e).__name__}: {e.message}", hint=e.hint) from e


def _publish(client: Any, directory: Path, key_file: Path | None) -> Any:
    from kvgraft.registry.client import publish

    return publish(client, directory, registry_key_file=key_file)


def _progress(enabled: bool, line: str) -> None:
    if enabled:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()


# --- library deposit ------------------------------------------------------------------------------


def _solutions(args: argparse.Namespace, dataset: Any) -> dict[int, str]:
    """doc id -> worked solution: the dataset's own, a solutions file, or (said so) the key."""
    cli = _cli()
    from kvgraft.schemas import DocumentError, parse_json

    if args.solutions is not None:
        out: dict[int, str] = {}
        try:
            lines = args.solutions.read_bytes().splitlines()
        except OSError as e:
            raise cli.CliError(f"cannot read --solutions {args.solutions}: {e.strerror}", hint="pass a JSONL file") from e
        for n, line in enumerate(lines, 1):
            try:
                obj = parse_json(line, what=f"{args.solutions} line {n}")
            except DocumentError as e:
                raise cli.CliError(str(e), hint='each line is {"doc_id": N, "solution": "..."}') from e
            if not isinstance(obj, dict) or not isinstance(obj.get("doc_id"), int) or not isinstance(obj.get("solution"), str):
                raise cli.CliError(f"{args.solutions} line {n} is not a solution", hint='each line is {"doc_id": N, "solution": "..."}')
            out[obj["doc_id"]] = obj["solution"]
        return out
    from kvgraft.engine._internal.library import clean_solution

    out = {}
    for i in range(len(dataset.docs)):
        solution = dataset.solution(i)
        if solution is not None:
            out[i] = clean_solution(solution) + f"\nThe answer is {dataset.reference(i)}."
        elif args.solutions_from_key:
            out[i] = f"The answer key gives \\boxed{{{dataset.reference(i)}}}."
    if not out:
        raise cli.CliError(
            f"{dataset.name} holds no worked solutions",
            hint="pass --solutions FILE (JSONL of doc_id and solution), or --solutions-from-key to store the key's answers",
        )
    return out


def _cmd_deposit(args: argparse.Namespace) -> dict[str, Any]:
    cli = _cli()
    engine = cli._engine()
    from kvgraft.engine._internal.evaluate import select
    from kvgraft.engine._internal.library import Library
    from kvgraft.verifier import load_dataset

    dataset = load_dataset(args.dataset)
    solutions = _solutions(args, dataset)
    model, profile = engine.load_model(args.model), engine.current_profile(args.profile)
    key, passphrase = _key(args)
    if (args.library / "library.json").exists():
        # New entries chain onto the library's prefix: it is verified before it is built on.
        trust = cli._trust(args)
        library = Library.open(args.library, model, profile, trusted=trust.keys, insecure_skip_verify=trust.skip)
    else:
        # A new library's only signed artifact is the prefix it writes now with --key: trusted as that key.
        library = Library.create(args.library, model, profile, kind=dataset.kind, key=key, passphrase=passphrase)
    t0 = time.perf_counter()
    before = len(library.entries)
    refused: list[int] = []
    deposited: list[Any] = []
    ids = [i for i in select(dataset, args.limit, args.seed) if i in solutions]
    for n, i in enumerate(ids):
        entry = library.deposit(dataset, i, solutions[i], key=key, passphrase=passphrase)
        if entry is None:
            refused.append(i)
        else:
            deposited.append(entry)
        _progress(not args.json, f"deposit {n + 1}/{len(ids)}: doc {i} {'refused (answer is not the key)' if entry is None else 'ok'}")
    new = len(library.entries) - before
    published = 0
    if args.registry:
        with _registry(args, token_required=True) as (client, _):
            for entry in [None, *deposited]:
                directory = args.library / ("prefix" if entry is None else entry.directory)
                published += bool(_publish(client, directory, args.registry_key).created)
    seconds = time.perf_counter() - t0
    return {
        "library": str(args.library), "dataset": dataset.name, "tried": len(ids), "deposited": new,
        "already_present": len(deposited) - new, "refused": refused, "entries": len(library.entries),
        "stored_tokens": library.stored_tokens, "published": published, "seconds": round(seconds, 3),
        "summary": f"{args.library}: {new} new entries from {dataset.name} ({len(deposited) - new} already there, "
        f"{len(refused)} refused because their answer is not the key's); {len(library.entries)} entries, "
        f"{library.stored_tokens} stored tokens" + (f"; {published} entries published to {args.registry}" if args.registry else ""),
    }


# --- ask ------------------------------------------------------------------------------------------


def _open_library(args: argparse.Namespace) -> Any:
    """The library of ``--library``, every artifact it grafts verified against the trust options."""
    cli = _cli()
    engine = cli._engine()
    from kvgraft.engine._internal.library import Library, read_meta

    meta = read_meta(args.library)
    trust = cli._trust(args)  # refused before any model is loaded
    model, profile = engine.load_model(meta["model"]), engine.current_profile(meta["profile"])
    return Library.open(args.library, model, profile, trusted=trust.keys, insecure_skip_verify=trust.skip)


def _cmd_ask(args: argparse.Namespace) -> dict[str, Any]:
    cli = _cli()
    question = args.question
    if question is None:
        question = cli._engine().read_text(args.question_file, what="question file")
    if not question.strip():
        raise cli.CliError("the question is empty", hint="pass --question TEXT or --question-file PATH")
    library = _open_library(args)
    answer = library.ask(question, max_new_tokens=args.max_new_tokens)
    result = answer.to_json()
    result["summary"] = (
        f"answer: {answer.answer} ({answer.method} entry {answer.entry}; {answer.prompt_tokens} prompt + "
        f"{answer.decode_tokens} decode tokens on {answer.context_tokens - answer.prompt_tokens} grafted; "
        f"{answer.seconds:.3f} s; {answer.energy_joules:.3g} J {answer.energy_method})"
    )
    return result


# --- eval -----------------------------------------------------------------------------------------


def _cmd_eval(args: argparse.Namespace) -> dict[str, Any]:
    cli = _cli()
    engine = cli._engine()
    from kvgraft.engine._internal.evaluate import run_eval

    library = None
    if args.library is not None:
        library = _open_library(args)
        if library.model.spec.name != args.model:
            raise cli.CliError(f"the library holds {library.model.spec.name} state, not {args.model}",
                               hint=f"pass --model {library.model.spec.name}")
        model, profile = library.model, library.profile
    else:
        model, profile = engine.load_model(args.model), engine.current_profile(args.profile)
    key, passphrase = _key(args)

    def item(n: int, total: int, it: Any) -> None:
        _progress(not args.json, f"eval {n + 1}/{total}: doc {it.doc_id} answer {it.extracted_answer} "
                  f"{'correct' if it.correct else 'wrong'} ({it.decode_tokens} decode tokens)")

    run = run_eval(model, profile, args.dataset, args.out, key=key, library=library, max_new_tokens=args.max_new_tokens,
                   limit=args.limit, seed=args.seed, passphrase=passphrase, on_item=item)
    a = run.statement.predicate.aggregates
    from kvgraft.engine import SKIPPED

    signature = None if library is None else SKIPPED if library.insecure_skip_verify else "verified"
    return {
        "record": str(args.out), "items": a.items, "correct": a.correct, "accuracy": a.accuracy, "signature": signature,
        "prompt_tokens": a.prompt_tokens, "decode_tokens": a.decode_tokens, "seconds": round(run.seconds, 3),
        "energy_joules": run.energy_joules, "energy_method": run.energy_method,
        "summary": f"{args.out}: {a.correct}/{a.items} correct ({a.accuracy:.3f}); {a.prompt_tokens} prompt and "
        f"{a.decode_tokens} decode tokens; {run.seconds:.1f} s; {run.energy_joules:.3g} J {run.energy_method}",
    }


# --- pre-registration and replay ------------------------------------------------------------------


def _cmd_prereg(args: argparse.Namespace) -> dict[str, Any]:
    from kvgraft.engine._internal.evaluate import write_pre_registration

    _cli()._engine()
    key, passphrase = _key(args)
    statement = write_pre_registration(args.eval, args.out, dataset_path=args.dataset, library=args.library,
                                       key=key, passphrase=passphrase)
    result: dict[str, Any] = {"pre_registration": str(args.out), "command": statement.predicate.command,
                              "expected_outputs": len(statement.predicate.expected_output_hashes)}
    line = f"{args.out}: pre-registered {' '.join(statement.predicate.command)} with {result['expected_outputs']} expected outputs"
    if args.registry:
        with _registry(args, token_required=True) as (client, _):
            published = _publish(client, args.out, args.registry_key)
        result["log_index"] = published.log_index
        line += f"; logged as entry {published.log_index} of {args.registry}"
    result["summary"] = line
    return result


def _cmd_replay(args: argparse.Namespace) -> dict[str, Any]:
    from kvgraft.engine._internal.evaluate import run_replay
    from kvgraft.registry.report import log_index_of, write_log_proofs

    cli = _cli()
    engine = cli._engine()
    key, passphrase = _key(args)
    # The replayed eval loads the library in a fresh process: it gets the same trust options.
    trust_args = [*(["--trusted-keys", str(args.trusted_keys.resolve())] if args.trusted_keys else []),
                  *(["--trust-local-key"] if args.trust_local_key else []),
                  *(["--insecure-skip-verify"] if args.insecure_skip_verify else [])]
    if args.insecure_skip_verify:
        sys.stderr.write(f"kvgraft: {engine.SKIP_WARNING}\n")
    try:
        prereg_envelope = (args.pre_registration / "record.dsse.json").read_bytes()
    except OSError as e:
        raise cli.CliError(f"cannot read {args.pre_registration}/record.dsse.json: {e.strerror}",
                           hint="pass the directory 'kvgraft prereg' wrote") from e
    with _registry(args, token_required=True) as (client, reg_key):
        # The pre-registration must be in the log before the replay runs: that is its point.
        prereg_index = log_index_of(client, prereg_envelope)
        statement = run_replay(args.pre_registration, args.out, log_index=prereg_index, key=key, passphrase=passphrase,
                               trust_args=trust_args)
        published = _publish(client, args.out, args.registry_key)
        # Beside the replay, not in it: the record directory holds only its subjects and log.json.
        checkpoint = args.checkpoint_out or args.out.with_name(args.out.name + ".checkpoint.txt")
        proven = write_log_proofs(client, reg_key, [args.pre_registration, args.out], checkpoint)
    p = statement.predicate
    return {
        "replay": str(args.out), "reproduced": p.reproduced, "outputs": len(p.output_hashes),
        "pre_registration_log_index": prereg_index, "replay_log_index": published.log_index, "tree_size": proven.tree_size,
        "checkpoint": str(checkpoint),
        "summary": f"{args.out}: replay {'reproduced' if p.reproduced else 'DID NOT reproduce'} all "
        f"{len(p.output_hashes)} pre-registered outputs; pre-registration entry {prereg_index}, replay entry "
        f"{published.log_index}; proofs at tree size {proven.tree_size} in log.json, checkpoint in {checkpoint}",
    }


# --- report ---------------------------------------------------------------------------------------


def _cmd_report(args: argparse.Namespace) -> dict[str, Any]:
    from kvgraft.registry.report import fetch_report

    cli = _cli()
    with _registry(args, token_required=False) as (client, reg_key):
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
            shutil.copyfile(args.trusted_keys, args.out / "trusted-keys.json")
        if args.dataset:
            (args.out / "datasets").mkdir(exist_ok=True)
            for d in args.dataset:
                if not d.is_file():
                    raise cli.CliError(f"dataset {d} is not a file", hint="pass the dataset files the evaluations name")
                shutil.copyfile(d, args.out / "datasets" / d.name)
    except OSError as e:
        raise cli.CliError(f"cannot copy into the report {args.out}: {e.strerror or e}",
                           hint="check the --trusted-keys and --dataset files and the free space") from e
    counts = {k: len(v) for k, v in made.items()}
    return {"report": str(args.out), "entries": counts,
            "summary": f"{args.out}: " + ", ".join(f"{n} {k}" for k, n in sorted(counts.items())) +
            f" from {args.registry}, with log proofs; check it with: kvgraft-verify audit {args.out}"}


def add_flywheel_commands(sub: Any, guard: Callable[[Command], Command] = lambda c: c) -> None:
    """Add the flywheel's subcommands to ``kvgraft``'s subparsers."""

    def key_opts(p: argparse.ArgumentParser) -> None:
        p.add_argument("--key", type=Path, help="Ed25519 private key (default: the local key under $KVGRAFT_HOME)")
        p.add_argument("--passphrase-env", metavar="VAR", help="the key's passphrase is in this environment variable")

    def registry_opts(p: argparse.ArgumentParser, *, required: bool = False) -> None:
        p.add_argument("--registry", required=required, metavar="URL", help="a kvgraft registry, e.g. http://127.0.0.1:8000")
        p.add_argument("--token", metavar="T", help=f"a publishing token (default: ${TOKEN_ENV})")
        p.add_argument("--registry-key", type=Path, metavar="PEM", help="pin the registry's checkpoint key")

    lib = sub.add_parser("library", help="a knowledge library of verified worked solutions")
    lsub = lib.add_subparsers(dest="library_command", required=True, metavar="ACTION")
    dep = lsub.add_parser("deposit", help="capture verified (problem, solution) pairs as library entries")
    dep.add_argument("--model", required=True)
    dep.add_argument("--dataset", type=Path, required=True, help="JSONL problems with their answer key")
    dep.add_argument("--library", type=Path, required=True, help="the library directory (created when new)")
    dep.add_argument("--solutions", type=Path, help='JSONL of {"doc_id", "solution"} (default: the dataset\'s own)')
    dep.add_argument("--solutions-from-key", action="store_true",
                     help="for datasets without worked solutions: store the key's answer as the solution")
    dep.add_argument("--limit", type=int, help="deposit only the first N problems (or N drawn with --seed)")
    dep.add_argument("--seed", type=int)
    dep.add_argument("--profile", default="cpu-fp32")
    key_opts(dep)
    _cli().add_trust_options(dep)
    registry_opts(dep)
    dep.set_defaults(run=guard(_cmd_deposit))

    ask = sub.add_parser("ask", help="answer a question from a library (graft the entry, decode what is missing)")
    ask.add_argument("--library", type=Path, required=True)
    q = ask.add_mutually_exclusive_group(required=True)
    q.add_argument("--question", help="the question text")
    q.add_argument("--question-file", type=Path)
    ask.add_argument("--max-new-tokens", type=int, default=256, help="budget for a new problem (a recall stops at 16)")
    _cli().add_trust_options(ask)
    ask.set_defaults(run=guard(_cmd_ask))

    ev = sub.add_parser("eval", help="evaluate on a dataset (base model, or from a library); writes a signed record")
    ev.add_argument("--model", required=True)
    ev.add_argument("--dataset", type=Path, required=True)
    ev.add_argument("--out", type=Path, required=True, help="the record directory to create")
    ev.add_argument("--library", type=Path, help="answer from this library")
    ev.add_argument("--max-new-tokens", type=int, default=256)
    ev.add_argument("--limit", type=int, help="the first N problems (or N drawn with --seed)")
    ev.add_argument("--seed", type=int, help="draw --limit problems with this seed")
    ev.add_argument("--profile", default="cpu-fp32")
    _cli().add_trust_options(ev)
    key_opts(ev)
    ev.set_defaults(run=guard(_cmd_eval))

    pr = sub.add_parser("prereg", help="pre-register the replay of an evaluation (and log it)")
    pr.add_argument("--eval", type=Path, required=True, help="the evaluation record directory to reproduce")
    pr.add_argument("--dataset", type=Path, required=True)
    pr.add_argument("--library", type=Path, help="the library the evaluation used")
    pr.add_argument("--out", type=Path, required=True)
    key_opts(pr)
    registry_opts(pr)
    pr.set_defaults(run=guard(_cmd_prereg))

    rp = sub.add_parser("replay", help="run a logged pre-registration in a fresh process and publish the replay record")
    rp.add_argument("--pre-registration", type=Path, required=True)
    rp.add_argument("--out", type=Path, required=True)
    rp.add_argument("--checkpoint-out", type=Path, help="where the signed checkpoint goes (default: OUT.checkpoint.txt)")
    key_opts(rp)
    _cli().add_trust_options(rp)
    registry_opts(rp, required=True)
    rp.set_defaults(run=guard(_cmd_replay))

    rep = sub.add_parser("report", help="pull entries and their blobs into an audit folder, with log proofs")
    rep.add_argument("--out", type=Path, required=True)
    rep.add_argument("--entry", action="append", help="a log index or envelope digest (repeat; default: every entry)")
    rep.add_argument("--trusted-keys", type=Path, help="copied into the report as trusted-keys.json")
    rep.add_argument("--dataset", type=Path, action="append", help="a dataset file the evaluations name (repeat)")
    registry_opts(rep, required=True)
    rep.set_defaults(run=guard(_cmd_report))
