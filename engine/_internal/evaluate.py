"""Evaluations, pre-registrations and replays, written as signed records (docs/records.md).

``run_eval`` answers a dataset's problems with the base model (instruction + problem, decoded
greedily) or from a library (``Library.ask``), grades each output with the verifier's grader and
writes ``record.dsse.json`` + ``outputs.jsonl`` atomically. ``write_pre_registration`` turns a
finished evaluation into what its replay must reproduce; ``run_replay`` runs the registered
command in a fresh process and records whether every output hash came back.
"""

from __future__ import annotations

import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvgraft.schemas import (
    EXPECTED_OUTPUTS_FILE,
    OUTPUTS_FILE,
    RECORD_FILE,
    DatasetRef,
    DeterminismProfile,
    DocumentError,
    EvaluationItem,
    EvaluationPredicate,
    EvaluationStatement,
    PreRegistrationPredicate,
    PreRegistrationRef,
    PreRegistrationStatement,
    ReplayPredicate,
    ReplayStatement,
    Sha256Hex,
    Statement,
    Subject,
    SubjectDigest,
    hex_of,
    sha256_bytes,
    statement_unverified,
    write_staged_directory,
)
from kvgraft.verifier import (
    Dataset,
    OutputLine,
    VerificationError,
    envelope_json,
    evaluation_aggregates,
    grade,
    harness_hashes,
    load_dataset,
    open_signing_key,
    output_hash,
    outputs_file_bytes,
    parse_outputs,
    read_envelope,
    sign_statement,
)

from .errors import EvaluationError
from .library import INSTRUCTION, EnergyMeter, Library, question_text, stop_after_boxed
from .models import LoadedModel
from .ops import continue_from


def select(dataset: Dataset, limit: int | None, seed: int | None) -> list[int]:
    """The doc ids evaluated: the first ``limit``, or ``limit`` drawn with ``seed`` (sorted)."""
    ids = list(range(len(dataset.docs)))
    if limit is not None and limit < 0:
        raise EvaluationError(f"--limit {limit} is negative", hint="pass a number of problems, e.g. --limit 20")
    if seed is not None:
        return sorted(random.Random(seed).sample(ids, min(limit or len(ids), len(ids))))
    return ids[:limit] if limit is not None else ids


@dataclass(frozen=True)
class EvalRun:
    """A finished evaluation: its statement, where it was written, and what it cost."""

    directory: Path
    statement: EvaluationStatement
    seconds: float
    energy_joules: float
    energy_method: str


def _write_record_dir(out: Path, statement: Statement, files: dict[str, bytes], *, key: Path, passphrase: bytes | None) -> None:
    """Sign ``statement`` and write it with ``files`` under ``out``, which appears only when complete."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise EvaluationError(f"{out} already exists and is not an empty directory", hint="choose a new --out directory")
    with open_signing_key(key, passphrase) as signer:
        envelope = sign_statement(statement, [signer])
    write_staged_directory(out, {**files, RECORD_FILE: envelope_json(envelope)}, replace_empty=True)


def _subject(name: str, data: bytes) -> Subject:
    return Subject(name=name, digest=SubjectDigest(sha256=hex_of(sha256_bytes(data))))


def run_eval(
    model: LoadedModel,
    profile: DeterminismProfile,
    dataset_path: Path,
    out: Path,
    *,
    key: Path,
    library: Library | None = None,
    max_new_tokens: int = 256,
    limit: int | None = None,
    seed: int | None = None,
    passphrase: bytes | None = None,
    on_item: Callable[[int, int, EvaluationItem], None] | None = None,
) -> EvalRun:
    """Evaluate ``model`` on ``dataset_path`` (from ``library`` when given) and write the signed record."""
    if max_new_tokens < 1:
        raise EvaluationError(f"--max-new-tokens {max_new_tokens} is not positive", hint="e.g. --max-new-tokens 256")
    dataset = load_dataset(dataset_path)
    if library is not None and library.meta["kind"] != dataset.kind:
        raise EvaluationError(f"{dataset.name} is a {dataset.kind} dataset; the library holds {library.meta['kind']} problems",
                              hint="evaluate with a library of the same kind of problems")
    doc_ids = select(dataset, limit, seed)
    meter = EnergyMeter(sum(p.numel() for p in model.module.parameters()))
    meter.start()
    t0 = time.perf_counter()
    items: list[EvaluationItem] = []
    lines: list[OutputLine] = []
    tokens_run = 0
    for n, doc_id in enumerate(doc_ids):
        question = dataset.question(doc_id)
        if library is not None:
            answer = library.ask(question, max_new_tokens=max_new_tokens)
            prompt, output, entry = answer.prompt, answer.text, answer.entry
            prompt_tokens, decode_tokens = answer.prompt_tokens, answer.decode_tokens
        else:
            prompt = INSTRUCTION + question_text(question)
            ids = model.tokenizer.encode(prompt, first=True)
            # From an empty state, decoded as Library.ask decodes (EOS ends the output, not part of it).
            decoded = continue_from(model, profile, None, ids, max_new_tokens=max_new_tokens, keep_eos=False,
                                    stop=stop_after_boxed)
            output, decode_tokens = decoded.text, len(decoded.tokens)
            prompt_tokens, entry = len(ids), None
        tokens_run += prompt_tokens + decode_tokens
        graded = grade(dataset, doc_id, output)
        hashes = harness_hashes(dataset.docs[doc_id], prompt, dataset.target(doc_id))
        item = EvaluationItem(
            doc_id=doc_id, doc_hash=hashes.doc_hash, prompt_hash=hashes.prompt_hash, target_hash=hashes.target_hash,
            output_hash=output_hash(output), extracted_answer=graded.extracted,
            correct=graded.correct, prompt_tokens=prompt_tokens, decode_tokens=decode_tokens, library_entry=entry,
        )
        items.append(item)
        lines.append(OutputLine(doc_id, prompt, output))
        if on_item is not None:
            on_item(n, len(doc_ids), item)
    seconds = time.perf_counter() - t0
    joules, energy_method = meter.stop(tokens_run)
    outputs = outputs_file_bytes(lines)
    settings: dict[str, str | int | float | bool | None] = {
        "mode": "library" if library is not None else "base",
        "max_new_tokens": max_new_tokens, "limit": limit, "seed": seed,
        "instruction_sha256": hex_of(sha256_bytes(INSTRUCTION.encode("utf-8"))),
        "library_prefix": library.meta["prefix_artifact"] if library is not None else None,
        "library_entries": len(library.entries) if library is not None else None,
        # Measured on the machine that ran it: signed, but not recomputable offline.
        "seconds": round(seconds, 3), "energy_joules": round(joules, 3), "energy_method": energy_method,
    }
    statement = EvaluationStatement(
        subject=[_subject(OUTPUTS_FILE, outputs)],
        predicate=EvaluationPredicate(
            model=model.ref, profile=profile, dataset=DatasetRef(name=dataset.name, digest=dataset.digest),
            settings=settings, items=items,
            aggregates=evaluation_aggregates(items),
            outputs_digest=sha256_bytes(outputs),
            library_artifacts=sorted({i.library_entry for i in items if i.library_entry is not None}),
        ),
    )
    _write_record_dir(out, statement, {OUTPUTS_FILE: outputs}, key=key, passphrase=passphrase)
    return EvalRun(out, statement, seconds, joules, energy_method)


# --- reading records ------------------------------------------------------------------------------


def read_record(directory: Path, kind: type[Statement]) -> tuple[bytes, Any]:
    """The envelope bytes and the statement of ``directory/record.dsse.json`` (signature not
    checked here: ``kvgraft-verify`` does that), refusing another record type."""
    path = directory / RECORD_FILE
    try:
        raw = path.read_bytes()
        statement = statement_unverified(read_envelope(path), what=str(path))
    except OSError as e:
        raise EvaluationError(f"cannot read {path}: {e.strerror}", hint="pass the record directory") from e
    except (VerificationError, DocumentError) as e:
        raise EvaluationError(f"{path}: {e}") from e
    if not isinstance(statement, kind):
        raise EvaluationError(f"{path} is a {statement.predicate_type} record, not what this command needs",
                              hint="pass the directory the matching command wrote")
    return raw, statement


def output_hashes(outputs: bytes, what: str) -> dict[str, Sha256Hex]:
    """``str(doc_id) -> sha256 hex of the output`` for each line of an outputs file (parsed as
    strictly as the verifier parses it)."""
    try:
        return {str(line.doc_id): output_hash(line.output) for line in parse_outputs(outputs, what=what)}
    except VerificationError as e:
        raise EvaluationError(str(e), hint="see docs/records.md, 'Outputs files'") from e


# --- pre-registration and replay ------------------------------------------------------------------


def eval_command(statement: EvaluationStatement, dataset_path: Path, library: Path | None) -> list[str]:
    """The ``kvgraft eval`` command line that reproduces ``statement``'s run (without ``--out``)."""
    p = statement.predicate
    s = p.settings
    cmd = ["kvgraft", "eval", "--model", p.model.name, "--profile", p.profile.name, "--dataset", str(dataset_path),
           "--max-new-tokens", str(s["max_new_tokens"])]
    if s.get("limit") is not None:
        cmd += ["--limit", str(s["limit"])]
    if s.get("seed") is not None:
        cmd += ["--seed", str(s["seed"])]
    if library is not None:
        cmd += ["--library", str(library)]
    return cmd


def write_pre_registration(
    eval_dir: Path, out: Path, *, dataset_path: Path, library: Path | None, key: Path, passphrase: bytes | None = None
) -> PreRegistrationStatement:
    """Register what a replay of the evaluation in ``eval_dir`` runs and must reproduce."""
    _, evaluation = read_record(eval_dir, EvaluationStatement)
    try:
        outputs = (eval_dir / OUTPUTS_FILE).read_bytes()
    except OSError as e:
        raise EvaluationError(f"cannot read {eval_dir / OUTPUTS_FILE}: {e.strerror}") from e
    if sha256_bytes(outputs) != evaluation.predicate.outputs_digest:
        raise EvaluationError(f"{eval_dir / OUTPUTS_FILE} is not the outputs file its record names",
                              hint="run 'kvgraft-verify eval' on it; pre-register only an intact evaluation")
    dataset = load_dataset(dataset_path)
    if dataset.digest != evaluation.predicate.dataset.digest:
        raise EvaluationError(f"{dataset_path} is not the dataset {evaluation.predicate.dataset.name} the evaluation ran on",
                              hint="pass the same dataset file")
    p = evaluation.predicate
    statement = PreRegistrationStatement(
        subject=[_subject(EXPECTED_OUTPUTS_FILE, outputs)],
        predicate=PreRegistrationPredicate(
            model=p.model, profile=p.profile, dataset=p.dataset, command=eval_command(evaluation, dataset_path, library),
            settings={k: v for k, v in p.settings.items() if k not in ("seconds", "energy_joules", "energy_method")},
            expected_output_hashes=output_hashes(outputs, str(eval_dir / OUTPUTS_FILE)),
            expected_outputs_digest=sha256_bytes(outputs),
        ),
    )
    _write_record_dir(out, statement, {EXPECTED_OUTPUTS_FILE: outputs}, key=key, passphrase=passphrase)
    return statement


def run_replay(
    pre_registration: Path, out: Path, *, log_index: int, key: Path, passphrase: bytes | None = None,
    python: Sequence[str] = (sys.executable, "-m", "kvgraft"), trust_args: Sequence[str] = (),
) -> ReplayStatement:
    """Run the pre-registered command in a fresh process and record whether it reproduced.

    ``trust_args`` (``--trusted-keys FILE``, ``--trust-local-key``, ``--insecure-skip-verify``)
    are appended to the command: they decide which signatures the replayed eval accepts, never
    what it computes, so they are not part of the registered command.
    """
    raw, prereg = read_record(pre_registration, PreRegistrationStatement)
    command = list(prereg.predicate.command)
    if command[:2] != ["kvgraft", "eval"]:
        raise EvaluationError(f"{pre_registration}: the registered command is {command[:2]}, not 'kvgraft eval'",
                              hint="only evaluations can be replayed")
    with tempfile.TemporaryDirectory(prefix="kvgraft-replay-") as tmp:
        run_dir = Path(tmp) / "eval"
        proc = subprocess.run([*python, *command[1:], *trust_args, "--out", str(run_dir)], capture_output=True, text=True,
                              check=False)
        if proc.returncode != 0:
            raise EvaluationError(
                f"the replayed command exited {proc.returncode}: {proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else ''}",
                hint="run it by hand to see why: " + " ".join(command),
            )
        outputs = (run_dir / OUTPUTS_FILE).read_bytes()
    hashes = output_hashes(outputs, "the replay's outputs")
    statement = ReplayStatement(
        subject=[_subject(OUTPUTS_FILE, outputs)],
        predicate=ReplayPredicate(
            pre_registration=PreRegistrationRef(envelope_digest=sha256_bytes(raw), log_index=log_index),
            output_hashes=hashes, outputs_digest=sha256_bytes(outputs),
            reproduced=hashes == dict(prereg.predicate.expected_output_hashes),
        ),
    )
    _write_record_dir(out, statement, {OUTPUTS_FILE: outputs}, key=key, passphrase=passphrase)
    return statement
