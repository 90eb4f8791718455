"""Voted evaluations: self-consistency@k and the verifier-gated flywheel (issue 39, docs/flywheel.md).

Each problem is answered by ``k`` samples of the base prompt (instruction + problem, from an
empty state), sample ``j`` of problem ``d`` drawn with ``sampling.offset(d * k + j)``: the same
samples whichever arm, run or batch asks for them, so the self-consistency arm and the flywheel
share them (decoded once, journaled in ``samples_journal``).

Decision rules (``VOTE_RULE``, ``FLYWHEEL_RULE``), from finished decodes only (a decode cut off by
the budget gives no answer):

- ``vote``: the plurality of the samples' answers; a tie goes to the answer given first.
- ``flywheel``: when all ``k`` samples finished with one answer, that answer. Otherwise one
  greedy answer is decoded with the most similar verified library entry grafted before the
  problem (when its similarity reaches the library's graft threshold; else unassisted); the decision is the plurality of the samples'
  answers and that answer, a tie going to the grafted answer, then to the answer given first.

The record's output for a problem is the finished decodes' texts, each after a line ``[sample]``
or ``[grafted]``, then ``[decision] #### ANSWER`` (or ``[decision] none``): what the grader reads
is the decision. The format and ``decide`` are the verifier's (``kvgraft.verifier.compose``,
``decide``), which re-decides every problem from the answers its output lists. Its
``decode_tokens`` and ``prompt_tokens`` count every decode the problem cost, cut-off ones included.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from kvgraft.schemas import DesignRef, DeterminismProfile, EvaluationItem, hex_of, sha256_bytes
from kvgraft.verifier import Dataset, compose, decide, extract_answer, load_dataset

from .errors import EvaluationError
from .evaluate import EvalRun, _chosen, _Done, _item, _Journal, _write_evaluation, journal_path
from .library import INSTRUCTION, EnergyMeter, Library, question_text, stop_after_boxed
from .ops import GREEDY, AnyModel, Decoded, DecodeJob, Sampling, decode_batch

VOTE_RULE = "plurality of the k samples' answers from finished decodes; a tie goes to the answer given first"
FLYWHEEL_RULE = (
    "all k samples finished with one answer: that answer; otherwise decode one greedy answer with the most similar "
    "verified library entry grafted (when its similarity reaches graft_threshold; else unassisted) and decide by "
    "plurality of the samples' answers and that answer, a tie going to it, then to the answer given first"
)

Mode = Literal["vote", "flywheel"]


def sample_of(sampling: Sampling, doc_id: int, j: int, k: int) -> Sampling:
    """The sampling of sample ``j`` of problem ``doc_id``: ``sampling.offset(doc_id * k + j)``."""
    return sampling.offset(doc_id * k + j)


def _finished(decoded_stop: str) -> bool:
    # The base prompt's own rule is stop_after_boxed: "stop" is a closed answer box, "eos" the model's end.
    return decoded_stop in ("eos", "stop")


def _answer(dataset: Dataset, d: _Done) -> str | None:
    return extract_answer(dataset.kind, d.output) if _finished(d.stopped_by) else None


def samples_journal_identity(model: AnyModel, profile: DeterminismProfile, dataset: Dataset, doc_ids: Sequence[int], k: int,
                             sampling: Sampling, max_new_tokens: int, batch: int) -> dict[str, object]:
    """The identity of a samples journal: what it holds is decided by these alone."""
    return {
        "model": model.ref.model_dump(mode="json"), "profile": profile.model_dump(mode="json"), "dataset": dataset.digest,
        "doc_ids": [d * k + j for d in doc_ids for j in range(k)],
        "settings": {"what": "samples", "k": k, "temperature": sampling.temperature, "top_p": sampling.top_p,
                     "sample_seed": sampling.seed, "max_new_tokens": max_new_tokens, "batch": batch,
                     "instruction_sha256": hex_of(sha256_bytes(INSTRUCTION.encode("utf-8")))},
    }


@dataclass(frozen=True)
class _Job:
    key: int
    prompt: str
    job: DecodeJob
    entry: str | None


def _decode_into(model: AnyModel, profile: DeterminismProfile, journal: _Journal, jobs: list[_Job], batch: int,
                 on_done: Callable[[_Done], None] | None) -> None:
    """Decode ``jobs`` not yet in ``journal`` (``batch`` per forward pass), journaling each as it ends."""
    meter = EnergyMeter(model.parameter_count)
    todo = [j for j in jobs if j.key not in journal.done]
    if not todo:
        return
    clock = [time.perf_counter()]
    meter.start()

    def finish(i: int, decoded: Decoded) -> None:
        now = time.perf_counter()
        j = todo[i]
        joules, method = meter.stop(len(j.job.suffix_ids) + len(decoded.tokens))
        meter.start()
        done = _Done(doc_id=j.key, prompt=j.prompt, output=decoded.text, prompt_tokens=len(j.job.suffix_ids),
                     decode_tokens=len(decoded.tokens), entry=j.entry, stopped_by=decoded.stopped_by,
                     seconds=round(now - clock[0], 6), joules=joules, energy_method=method)
        clock[0] = now
        journal.add(done)
        if on_done is not None:
            on_done(done)

    def source() -> Iterator[DecodeJob]:
        for j in todo:
            yield j.job

    decode_batch(model, profile, source(), batch=batch, on_done=finish)


def run_samples(model: AnyModel, profile: DeterminismProfile, dataset: Dataset, doc_ids: Sequence[int], journal_file: Path, *,
                k: int, sampling: Sampling, max_new_tokens: int, batch: int,
                on_sample: Callable[[int, int], None] | None = None) -> dict[int, list[_Done]]:
    """The ``k`` samples of each of ``doc_ids``, decoded (or read back) through ``journal_file``:
    doc id -> its samples in order. A stopped run resumes from the journal."""
    if k < 1:
        raise EvaluationError(f"k {k} is not positive", hint="sample at least one answer per problem")
    if sampling.greedy:
        raise EvaluationError("k samples at temperature 0 are k copies of the greedy answer",
                              hint="sample at a temperature above 0 with a seed")
    journal = _Journal(journal_file, samples_journal_identity(model, profile, dataset, doc_ids, k, sampling, max_new_tokens, batch))
    total = len(doc_ids) * k
    try:
        jobs = []
        for d in doc_ids:
            prompt = INSTRUCTION + question_text(dataset.question(d))
            ids = model.tokenizer.encode(prompt, first=True)
            for j in range(k):
                job = DecodeJob(None, ids, max_new_tokens, keep_eos=False, stop=stop_after_boxed,
                                sampling=sample_of(sampling, d, j, k))
                jobs.append(_Job(d * k + j, prompt, job, None))
        _decode_into(model, profile, journal, jobs, batch,
                     None if on_sample is None else lambda _: on_sample(len(journal.done), total))
    finally:
        journal.close()
    return {d: [journal.done[d * k + j] for j in range(k)] for d in doc_ids}


def run_voted_eval(
    model: AnyModel,
    profile: DeterminismProfile,
    dataset_path: Path,
    out: Path,
    *,
    key: Path,
    mode: Mode,
    k: int,
    sampling: Sampling,
    samples_journal: Path,
    max_new_tokens: int = 256,
    limit: int | None = None,
    seed: int | None = None,
    doc_ids: Sequence[int] | None = None,
    batch: int = 1,
    library: Library | None = None,
    passphrase: bytes | None = None,
    design: DesignRef | None = None,
    on_item: Callable[[int, int, EvaluationItem], None] | None = None,
    on_sample: Callable[[int, int], None] | None = None,
) -> EvalRun:
    """Answer the problems by ``mode`` (module docstring) and write the signed evaluation record.

    ``samples_journal`` keeps the samples (shared by the arms that draw the same ones, kept
    after the record is written); the flywheel's grafted answers are journaled in
    ``journal_path(out)``, removed once the record is written. The record's settings hold
    ``mode``, ``k``, the sampling, the budget, and for the flywheel ``graft_threshold``, the
    library's prefix and entry count, and how many problems were ``unanimous`` and ``grafted``.
    """
    if max_new_tokens < 1:
        raise EvaluationError(f"max_new_tokens {max_new_tokens} is not positive", hint="e.g. 512")
    if batch < 1:
        raise EvaluationError(f"batch {batch} is not positive", hint="e.g. 16")
    if mode == "flywheel" and library is None:
        raise EvaluationError("the flywheel grafts verified entries where its samples disagree, but no library was given",
                              hint="build the library from the train split first (scripts/capability_v2.py --only library)")
    if mode == "vote" and library is not None:
        raise EvaluationError("self-consistency asks no library", hint="leave the library out, or use mode flywheel")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise EvaluationError(f"{out} already exists and is not an empty directory", hint="choose a new out directory")
    dataset = load_dataset(dataset_path)
    if library is not None and library.meta["kind"] != dataset.kind:
        raise EvaluationError(f"{dataset.name} is a {dataset.kind} dataset; the library holds {library.meta['kind']} problems",
                              hint="use a library of the same kind of problems")
    chosen = _chosen(dataset, doc_ids, limit, seed)
    if doc_ids is not None:
        limit, seed = len(chosen), None
    samples = run_samples(model, profile, dataset, chosen, samples_journal, k=k, sampling=sampling,
                          max_new_tokens=max_new_tokens, batch=batch, on_sample=on_sample)
    answers = {d: [_answer(dataset, s) for s in samples[d]] for d in chosen}
    unanimous = {d for d in chosen if answers[d][0] is not None and answers[d].count(answers[d][0]) == k}
    settings: dict[str, str | int | float | bool | None] = {
        "mode": mode, "k": k, "max_new_tokens": max_new_tokens, "limit": limit, "seed": seed, "batch": batch,
        "instruction_sha256": hex_of(sha256_bytes(INSTRUCTION.encode("utf-8"))),
        "temperature": sampling.temperature, "top_p": sampling.top_p, "sample_seed": sampling.seed,
        "decision_rule": VOTE_RULE if mode == "vote" else FLYWHEEL_RULE, "unanimous": len(unanimous),
    }
    grafted: dict[int, _Done] = {}
    if mode == "flywheel" and library is not None:
        settings.update({"graft_threshold": library.graft_threshold, "library_prefix": library.meta["prefix_artifact"],
                         "library_entries": len(library.entries)})
        split = [d for d in chosen if d not in unanimous]
        journal = _Journal(journal_path(out), {
            "model": model.ref.model_dump(mode="json"), "profile": profile.model_dump(mode="json"),
            "dataset": dataset.digest, "doc_ids": split, "settings": {**settings, "what": "grafted"},
        })
        try:
            jobs = []
            for d in split:
                question = dataset.question(d)
                plan = library.plan(question, library.lookup(question), max_new_tokens=max_new_tokens)
                jobs.append(_Job(d, plan.prompt, plan.job(sampling=GREEDY), plan.hit.entry.artifact if plan.hit else None))
            _decode_into(model, profile, journal, jobs, batch, None)
            grafted = dict(journal.done)
        finally:
            journal.close()
        settings["grafted"] = sum(1 for g in grafted.values() if g.entry is not None)
    done: list[_Done] = []
    for n, d in enumerate(chosen):
        runs = samples[d]
        g = grafted.get(d)
        g_answer = _answer(dataset, g) if g is not None else None
        decision = decide(answers[d], g_answer)
        texts = [s.output if _finished(s.stopped_by) else None for s in runs]
        g_text = g.output if g is not None and _finished(g.stopped_by) else None
        every = [*runs, *([g] if g is not None else [])]
        cut = decision is None and any(not _finished(x.stopped_by) for x in every)
        item = _Done(
            doc_id=d, prompt=runs[0].prompt, output=compose(texts, g_text, decision),
            prompt_tokens=sum(x.prompt_tokens for x in every), decode_tokens=sum(x.decode_tokens for x in every),
            entry=g.entry if g is not None else None, stopped_by="max_new_tokens" if cut else "eos",
            seconds=round(sum(x.seconds for x in every), 6), joules=sum(x.joules for x in every),
            energy_method="measured" if all(x.energy_method == "measured" for x in every) else "estimated",
        )
        done.append(item)
        if on_item is not None:
            on_item(n, len(chosen), _item(dataset, item))
    run = _write_evaluation(model, profile, dataset, done, settings, out, key=key, passphrase=passphrase, design=design)
    journal_path(out).unlink(missing_ok=True)
    return run
