"""The flywheel's ``kvgraft`` subcommands: ``library deposit``, ``ask``, ``eval``, ``prereg`` and
``replay`` (docs/flywheel.md).

torch and httpx are imported only when a command runs; the engine's types are imported for
annotations only. A command that publishes goes through ``remote.registry_session``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvgraft.schemas import LIBRARY_FILE, RECORD_FILE, InvalidDigestError, parse_sha256
from kvgraft.verifier.cli import DATASET_HELP

from ._common import ENGINE, ENGINE_CLIENT, CliError, add_command, needs, progress
from .engine import (
    MODEL_HELP,
    add_key_options,
    add_profile_option,
    add_trust_options,
    model_and_profile,
    resolve_trust,
    signing_key,
)
from .remote import add_registry_options, registry_session

if TYPE_CHECKING:
    from kvgraft.engine import Library, Sampling
    from kvgraft.schemas import EvaluationItem
    from kvgraft.verifier import Dataset


# --- library deposit -------------------------------------------------------------------------------

#: What a ``--solutions`` line must be.
_SOLUTION_LINE = 'each line is {"doc_id": N, "solution": "..."}'


def _solutions(args: argparse.Namespace, dataset: Dataset) -> dict[int, str]:
    """doc id -> worked solution: the dataset's own, a solutions file, or (said so) the key."""
    from kvgraft.schemas import DocumentError, parse_json

    if args.solutions is not None:
        out: dict[int, str] = {}
        try:
            lines = args.solutions.read_bytes().splitlines()
        except OSError as e:
            raise CliError(f"cannot read --solutions {args.solutions}: {e.strerror}", hint="pass a JSONL file") from e
        for n, line in enumerate(lines, 1):
            try:
                obj = parse_json(line, what=f"{args.solutions} line {n}")
            except DocumentError as e:
                raise CliError(str(e), hint=_SOLUTION_LINE) from e
            if not isinstance(obj, dict) or not isinstance(obj.get("doc_id"), int) or not isinstance(obj.get("solution"), str):
                raise CliError(f"{args.solutions} line {n} is not a solution", hint=_SOLUTION_LINE)
            out[obj["doc_id"]] = obj["solution"]
        return out
    from kvgraft.engine import worked_solution

    out = {}
    for i in range(len(dataset.docs)):
        solution = worked_solution(dataset, i)
        if solution is not None:
            out[i] = solution
        elif args.solutions_from_key:
            out[i] = f"The answer key gives \\boxed{{{dataset.reference(i)}}}."
    if not out:
        raise CliError(
            f"{dataset.name} holds no worked solutions",
            hint="pass --solutions FILE (JSONL of doc_id and solution), or --solutions-from-key to store the key's answers",
        )
    return out


def _cmd_deposit(args: argparse.Namespace) -> dict[str, Any]:
    from kvgraft.engine import Library, read_meta, select
    from kvgraft.verifier import load_dataset

    dataset = load_dataset(args.dataset)
    solutions = _solutions(args, dataset)
    exists = (args.library / LIBRARY_FILE).exists()
    if exists and args.profile is None:
        # More entries for an existing library: under the profile it was made with.
        model, profile = model_and_profile(args.model, str(read_meta(args.library)["profile"]))
    else:
        model, profile = model_and_profile(args.model, args.profile, flywheel=True)
    key, passphrase, _ = signing_key(args)
    if exists:
        # New entries chain onto the library's prefix: it is verified before it is built on.
        trust = resolve_trust(args)
        library = Library.open(args.library, model, profile, trusted=trust.keys, insecure_skip_verify=trust.skip)
    else:
        # A new library's only signed artifact is the prefix it writes now with --key: trusted as that key.
        library = Library.create(args.library, model, profile, kind=dataset.kind, key=key, passphrase=passphrase)
    t0 = time.perf_counter()
    before = len(library.entries)
    refused: list[int] = []
    deposited: list[str] = []  # the entries' directories, in the library
    ids = [i for i in select(dataset, args.limit, args.seed) if i in solutions]
    for n, i in enumerate(ids):
        entry = library.deposit(dataset, i, solutions[i], key=key, passphrase=passphrase)
        if entry is None:
            refused.append(i)
        else:
            deposited.append(entry.directory)
        progress(not args.json, f"deposit {n + 1}/{len(ids)}: doc {i} {'refused (answer is not the key)' if entry is None else 'ok'}")
    new = len(library.entries) - before
    published = 0
    if args.registry:
        with registry_session(args, token_required=True) as (client, _):
            from kvgraft.registry.client import publish

            for directory in ["prefix", *deposited]:
                published += bool(publish(client, args.library / directory, registry_key_file=args.registry_key).created)
    seconds = time.perf_counter() - t0
    return {
        "library": str(args.library), "dataset": dataset.name, "tried": len(ids), "deposited": new,
        "already_present": len(deposited) - new, "refused": refused, "entries": len(library.entries),
        "stored_tokens": library.stored_tokens, "published": published, "seconds": round(seconds, 3),
        "summary": f"{args.library}: {new} new entries from {dataset.name} ({len(deposited) - new} already there, "
        f"{len(refused)} refused because their answer is not the key's); {len(library.entries)} entries, "
        f"{library.stored_tokens} stored tokens" + (f"; {published} entries published to {args.registry}" if args.registry else ""),
    }


# --- ask -------------------------------------------------------------------------------------------


def _open_library(args: argparse.Namespace, *, asked_model: str | None = None, asked_profile: str | None = None,
                  graft_threshold: float | None = None) -> Library:
    """The library of ``--library``, every artifact it grafts verified against the trust options;
    ``asked_model`` / ``asked_profile``, when given, must be the library's (refused before any
    model loads). ``graft_threshold``: the library's calibrated one unless given."""
    from kvgraft.engine import Library, read_meta, require_library_match

    meta = read_meta(args.library)
    require_library_match(args.library, meta, model=asked_model, profile=asked_profile)
    trust = resolve_trust(args)  # refused before any model is loaded
    model, profile = model_and_profile(meta["model"], meta["profile"])
    if graft_threshold is not None:
        return Library.open(args.library, model, profile, trusted=trust.keys, insecure_skip_verify=trust.skip,
                            graft_threshold=graft_threshold)
    return Library.open(args.library, model, profile, trusted=trust.keys, insecure_skip_verify=trust.skip)


#: What the text says in place of an answer the grader could not extract (never ``None``).
NO_ANSWER = "none found (the output holds no final answer the grader can read)"


def shown_answer(answer: str | None) -> str:
    """An extracted answer as a line shows it: the answer, or ``NO_ANSWER`` when there is none."""
    return NO_ANSWER if answer is None or not str(answer).strip() else str(answer)


#: Why a decode that did not finish ended, in words (``Provenance.stopped_by``).
_CUT_OFF = {
    "max_new_tokens": "cut off by the token budget (raise --max-new-tokens)",
    "window": "cut off at the model's context window",
    "stop": "stopped before its end (a deadline or stop string)",
}


def _ask_summary(result: dict[str, Any]) -> str:
    """The line ``ask`` prints (``Answer.to_json``'s fields), by the answer's kind: a recall says
    ``recalled (verified)``; a model's answer is always ``unverified``, says whether a verified
    entry assisted it, and a decode that did not finish says so instead of showing an answer."""
    cost = (f"{result['prompt_tokens']} prompt + {result['decode_tokens']} decode tokens on "
            f"{result['context_tokens'] - result['prompt_tokens']} grafted; {result['seconds']:.3f} s; "
            f"{result['energy_joules']:.3g} J {result['energy_method']}")
    if result["kind"] == "recalled":
        return (f"recalled (verified): {result['answer']} (the deposited problem's checked answer, entry "
                f"{result['entry']}, signature {result['signature']}; {cost})")
    if result["finished"]:
        head = f"unverified answer: {shown_answer(result['answer'])}"
    else:
        head = f"no answer: the model's decode was {_CUT_OFF.get(result['stopped_by'], 'not finished')}; nothing was extracted"
    if result["kind"] == "assisted":
        how = (f"assisted: the model's own answer, with the similar verified entry {result['entry']} "
               f"(similarity {result['score']:.3f}) grafted as context")
    elif result["score"] > 0:
        how = (f"unassisted: the model alone; the most similar entry (similarity {result['score']:.3f}) is below the "
               "graft threshold, so none was grafted")
    else:
        how = "unassisted: the model alone"
    return f"{head} ({how}; {cost})"


#: The longest question file read: a question is a paragraph (the server's limit is 256 Ki characters).
MAX_QUESTION_FILE_BYTES = 1 << 20


def _read_question(path: Path) -> str:
    """``--question-file``: UTF-8 text, at most ``MAX_QUESTION_FILE_BYTES`` (read here, not by the
    engine, so that ``ask --engine`` imports no torch)."""
    try:
        with path.open("rb") as f:
            data = f.read(MAX_QUESTION_FILE_BYTES + 1)
    except FileNotFoundError as e:
        raise CliError(f"the question file {path} does not exist", hint="pass --question-file PATH, or --question TEXT") from e
    except OSError as e:
        raise CliError(f"cannot read the question file {path}: {e.strerror}", hint="pass a readable file, or --question TEXT") from e
    if len(data) > MAX_QUESTION_FILE_BYTES:
        raise CliError(f"the question file {path} is over {MAX_QUESTION_FILE_BYTES} bytes", hint="ask a shorter question")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CliError(f"the question file {path} is not UTF-8 text", hint="save it as UTF-8") from e


def _cmd_ask(args: argparse.Namespace) -> dict[str, Any]:
    question = args.question if args.question is not None else _read_question(args.question_file)
    if not question.strip():
        raise CliError("the question is empty", hint="pass --question TEXT or --question-file PATH")
    if args.engine is not None:
        return _ask_engine(args, question)
    if args.model is not None or args.timeout is not None:
        raise CliError("--model and --timeout are for --engine", hint="a --library names its own model; drop them")
    library = _open_library(args)
    answer = library.ask(question, max_new_tokens=args.max_new_tokens)
    result = answer.to_json()
    result["summary"] = _ask_summary(result)
    return result


def _ask_engine(args: argparse.Namespace, question: str) -> dict[str, Any]:
    """``ask --engine URL``: the same question, answered by a running ``kvgraft engine serve``."""
    if args.trusted_keys is not None or args.trust_local_key or args.insecure_skip_verify:
        raise CliError("the trust options are for --library: the engine server verifies its artifacts with its own keys",
                       hint="drop --trusted-keys, --trust-local-key and --insecure-skip-verify with --engine")
    with needs(ENGINE_CLIENT):
        from ._engine_client import DEFAULT_TIMEOUT, EngineClient

        with EngineClient(args.engine, timeout=args.timeout or DEFAULT_TIMEOUT) as client:
            completion = client.ask(question, model=args.model, max_tokens=args.max_new_tokens)
    p = completion.kvgraft
    # The same object as a local ask's (Answer.to_json: the text and the provenance), then the server's.
    result: dict[str, Any] = {
        "text": completion.choices[0].message.content if completion.choices else "", **p.model_dump(mode="json"),
        "engine": args.engine, "model": completion.model,
        "finish_reason": completion.choices[0].finish_reason if completion.choices else None,
    }
    result["summary"] = _ask_summary(result)
    return result


# --- eval ------------------------------------------------------------------------------------------


def _eval_sampling(args: argparse.Namespace) -> Sampling:
    """``eval``'s sampling options as the engine's ``Sampling``: greedy unless ``--temperature``
    is above 0, which needs ``--sample-seed`` (an evaluation is reproducible from it)."""
    from kvgraft.engine import GREEDY, InputTextError, Sampling

    if not args.temperature:
        if args.top_p is not None or args.sample_seed is not None:
            raise CliError("--top-p and --sample-seed are for sampling, but --temperature is 0 (greedy decoding)",
                           hint="pass --temperature T (above 0, at most 2) with them, or leave them out")
        return GREEDY
    if args.sample_seed is None:
        raise CliError(f"--temperature {args.temperature:g} samples, and a sampled evaluation is reproducible only from its seed",
                       hint="pass --sample-seed N (any integer from 0)")
    try:
        return Sampling(args.temperature, 1.0 if args.top_p is None else args.top_p, args.sample_seed)
    except InputTextError as e:
        raise CliError(f"the sampling options: {e.message}", hint=e.hint or "see 'kvgraft eval --help'") from e


def _cmd_eval(args: argparse.Namespace) -> dict[str, Any]:
    from kvgraft.engine import SKIPPED, run_eval

    library = None
    if args.library is not None:
        # The library's model and profile are the evaluation's: a conflicting flag is refused,
        # never silently overridden by the library's.
        if args.graft_threshold is not None and not 0.0 <= args.graft_threshold <= 1.0:
            raise CliError(f"--graft-threshold {args.graft_threshold} is not a similarity between 0 and 1",
                           hint="leave it out for the calibrated threshold, or pass 0 to graft the most similar entry always")
        library = _open_library(args, asked_model=args.model, asked_profile=args.profile, graft_threshold=args.graft_threshold)
        model, profile = library.model, library.profile
    else:
        if args.graft_threshold is not None:
            raise CliError("--graft-threshold is for answering from a library, but no --library was given",
                           hint="pass --library DIR with it, or leave it out")
        model, profile = model_and_profile(args.model, args.profile, flywheel=True)
    key, passphrase, _ = signing_key(args)

    def item(n: int, total: int, it: EvaluationItem) -> None:
        progress(not args.json, f"eval {n + 1}/{total}: doc {it.doc_id} answer {shown_answer(it.extracted_answer)} "
                 f"{'correct' if it.correct else 'wrong'} ({it.decode_tokens} decode tokens)")

    fixed = None
    if args.library_entry is not None:
        if library is None:
            raise CliError("--library-entry names an entry of a library, but no --library was given",
                           hint="pass --library DIR with it")
        try:
            fixed = parse_sha256(args.library_entry)
        except InvalidDigestError as e:
            raise CliError(f"--library-entry: {e}", hint="pass an entry's artifact digest, as its library's index.jsonl lists it") from e
    run = run_eval(model, profile, args.dataset, args.out, key=key, library=library, fixed_entry=fixed,
                   max_new_tokens=args.max_new_tokens, limit=args.limit, seed=args.seed, batch=args.batch,
                   passphrase=passphrase, on_item=item, sampling=_eval_sampling(args))
    a = run.statement.predicate.aggregates
    signature = None if library is None else SKIPPED if library.insecure_skip_verify else "verified"
    settings = run.statement.predicate.settings
    # How many answers were recalled, assisted, unassisted (an evaluation from a library only).
    kinds = {k: settings[k] for k in ("recalled", "assisted", "unassisted") if k in settings}
    return {
        "kinds": kinds or None,
        "record": str(args.out), "items": a.items, "correct": a.correct, "accuracy": a.accuracy, "signature": signature,
        "prompt_tokens": a.prompt_tokens, "decode_tokens": a.decode_tokens, "seconds": round(run.seconds, 3),
        "energy_joules": run.energy_joules, "energy_method": run.energy_method,
        "summary": f"{args.out}: {a.correct}/{a.items} correct ({a.accuracy:.3f}); {a.prompt_tokens} prompt and "
        f"{a.decode_tokens} decode tokens; {run.seconds:.1f} s; {run.energy_joules:.3g} J {run.energy_method}",
    }


# --- pre-registration and replay -------------------------------------------------------------------


def _cmd_prereg(args: argparse.Namespace) -> dict[str, Any]:
    from kvgraft.engine import write_pre_registration

    key, passphrase, _ = signing_key(args)
    statement = write_pre_registration(args.eval, args.out, dataset_path=args.dataset, library=args.library,
                                       key=key, passphrase=passphrase)
    result: dict[str, Any] = {"pre_registration": str(args.out), "command": statement.predicate.command,
                              "expected_outputs": len(statement.predicate.expected_output_hashes)}
    line = f"{args.out}: pre-registered {' '.join(statement.predicate.command)} with {result['expected_outputs']} expected outputs"
    if args.registry:
        with registry_session(args, token_required=True) as (client, _):
            from kvgraft.registry.client import publish

            published = publish(client, args.out, registry_key_file=args.registry_key)
        result["log_index"] = published.log_index
        line += f"; logged as entry {published.log_index} of {args.registry}"
    result["summary"] = line
    return result


def _cmd_replay(args: argparse.Namespace) -> dict[str, Any]:
    from kvgraft.engine import SKIP_WARNING, run_replay

    key, passphrase, _ = signing_key(args)
    # The replayed eval loads the library in a fresh process: it gets the same trust options.
    trust_args = [*(["--trusted-keys", str(args.trusted_keys.resolve())] if args.trusted_keys else []),
                  *(["--trust-local-key"] if args.trust_local_key else []),
                  *(["--insecure-skip-verify"] if args.insecure_skip_verify else [])]
    if args.insecure_skip_verify:
        sys.stderr.write(f"kvgraft: {SKIP_WARNING}\n")
    try:
        prereg_envelope = (args.pre_registration / RECORD_FILE).read_bytes()
    except OSError as e:
        raise CliError(f"cannot read {args.pre_registration}/record.dsse.json: {e.strerror}",
                       hint="pass the directory 'kvgraft prereg' wrote") from e
    with registry_session(args, token_required=True) as (client, reg_key):
        from kvgraft.registry.client import publish
        from kvgraft.registry.report import log_index_of, write_log_proofs

        # The pre-registration must be in the log before the replay runs: that is its point.
        prereg_index = log_index_of(client, prereg_envelope)
        statement = run_replay(args.pre_registration, args.out, log_index=prereg_index, key=key, passphrase=passphrase,
                               trust_args=trust_args)
        published = publish(client, args.out, registry_key_file=args.registry_key)
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


# --- wiring ----------------------------------------------------------------------------------------


def add_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``library deposit``, ``ask``, ``eval``, ``prereg`` and ``replay`` to ``kvgraft``'s subcommands."""
    lib = sub.add_parser("library", help="a knowledge library of verified worked solutions")
    lsub = lib.add_subparsers(dest="library_command", required=True, metavar="ACTION")
    dep = add_command(lsub, "deposit", _cmd_deposit, extra=ENGINE,
                      help="capture verified (problem, solution) pairs as library entries")
    dep.add_argument("--model", required=True, metavar="NAME", help=MODEL_HELP)
    dep.add_argument("--dataset", type=Path, required=True, metavar="FILE",
                     help="the problems and their answer key: " + DATASET_HELP)
    dep.add_argument("--library", type=Path, required=True, help="the library directory (created when new)")
    dep.add_argument("--solutions", type=Path, help='JSONL of {"doc_id", "solution"} (default: the dataset\'s own)')
    dep.add_argument("--solutions-from-key", action="store_true",
                     help="for datasets without worked solutions: store the key's answer as the solution")
    dep.add_argument("--limit", type=int, help="deposit only the first N problems (or N drawn with --seed)")
    dep.add_argument("--seed", type=int, help="draw --limit problems with this seed (default: the first N)")
    add_profile_option(dep, flywheel=True)
    add_key_options(dep)
    add_trust_options(dep)
    add_registry_options(dep, required=False)

    ask = add_command(sub, "ask", _cmd_ask, extra=ENGINE,
                      help="answer a question from a library (graft the entry, decode what is missing), "
                      "or ask a running 'kvgraft engine serve'")
    where = ask.add_mutually_exclusive_group(required=True)
    where.add_argument("--library", type=Path, help="answer here, loading the model and the library")
    where.add_argument("--engine", metavar="URL", help="ask the engine server at URL instead (docs/engine-serve.md)")
    ask.add_argument("--model", help="with --engine: the served model to ask (default: the server's only one)")
    ask.add_argument("--timeout", type=float, metavar="S",
                     help="with --engine: seconds the whole request may take (default 180)")
    q = ask.add_mutually_exclusive_group(required=True)
    q.add_argument("--question", help="the question text")
    q.add_argument("--question-file", type=Path, metavar="FILE", help="the question, read from a UTF-8 text file (at most 1 MiB)")
    ask.add_argument("--max-new-tokens", type=int, default=256, help="budget for a new problem (a recall stops at 16)")
    add_trust_options(ask)

    ev = add_command(sub, "eval", _cmd_eval, extra=ENGINE,
                     help="evaluate on a dataset (base model, or from a library); writes a signed record")
    ev.add_argument("--model", required=True, metavar="NAME", help=MODEL_HELP)
    ev.add_argument("--dataset", type=Path, required=True, metavar="FILE", help="the problems: " + DATASET_HELP)
    ev.add_argument("--out", type=Path, required=True, help="the record directory to create")
    ev.add_argument("--library", type=Path, help="answer from this library")
    ev.add_argument("--library-entry", metavar="DIGEST",
                    help="with --library: graft this entry (its artifact's sha256:...) before every problem, "
                    "the control of an unrelated worked example")
    ev.add_argument("--graft-threshold", type=float, metavar="S",
                    help="with --library: the least similarity (0-1) at which a similar entry is grafted "
                    "(default: the calibrated one, docs/library.md); 0 grafts the most similar entry always")
    ev.add_argument("--temperature", type=float, metavar="T",
                    help="sample at this temperature (0 to 2; default 0: greedy decoding, exact); needs --sample-seed")
    ev.add_argument("--top-p", type=float, metavar="P", help="with --temperature: nucleus sampling, keep the top P of the mass")
    ev.add_argument("--sample-seed", type=int, metavar="N",
                    help="with --temperature: problem D is sampled with seed N + D, so a run is reproducible and resumable")
    ev.add_argument("--batch", type=int, default=1, metavar="N",
                    help="decode N problems per forward pass (default 1: one at a time); a stopped run resumes")
    ev.add_argument("--max-new-tokens", type=int, default=256, metavar="N", help="decode budget per problem (default 256)")
    ev.add_argument("--limit", type=int, help="the first N problems (or N drawn with --seed)")
    ev.add_argument("--seed", type=int, help="draw --limit problems with this seed")
    add_profile_option(ev, flywheel=True)
    add_trust_options(ev)
    add_key_options(ev)

    pr = add_command(sub, "prereg", _cmd_prereg, extra=ENGINE,
                     help="pre-register the replay of an evaluation (and log it)")
    pr.add_argument("--eval", type=Path, required=True, help="the evaluation record directory to reproduce")
    pr.add_argument("--dataset", type=Path, required=True, metavar="FILE",
                    help="the dataset the evaluation ran on (its digest must match the record's): " + DATASET_HELP)
    pr.add_argument("--library", type=Path, help="the library the evaluation used")
    pr.add_argument("--out", type=Path, required=True, metavar="DIR", help="the pre-registration directory to create")
    add_key_options(pr)
    add_registry_options(pr, required=False)

    rp = add_command(sub, "replay", _cmd_replay, extra=ENGINE,
                     help="run a logged pre-registration in a fresh process and publish the replay record")
    rp.add_argument("--pre-registration", type=Path, required=True, metavar="DIR",
                    help="the directory 'kvgraft prereg' wrote (it must already be in the registry's log)")
    rp.add_argument("--out", type=Path, required=True, metavar="DIR", help="the replay record directory to create")
    rp.add_argument("--checkpoint-out", type=Path, help="where the signed checkpoint goes (default: OUT.checkpoint.txt)")
    add_key_options(rp)
    add_trust_options(rp)
    add_registry_options(rp, required=True)
