"""Evaluations, pre-registrations and replays, written as signed records (docs/records.md).

``run_eval`` answers a dataset's problems with the base model (instruction + problem, decoded
greedily) or from a library (``Library.ask``), grades each output with the verifier's grader and
writes ``record.dsse.json`` + ``outputs.jsonl`` atomically. ``write_pre_registration`` turns a
finished evaluation into what its replay must reproduce; ``run_replay`` runs the registered
command in a fresh process and records whether every output hash came back.
"""

from __future__ import annotations

import dataclasses
import os
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvgraft.schemas import (
    EXPECTED_OUTPUTS_FILE,
    OUTPUTS_FILE,
    RECORD_FILE,
    DatasetRef,
    DesignRef,
    DeterminismProfile,
    DocumentError,
    EvaluationItem,
    EvaluationPredicate,
    EvaluationStatement,
    ExperimentDesign,
    PreRegistrationPredicate,
    PreRegistrationRef,
    PreRegistrationStatement,
    ReplayPredicate,
    ReplayStatement,
    Sha256Digest,
    Sha256Hex,
    Statement,
    Subject,
    SubjectDigest,
    canonical_json,
    hex_of,
    parse_json,
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
from .library import INSTRUCTION, EnergyMeter, Hit, Library, problem_hash, question_text, stop_after_boxed
from .ops import GREEDY, AnyModel, Decoded, DecodeJob, Sampling, continue_from, decode_batch


def select(dataset: Dataset, limit: int | None, seed: int | None) -> list[int]:
    """The doc ids evaluated: the first ``limit``, or ``limit`` drawn with ``seed`` (sorted)."""
    ids = list(range(len(dataset.docs)))
    if limit is not None and limit < 0:
        raise EvaluationError(f"--limit {limit} is negative", hint="pass a number of problems, e.g. --limit 20")
    if seed is not None:
        return sorted(random.Random(seed).sample(ids, min(limit or len(ids), len(ids))))
    return ids[:limit] if limit is not None else ids


def _chosen(dataset: Dataset, doc_ids: Sequence[int] | None, limit: int | None, seed: int | None) -> list[int]:
    """The problems a run answers: ``doc_ids`` (checked: distinct, in the dataset), else ``select``'s."""
    if doc_ids is None:
        return select(dataset, limit, seed)
    if limit is not None or seed is not None:
        raise EvaluationError("doc ids were given with a limit or seed", hint="give the doc ids alone")
    chosen = list(doc_ids)
    outside = [i for i in chosen if not 0 <= i < len(dataset.docs)]
    if outside or len(set(chosen)) != len(chosen) or not chosen:
        raise EvaluationError(f"the doc ids {'include ' + str(outside[:5]) + ' outside ' + dataset.name if outside else 'repeat or are empty'}",
                              hint=f"pass distinct doc ids from 0 to {len(dataset.docs) - 1}")
    return chosen


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


#: The format of an evaluation's progress journal (``OUT.journal.jsonl``).
JOURNAL_FORMAT = "kvgraft-eval-journal/v1"
#: The longest journal line read back (one problem's prompt and output: far below this).
MAX_JOURNAL_LINE_BYTES = 4 << 20


def journal_path(out: Path) -> Path:
    """Where the evaluation writing ``out`` journals its finished items: ``OUT.journal.jsonl``,
    beside the record directory (which appears only when complete)."""
    return out.with_name(out.name + ".journal.jsonl")


@dataclass(frozen=True)
class _Done:
    """A finished item as the journal keeps it: enough to grade, hash and count it again."""

    doc_id: int
    prompt: str
    output: str
    prompt_tokens: int
    decode_tokens: int
    entry: str | None
    stopped_by: str
    seconds: float
    joules: float
    energy_method: str


#: The JSON types of a journal line's fields (an int is also a float's valid JSON form).
_DONE_TYPES: dict[str, tuple[type, ...]] = {
    "doc_id": (int,), "prompt": (str,), "output": (str,), "prompt_tokens": (int,), "decode_tokens": (int,),
    "entry": (str, type(None)), "stopped_by": (str,), "seconds": (int, float), "joules": (int, float), "energy_method": (str,),
}


class _Journal:
    """An evaluation's finished items, one JSON line each after a header naming the run, fsynced
    as each item ends: a run stopped at any point resumes with the items it had finished.

    The header is the run's identity (model, profile, dataset digest, the items drawn, mode,
    library, budget, batch); a journal of another run is refused, never mixed in. A last line
    cut short by a crash is dropped (and cut off the file) before new lines are appended.
    """

    def __init__(self, path: Path, identity: dict[str, Any]) -> None:
        self.path = path
        self.done: dict[int, _Done] = {}
        self._doc_ids = set(identity["doc_ids"])
        self.header = canonical_json({"format": JOURNAL_FORMAT, "run": identity})
        keep = 0
        if path.exists():
            keep = self._read()
        try:
            self._file = path.open("r+b" if path.exists() else "wb")
            self._file.truncate(keep)
            self._file.seek(keep)
            if keep == 0:
                self._append(self.header)
        except OSError as e:
            raise EvaluationError(f"cannot write the evaluation journal {path}: {e.strerror}",
                                  hint="choose an --out whose directory is writable") from e

    def _read(self) -> int:
        """Load the finished items; the byte length of the complete lines."""
        stale = f"delete {self.path} to start the evaluation again, or choose another --out"
        with self.path.open("rb") as f:
            header = f.readline(MAX_JOURNAL_LINE_BYTES + 1)
            if not header.endswith(b"\n"):
                return 0  # not even the header was finished: start afresh
            if header.rstrip(b"\n") != self.header:
                raise EvaluationError(f"{self.path} is the journal of another evaluation (other model, profile, "
                                      "dataset, items, library, budget or batch)", hint=stale)
            keep, n = len(header), 1
            while True:
                n += 1
                line = f.readline(MAX_JOURNAL_LINE_BYTES + 1)
                if not line.endswith(b"\n"):
                    if len(line) > MAX_JOURNAL_LINE_BYTES:
                        raise EvaluationError(f"{self.path} line {n} is longer than {MAX_JOURNAL_LINE_BYTES} bytes",
                                              hint=stale)
                    return keep
                try:
                    obj = parse_json(line, what=f"{self.path} line {n}")
                except DocumentError as e:
                    raise EvaluationError(f"{self.path} line {n} is not a finished item: {e}", hint=stale) from e
                wrong = sorted(set(obj) ^ set(_DONE_TYPES)) if isinstance(obj, dict) else ["(not an object)"]
                wrong += [k for k, kinds in _DONE_TYPES.items() if k in obj and k not in wrong
                          and (not isinstance(obj[k], kinds) or isinstance(obj[k], bool))]
                if wrong or obj["doc_id"] not in self._doc_ids:
                    raise EvaluationError(f"{self.path} line {n} is not a finished item of this evaluation"
                                          + (f" (fields {', '.join(wrong)})" if wrong else f" (doc {obj['doc_id']} is not drawn)"),
                                          hint=stale)
                done = _Done(**obj)
                self.done[done.doc_id] = done
                keep += len(line)

    def _append(self, line: bytes) -> None:
        self._file.write(line + b"\n")
        self._file.flush()
        os.fsync(self._file.fileno())

    def add(self, done: _Done) -> None:
        """Record ``done`` durably."""
        try:
            self._append(canonical_json(dataclasses.asdict(done)))
        except OSError as e:
            raise EvaluationError(f"cannot write the evaluation journal {self.path}: {e.strerror}",
                                  hint="free some disk space and run the same command again: it resumes") from e
        self.done[done.doc_id] = done

    def close(self) -> None:
        self._file.close()


@dataclass(frozen=True)
class _Question:
    """One problem set up to be answered: its prompt, the decoding to run, and the entry grafted."""

    doc_id: int
    prompt: str
    job: DecodeJob
    #: Text before the decoded tokens in the output (a recall's opening brace).
    head: str
    entry: str | None


def run_eval(
    model: AnyModel,
    profile: DeterminismProfile,
    dataset_path: Path,
    out: Path,
    *,
    key: Path,
    library: Library | None = None,
    fixed_entry: Sha256Digest | None = None,
    max_new_tokens: int = 256,
    limit: int | None = None,
    seed: int | None = None,
    batch: int = 1,
    passphrase: bytes | None = None,
    on_item: Callable[[int, int, EvaluationItem], None] | None = None,
    sampling: Sampling = GREEDY,
    design: DesignRef | None = None,
    doc_ids: Sequence[int] | None = None,
) -> EvalRun:
    """Evaluate ``model`` on ``dataset_path`` and write the signed record.

    Each problem is answered by the base model (instruction + problem, from an empty state), or
    from ``library`` (``Library.ask``: recall, the most similar entry, or the prefix alone), or,
    with ``fixed_entry`` (an entry's artifact digest), with that one entry grafted before every
    problem: the control of "a worked example, but not a related one".

    ``batch`` > 1 decodes that many problems per forward pass (``decode_batch``; the answers
    are those of a batched run: reproducible for the same command, see ``KVBatch``); 1 decodes
    one at a time, as every evaluation before did. Finished items are journaled in
    ``journal_path(out)``: the same command run again resumes there; the journal is removed
    once the record is written.

    ``sampling``: greedy by default (exact, and what every evaluation before ran). Sampled,
    problem ``doc_id`` is decoded with ``sampling.offset(doc_id)`` (seed + doc id), so an item's
    answer does not depend on which others ran, in what order or batch; the record's settings
    hold ``temperature``, ``top_p`` and ``sample_seed``.

    ``design``: the pre-registered design this run is an arm of, named in the record (whether
    the record follows it is ``kvgraft-verify eval --design``'s check). ``doc_ids``: these
    problems, in this order, in place of ``limit`` and ``seed`` (the record's settings hold
    their count as ``limit`` and the sha256 of their canonical JSON list as ``doc_ids_sha256``).
    """
    if max_new_tokens < 1:
        raise EvaluationError(f"--max-new-tokens {max_new_tokens} is not positive", hint="e.g. --max-new-tokens 256")
    if batch < 1:
        raise EvaluationError(f"--batch {batch} is not positive", hint="e.g. --batch 16 (1 decodes one problem at a time)")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise EvaluationError(f"{out} already exists and is not an empty directory", hint="choose a new --out directory")
    dataset = load_dataset(dataset_path)
    if library is not None and library.meta["kind"] != dataset.kind:
        raise EvaluationError(f"{dataset.name} is a {dataset.kind} dataset; the library holds {library.meta['kind']} problems",
                              hint="evaluate with a library of the same kind of problems")
    fixed: Hit | None = None
    if fixed_entry is not None:
        if library is None:
            raise EvaluationError("--library-entry names an entry of a library, but no --library was given",
                                  hint="pass the --library that holds it")
        match = [e for e in library.entries if e.artifact == fixed_entry]
        if not match:
            raise EvaluationError(f"library {library.directory} holds no entry {fixed_entry}",
                                  hint=f"pass the artifact digest of one of its entries ({library.directory}/index.jsonl)")
        fixed = Hit(match[0], "fixed", 0.0)
    chosen = _chosen(dataset, doc_ids, limit, seed)
    if doc_ids is not None:
        limit, seed = len(chosen), None
    doc_ids = chosen
    mode = "base" if library is None else "fixed" if fixed is not None else "library"
    settings: dict[str, str | int | float | bool | None] = {
        "mode": mode, "max_new_tokens": max_new_tokens, "limit": limit, "seed": seed, "batch": batch,
        "instruction_sha256": hex_of(sha256_bytes(INSTRUCTION.encode("utf-8"))),
        "library_prefix": library.meta["prefix_artifact"] if library is not None else None,
        "library_entries": len(library.entries) if library is not None else None,
        "library_entry_fixed": fixed_entry,
    }
    if chosen != select(dataset, limit, seed):
        settings["doc_ids_sha256"] = hex_of(sha256_bytes(canonical_json(chosen)))
    if not sampling.greedy:
        # Only a sampled run says so: a greedy run's settings (and journal) are what they always were.
        settings.update({"temperature": sampling.temperature, "top_p": sampling.top_p, "sample_seed": sampling.seed})
    if mode == "library" and library is not None:
        # Below it a similar entry is not grafted (the model answers unassisted): part of the run.
        settings["graft_threshold"] = library.graft_threshold
    journal = _Journal(journal_path(out), {
        "model": model.ref.model_dump(mode="json"), "profile": profile.model_dump(mode="json"),
        "dataset": dataset.digest, "doc_ids": doc_ids, "settings": settings,
    })
    try:
        _answer_all(model, profile, dataset, [i for i in doc_ids if i not in journal.done], journal, library, fixed,
                    max_new_tokens, batch, on_item, len(doc_ids), sampling)
    finally:
        journal.close()
    done = [journal.done[i] for i in doc_ids]
    if library is not None:
        # How many answers were of each kind (issue 39): recalled, assisted, unassisted.
        kinds = [_kind(library, dataset, d, fixed=fixed is not None) for d in done]
        settings.update({kind: kinds.count(kind) for kind in ("recalled", "assisted", "unassisted")})
    run = _write_evaluation(model, profile, dataset, done, settings, out, key=key, passphrase=passphrase, design=design)
    journal.path.unlink(missing_ok=True)
    return run


def _write_evaluation(model: AnyModel, profile: DeterminismProfile, dataset: Dataset, done: list[_Done],
                      settings: dict[str, str | int | float | bool | None], out: Path, *, key: Path,
                      passphrase: bytes | None, design: DesignRef | None) -> EvalRun:
    """Grade, hash and count the finished items ``done`` (in record order) and write the signed
    evaluation record with its outputs file under ``out`` (``settings`` gains the cut-off count,
    time and energy)."""
    items, lines = [], []
    for d in done:
        items.append(_item(dataset, d))
        lines.append(OutputLine(d.doc_id, d.prompt, d.output))
    seconds = sum(d.seconds for d in done)
    joules = sum(d.joules for d in done)
    energy_method = "measured" if done and all(d.energy_method == "measured" for d in done) else "estimated"
    outputs = outputs_file_bytes(lines)
    settings = dict(settings)
    settings.update({
        # How many answers the budget cut off: what says whether it bound.
        "cut_off": sum(d.stopped_by == "max_new_tokens" for d in done),
        # Measured on the machine that ran it: signed, but not recomputable offline.
        "seconds": round(seconds, 3), "energy_joules": round(joules, 3), "energy_method": energy_method,
    })
    statement = EvaluationStatement(
        subject=[_subject(OUTPUTS_FILE, outputs)],
        predicate=EvaluationPredicate(
            model=model.ref, profile=profile, dataset=DatasetRef(name=dataset.name, digest=dataset.digest),
            settings=settings, items=items,
            aggregates=evaluation_aggregates(items),
            outputs_digest=sha256_bytes(outputs),
            library_artifacts=sorted({i.library_entry for i in items if i.library_entry is not None}),
            design=design,
        ),
    )
    _write_record_dir(out, statement, {OUTPUTS_FILE: outputs}, key=key, passphrase=passphrase)
    return EvalRun(out, statement, seconds, joules, energy_method)


def _kind(library: Library, dataset: Dataset, d: _Done, *, fixed: bool) -> str:
    """The kind of a finished item's answer from a library: ``recalled`` when the entry grafted is
    the problem's own (looked up, not ``fixed``: a fixed entry is always a worked example before
    the problem), ``assisted`` for another entry, ``unassisted`` for none. (An evaluation grades
    the model's output, a recall's restating included: it measures the model.)"""
    if d.entry is None:
        return "unassisted"
    if fixed:
        return "assisted"
    own = {e.artifact for e in library.entries if e.problem_hash == problem_hash(dataset.question(d.doc_id))}
    return "recalled" if d.entry in own else "assisted"


def _item(dataset: Dataset, d: _Done) -> EvaluationItem:
    """The graded, hashed record item of a finished answer."""
    graded = grade(dataset, d.doc_id, d.output)
    hashes = harness_hashes(dataset.docs[d.doc_id], d.prompt, dataset.target(d.doc_id))
    return EvaluationItem(
        doc_id=d.doc_id, doc_hash=hashes.doc_hash, prompt_hash=hashes.prompt_hash, target_hash=hashes.target_hash,
        output_hash=output_hash(d.output), extracted_answer=graded.extracted, correct=graded.correct,
        prompt_tokens=d.prompt_tokens, decode_tokens=d.decode_tokens,
        library_entry=Sha256Digest(d.entry) if d.entry is not None else None,
    )


def _question(model: AnyModel, dataset: Dataset, doc_id: int, library: Library | None, fixed: Hit | None,
              max_new_tokens: int, sampling: Sampling) -> _Question:
    question = dataset.question(doc_id)
    sampling = sampling.offset(doc_id)
    if library is None:
        prompt = INSTRUCTION + question_text(question)
        ids = model.tokenizer.encode(prompt, first=True)
        # From an empty state, decoded as Library.ask decodes (EOS ends the output, not part of it).
        job = DecodeJob(None, ids, max_new_tokens, keep_eos=False, stop=stop_after_boxed, sampling=sampling)
        return _Question(doc_id, prompt, job, "", None)
    plan = library.plan(question, fixed or library.lookup(question), max_new_tokens=max_new_tokens)
    return _Question(doc_id, plan.prompt, plan.job(sampling=sampling), plan.head, plan.hit.entry.artifact if plan.hit else None)


def _answer_all(model: AnyModel, profile: DeterminismProfile, dataset: Dataset, doc_ids: list[int], journal: _Journal,
                library: Library | None, fixed: Hit | None, max_new_tokens: int, batch: int,
                on_item: Callable[[int, int, EvaluationItem], None] | None, total: int, sampling: Sampling) -> None:
    """Answer ``doc_ids`` (one at a time, or ``batch`` per forward pass) into ``journal``."""
    meter = EnergyMeter(model.parameter_count)
    clock = [time.perf_counter()]
    meter.start()

    def finish(q: _Question, decoded: Decoded) -> None:
        # Time and energy since the last item ended: summed, they are the run's.
        now = time.perf_counter()
        joules, method = meter.stop(len(q.job.suffix_ids) + len(decoded.tokens))
        meter.start()
        done = _Done(doc_id=q.doc_id, prompt=q.prompt, output=q.head + decoded.text, prompt_tokens=len(q.job.suffix_ids),
                     decode_tokens=len(decoded.tokens), entry=q.entry, stopped_by=decoded.stopped_by,
                     seconds=round(now - clock[0], 6), joules=joules, energy_method=method)
        clock[0] = now
        journal.add(done)
        if on_item is not None:
            on_item(len(journal.done) - 1, total, _item(dataset, done))

    if batch == 1:
        for doc_id in doc_ids:
            q = _question(model, dataset, doc_id, library, fixed, max_new_tokens, sampling)
            j = q.job
            finish(q, continue_from(model, profile, j.artifact, j.suffix_ids, max_new_tokens=j.max_new_tokens,
                                    keep_eos=j.keep_eos, stop=j.stop, sampling=j.sampling))
        return
    questions: list[_Question] = []

    def jobs() -> Iterator[DecodeJob]:
        # Set up lazily, as rows free up: an entry's artifact is loaded (and verified) only then.
        for doc_id in doc_ids:
            questions.append(_question(model, dataset, doc_id, library, fixed, max_new_tokens, sampling))
            yield questions[-1].job

    decode_batch(model, profile, jobs(), batch=batch, on_done=lambda i, decoded: finish(questions[i], decoded))


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
    if s.get("library_entry_fixed") is not None:
        cmd += ["--library-entry", str(s["library_entry_fixed"])]
    elif library is not None and s.get("mode") == "library":
        # A record made before the threshold grafted the most similar entry at any score: 0 replays it.
        cmd += ["--graft-threshold", str(s.get("graft_threshold", 0.0))]
    if s.get("batch", 1) != 1:
        cmd += ["--batch", str(s["batch"])]
    if s.get("sample_seed") is not None:
        cmd += ["--temperature", str(s["temperature"]), "--top-p", str(s["top_p"]), "--sample-seed", str(s["sample_seed"])]
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


def write_design(out: Path, design: ExperimentDesign, *, model: AnyModel, profile: DeterminismProfile, dataset_path: Path,
                 command: Sequence[str], key: Path, passphrase: bytes | None = None) -> PreRegistrationStatement:
    """Pre-register an experiment's ``design`` (a pre-registration with ``design`` set, no
    expected outputs: its only subject is an empty ``expected-outputs.jsonl``) under ``out``.

    Written before any test output exists, and logged (``kvgraft publish``) before any arm's
    record is: each arm's evaluation record then names it (``run_eval(design=...)``) and counts
    only if logged after it. Refuses a ``dataset_path`` that is not the design's test split."""
    dataset = load_dataset(dataset_path)
    if dataset.digest != design.test.digest:
        raise EvaluationError(f"{dataset_path} has digest {dataset.digest}, but the design's test split is {design.test.digest}",
                              hint="pass the test split's dataset file, unmodified")
    empty = b""
    statement = PreRegistrationStatement(
        subject=[_subject(EXPECTED_OUTPUTS_FILE, empty)],
        predicate=PreRegistrationPredicate(
            model=model.ref, profile=profile, dataset=DatasetRef(name=dataset.name, digest=dataset.digest),
            command=list(command), settings={"k": design.k, "budget": design.budget, "arms": len(design.arms)},
            expected_output_hashes={}, expected_outputs_digest=sha256_bytes(empty), design=design,
        ),
    )
    _write_record_dir(out, statement, {EXPECTED_OUTPUTS_FILE: empty}, key=key, passphrase=passphrase)
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
