"""The knowledge library: verified worked solutions stored as KV artifacts, found and grafted.

A library directory::

    LIB/library.json          model, profile, dataset kind, instruction text, prefix artifact digest
    LIB/prefix/               the shared instruction prefix, a root artifact
    LIB/entries/<hash16>/     one artifact per deposited problem, a child of the prefix
    LIB/index.jsonl           one line per entry: problem hash, problem text, answer, artifact digest

Deposit runs each (problem, solution) pair through the model once, after the shared prefix,
and only when the verifier's grader confirms the solution's final answer against the dataset's
key. Ask finds an entry (the normalized problem's sha256 first, then TF-IDF cosine over words),
grafts prefix + entry at their own positions, and decodes only what is missing. Every answer has a
kind (``AnswerKind``):

- ``recalled``: a deposited problem. The model restates the final answer in a few tokens (at
  most ``RECALL_MAX_TOKENS``), and the answer returned is the entry's verified one, whatever it
  restated;
- ``assisted``: a new problem at least ``GRAFT_THRESHOLD`` similar to an entry, whose worked
  solution is grafted as context; the answer is the model's, unverified;
- ``unassisted``: nothing similar enough; the model answers after the instruction alone.

A model's answer is extracted only from a finished decode (EOS, or the solution's own end): a
decode cut off by the budget has none. The store grows without bound on disk; memory holds one
entry's KV at a time plus the index.

Trust: the index only points. Every artifact grafted is verified against trusted keys first,
and an entry is used only when its artifact's signed text (``Problem: P\nSolution: ...\nFinal
answer: \boxed{A}``) states the index line's problem (by normalized sha256), its answer, and,
for an exact hit, the question asked; the entry must be the prefix's child in ``entries/<hash16>``.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import re
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvgraft.schemas import (
    LIBRARY_ENTRIES_DIR,
    LIBRARY_FILE,
    LIBRARY_INDEX_FILE,
    LIBRARY_PREFIX_DIR,
    AnswerKind,
    AnswerMethod,
    DeterminismProfile,
    DocumentError,
    Provenance,
    Sha256Digest,
    canonical_json,
    parse_json,
    sha256_bytes,
)
from kvgraft.verifier import Dataset, TrustedKeys, extract_answer, grade, write_atomic

from .artifacts import LoadedArtifact, load_artifact
from .errors import ContextWindowError, LibraryError, NoTrustedKeysError
from .ops import GREEDY, AnyModel, Decoded, DecodeJob, Sampling, capture, continue_from
from .profiles import PROFILE_ALIASES
from .trust import trust_signer

FORMAT = "kvgraft-library/v1"

INSTRUCTION = (
    "You are a careful mathematician. Each problem below is followed by a worked solution that "
    "ends with its final answer in \\boxed{}.\n\n"
)
#: After a deposited problem's own entry: the model restates the final answer it has in context.
RECALL_SUFFIX = "The final answer to the problem above is \\boxed{"
#: How much a deposited problem's answer may cost at most.
RECALL_MAX_TOKENS = 16
#: The least similarity (``Hit.score``, TF-IDF cosine) at which a similar entry is grafted as
#: context (answer kind ``assisted``); below it the model answers unassisted. Calibrated by
#: scripts/calibrate_graft_threshold.py on paraphrases of deposited problems against unrelated
#: questions (docs/library.md gives the measured precision and recall).
GRAFT_THRESHOLD = 0.66

_WORD = re.compile(r"[a-z0-9]+")
#: Entries scored per similarity lookup (at least; all holders of the rarest shared word).
_CANDIDATES = 256
_CALCULATOR = re.compile(r"<<[^<>]*>>")


def normalize_problem(text: str) -> str:
    """The problem text compared for exact hits: lower case, whitespace collapsed."""
    return " ".join(text.lower().split())


def problem_hash(text: str) -> str:
    """sha256 hex of the normalized problem text."""
    return sha256_bytes(normalize_problem(text).encode("utf-8")).removeprefix("sha256:")


def entry_text(problem: str, solution: str, answer: str) -> str:
    """The text one entry holds: the problem, its worked solution, its boxed final answer."""
    return f"Problem: {problem.strip()}\nSolution: {solution.strip()}\nFinal answer: \\boxed{{{answer}}}\n\n"


_HEAD, _SOLUTION, _FINAL, _TAIL = "Problem: ", "\nSolution: ", "\nFinal answer: \\boxed{", "}\n\n"


def stated_problem(text: str) -> tuple[str, str] | None:
    """``(problem, answer)`` as an entry's text (``entry_text``) states them, or None when the
    text is not an entry's. The problem ends at the first ``\nSolution: `` (deposit refuses a
    problem holding one), the answer is the last ``\boxed{...}``: one reading, never two."""
    if not text.startswith(_HEAD) or _SOLUTION not in text or not text.endswith(_TAIL):
        return None
    final = text.rfind(_FINAL)
    if final < 0:
        return None
    return text[len(_HEAD):text.index(_SOLUTION)], text[final + len(_FINAL):-len(_TAIL)]


def question_text(problem: str) -> str:
    """The text a new problem is asked with, after the instruction (and an entry, if any)."""
    return f"Problem: {problem.strip()}\nSolution: Let's think step by step."


def clean_solution(solution: str) -> str:
    """GSM8K's worked solutions carry calculator annotations ``<<3*4=12>>``; keep the prose."""
    return _CALCULATOR.sub("", solution).strip()


# --- energy -------------------------------------------------------------------------------------

_RAPL = Path("/sys/class/powercap/intel-rapl:0/energy_uj")
#: Joules per FLOP assumed for an estimate: 100 GFLOP/J is far above what a CPU reaches in
#: eager fp32 inference, so estimates are optimistic lower bounds, and said to be estimates.
_JOULES_PER_FLOP = 1e-11


class EnergyMeter:
    """Energy over a span: read from the package's RAPL counter when readable, else estimated
    from FLOPs (2 x parameters per token processed), and labelled as such."""

    def __init__(self, parameters: int) -> None:
        self.parameters = parameters
        self._start: int | None = None

    @staticmethod
    def _read() -> int | None:
        try:
            return int(_RAPL.read_text().strip())
        except (OSError, ValueError):
            return None

    def start(self) -> None:
        """Begin a span."""
        self._start = self._read()

    def stop(self, tokens: int) -> tuple[float, str]:
        """Joules over the span and how they were obtained (``measured`` or ``estimated``)."""
        end = self._read()
        if self._start is not None and end is not None and end >= self._start:
            return (end - self._start) / 1e6, "measured"
        return 2.0 * self.parameters * tokens * _JOULES_PER_FLOP, "estimated"


# --- the index --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Entry:
    """One deposited problem."""

    problem_hash: str
    problem: str
    answer: str
    artifact: Sha256Digest
    directory: str
    tokens: int
    doc_index: int
    dataset: str

    def to_json(self) -> dict[str, Any]:
        """The index line's object."""
        return {
            "problem_hash": self.problem_hash, "problem": self.problem, "answer": self.answer, "artifact": self.artifact,
            "directory": self.directory, "tokens": self.tokens, "doc_index": self.doc_index, "dataset": self.dataset,
        }


#: The JSON type of each field of an index line.
_ENTRY_TYPES: dict[str, type] = {
    "problem_hash": str, "problem": str, "answer": str, "artifact": str, "directory": str,
    "tokens": int, "doc_index": int, "dataset": str,
}
#: The longest index line read (a line holds one problem's text: far below this).
MAX_INDEX_LINE_BYTES = 4 << 20


@dataclass(frozen=True)
class Hit:
    """The entry found for a question and how: ``exact`` (same normalized problem) or ``similar``."""

    entry: Entry
    method: AnswerMethod
    score: float


def grafted_hit(hit: Hit | None, threshold: float) -> Hit | None:
    """The one rule of what is grafted for a lookup's ``hit``: an exact hit (a recall) and an
    entry the caller fixed always; a similar entry only when its score is at least
    ``threshold`` (``GRAFT_THRESHOLD`` unless the library was opened with another); otherwise
    nothing, and the model answers unassisted."""
    if hit is None or hit.method != "similar" or hit.score >= threshold:
        return hit
    return None


def answer_kind(hit: Hit | None) -> AnswerKind:
    """The kind of an answer given with ``hit`` grafted (``grafted_hit``'s result): a recall for an
    exact hit, assisted for any other entry, unassisted for none."""
    if hit is None:
        return "unassisted"
    return "recalled" if hit.method == "exact" else "assisted"


@dataclass
class _TextIndex:
    """TF-IDF over words with an inverted index: a query scores only entries sharing its rarer words."""

    #: word -> the entries holding it (their weights come from ``counts`` when scored).
    postings: dict[str, list[int]] = field(default_factory=dict)
    norms: list[float] = field(default_factory=list)
    df: Counter[str] = field(default_factory=Counter)
    counts: list[Counter[str]] = field(default_factory=list)
    dirty: bool = False

    def add(self, text: str) -> None:
        words = Counter(_WORD.findall(text.lower()))
        self.counts.append(words)
        self.df.update(words.keys())
        self.dirty = True

    def _idf(self, word: str) -> float:
        return math.log((1 + len(self.counts)) / (1 + self.df.get(word, 0))) + 1.0

    def _build(self) -> None:
        self.postings, self.norms = {}, []
        for i, words in enumerate(self.counts):
            weights = {w: c * self._idf(w) for w, c in words.items()}
            self.norms.append(math.sqrt(sum(v * v for v in weights.values())) or 1.0)
            for w in weights:
                self.postings.setdefault(w, []).append(i)
        self.dirty = False

    def best(self, text: str) -> tuple[int, float] | None:
        if self.dirty:
            self._build()
        # Words no entry holds still count in the query's norm: extra words lower the score.
        weights = {w: c * self._idf(w) for w, c in Counter(_WORD.findall(text.lower())).items()}
        qnorm = math.sqrt(sum(v * v for v in weights.values()))
        query = {w: v for w, v in weights.items() if w in self.postings}
        if not query or qnorm == 0:
            return None
        # Candidates come from the rarest query words only: a word most entries hold ("the",
        # "many") would make every lookup a scan of the whole store, and adds little to a score.
        candidates: set[int] = set()
        for w in sorted(query, key=lambda w: (self.df[w], w)):
            if candidates and (len(candidates) >= _CANDIDATES or 2 * self.df[w] > len(self.counts)):
                break
            candidates.update(self.postings[w])

        def score(i: int) -> float:
            words = self.counts[i]
            return sum(qv * words[w] * self._idf(w) for w, qv in query.items() if w in words) / self.norms[i]

        i = max(candidates, key=lambda i: (score(i), -i))
        return i, score(i) / qnorm


class ProblemIndex:
    """The library's similarity rule over any list of problem texts: TF-IDF cosine over words,
    as ``Library.lookup`` scores entries (``best``: the most similar problem and its score,
    0..1; None when no problem shares a word with the query). An experiment uses it to pick
    library entries without depositing a whole dataset."""

    def __init__(self, problems: Sequence[str]) -> None:
        self._index = _TextIndex()
        for problem in problems:
            self._index.add(problem)

    def best(self, query: str) -> tuple[int, float] | None:
        """``(index of the most similar problem, cosine)``, the earlier problem on a tie."""
        return self._index.best(query)


def worked_solution(dataset: Dataset, index: int) -> str | None:
    """The solution a deposit stores for problem ``index`` from the dataset's own worked
    solution (calculator annotations removed, the key's answer stated last), or None when the
    dataset has none for it."""
    solution = dataset.solution(index)
    if solution is None:
        return None
    return clean_solution(solution) + f"\nThe answer is {dataset.reference(index)}."


# --- answers ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Answer:
    """What ``ask`` reports. ``kind`` says what ``answer`` is (``AnswerKind``): for a recall the
    verified answer of the deposited problem (``text`` is then its answer box, ``\\boxed{A}``, not
    the model's decoding); otherwise the model's, unverified, and only when the decode finished
    (``finished``; a decode cut off by the budget or the window has ``answer`` None)."""

    question: str
    kind: AnswerKind
    finished: bool
    answer: str | None
    text: str
    prompt: str
    entry: Sha256Digest | None
    method: AnswerMethod
    score: float
    prompt_tokens: int
    decode_tokens: int
    context_tokens: int
    seconds: float
    energy_joules: float
    energy_method: str
    #: How the grafted artifacts' signatures were checked: ``verified: <signers>`` or ``skipped (...)``.
    signature: str = ""
    #: Why decoding ended (``ops.StopReason``: eos, stop, window, max_new_tokens).
    stopped_by: str = ""
    #: The sampling seed (None: greedy decoding).
    seed: int | None = None

    def provenance(self) -> Provenance:
        """Where the answer came from, as the engine server sends it (the wire's ``kvgraft``
        object); score and seconds rounded to 6 places."""
        return Provenance(
            kind=self.kind, finished=self.finished, stopped_by=self.stopped_by, seed=self.seed, entry=self.entry, method=self.method, signature=self.signature, score=round(self.score, 6),
            prompt_tokens=self.prompt_tokens, decode_tokens=self.decode_tokens, context_tokens=self.context_tokens,
            seconds=round(self.seconds, 6), energy_joules=self.energy_joules, energy_method=self.energy_method,
            answer=self.answer,
        )

    def to_json(self) -> dict[str, Any]:
        """The ``--json`` object: the decoded text and the provenance (the prompt text is left
        out; its length is ``context_tokens``)."""
        return {"text": self.text, **self.provenance().model_dump(mode="json")}


def stop_after_boxed(text: str) -> bool:
    """A solution is complete once its ``\\boxed{...}`` closes or the next problem begins."""
    return bool(re.search(r"\\boxed\{[^{}]*\}", text)) or "\nProblem:" in text


def stop_at_brace(text: str) -> bool:
    """A recalled answer ends at the closing brace."""
    return "}" in text or "\n" in text


def _require_trust(directory: Path, trusted: TrustedKeys | None, insecure_skip_verify: bool) -> None:
    if trusted is None and not insecure_skip_verify:
        raise NoTrustedKeysError(
            f"library {directory}: no trusted keys to check its artifacts' signatures against",
            hint="pass trusted=TrustedKeys (on the command line --trusted-keys FILE or --trust-local-key), "
            "or insecure_skip_verify=True (--insecure-skip-verify) to skip the check",
        )


def parameters_of(model: AnyModel) -> int:
    """The model's parameter count (what an energy estimate counts FLOPs by)."""
    return model.parameter_count


def check_window(model: AnyModel, start: int, ids: list[int]) -> None:
    """Refuse a question that does not fit the model's window after the ``start`` positions
    grafted before it, before anything runs (``ContextWindowError``)."""
    window = model.spec.window
    if start + len(ids) > window:
        raise ContextWindowError(
            f"the question is {len(ids)} tokens; after the {start} grafted before it that is more than "
            f"{model.spec.name}'s window of {window}",
            hint=f"ask a question shorter than {max(window - start, 0)} tokens",
        )


def _stop_rule(own: Callable[[str], bool] | None, extra: Callable[[str], bool] | None,
               head: str) -> Callable[[str], bool] | None:
    """The answer's stop rule: the library's ``own`` rule on the decoded text, OR-ed with the
    caller's ``extra`` on the answer's text (``head`` + decoded)."""
    if own is None and extra is None:
        return None

    def stop(decoded: str) -> bool:
        return (own is not None and own(decoded)) or (extra is not None and extra(head + decoded))

    return stop


@dataclass(frozen=True)
class Plan:
    """What answering one question runs (``Library.plan``), and how its output reads back."""

    question: str
    #: The dataset kind the answer is extracted by.
    kind_of_problems: str
    hit: Hit | None
    artifact: LoadedArtifact
    #: The suffix's tokens, run after the artifact.
    ids: list[int]
    budget: int
    own: Callable[[str], bool]
    #: The answer's text before the decoded tokens (a recall's opening ``\\boxed{``).
    head: str
    #: The whole prompt's text: every grafted artifact's signed text, then the suffix.
    prompt: str
    #: The lookup's best similarity, reported when its entry was not grafted (below the threshold).
    best_score: float = 0.0

    @property
    def kind(self) -> AnswerKind:
        """What the answer will be (``answer_kind``)."""
        return answer_kind(self.hit)

    def job(self, stop: Callable[[str], bool] | None = None, sampling: Sampling = GREEDY) -> DecodeJob:
        """The decoding to run, ``stop`` (on the answer's text) OR-ed with the plan's own rule.
        EOS ends the answer and is not part of it (nor counted in decode_tokens). A recall is
        decoded greedily whatever ``sampling`` says: its answer is the verified one."""
        return DecodeJob(self.artifact, self.ids, self.budget, keep_eos=False, stop=_stop_rule(self.own, stop, self.head),
                         sampling=GREEDY if self.kind == "recalled" else sampling)

    def output(self, decoded: Decoded) -> str:
        """The answer's text: a recall's output is its answer box, the prompt's opening brace
        and the decoded tokens, so that any answer (a number or a word) is extracted from it by
        the same rule."""
        return self.head + decoded.text

    def finished(self, decoded: Decoded) -> bool:
        """Whether ``decoded`` is a whole answer: it ended at the model's EOS or by the plan's own
        rule (a closed answer box, the next problem begun), not by the budget, the window or a
        caller's stop (a stop string, a deadline)."""
        return decoded.stopped_by == "eos" or (decoded.stopped_by == "stop" and self.own(decoded.text))

    def answer(self, decoded: Decoded, *, seconds: float, energy_joules: float, energy_method: str,
               sampling: Sampling = GREEDY) -> Answer:
        """The ``Answer`` of this plan decoded. A recall answers the entry's verified answer (its
        signed text states it; ``Library.load_entry`` checked that against the index), whatever
        the model restated; any other answer is extracted from the decoded text, and only from a
        finished decode."""
        hit = self.hit
        kind = self.kind
        if kind == "recalled" and hit is not None:
            answer: str | None = hit.entry.answer
            text, finished = "\\boxed{" + hit.entry.answer + "}", True
        else:
            text, finished = self.output(decoded), self.finished(decoded)
            answer = extract_answer(self.kind_of_problems, text) if finished else None
        return Answer(
            question=self.question, kind=kind, finished=finished, answer=answer, text=text, prompt=self.prompt,
            entry=hit.entry.artifact if hit else None, method=hit.method if hit else "none",
            score=hit.score if hit else self.best_score,
            prompt_tokens=len(self.ids), decode_tokens=len(decoded.tokens),
            context_tokens=self.artifact.statement.predicate.positions.end + len(self.ids),
            seconds=seconds, energy_joules=energy_joules, energy_method=energy_method,
            signature=self.artifact.signature, stopped_by=decoded.stopped_by,
            seed=None if kind == "recalled" or sampling.greedy else sampling.seed,
        )


#: ``Answer.signature`` of an answer from the model alone: no artifact was grafted, none was checked.
NOTHING_GRAFTED = "none (nothing grafted)"


def lookup_all(libraries: Sequence[Library], question: str) -> tuple[Library, Hit] | None:
    """The entry for ``question`` across ``libraries`` (each for the same model): an exact hit
    in any of them wins (the first library's, in the order given); else the most similar entry
    across all of them, by ``Hit.score`` (each library's TF-IDF cosine, 0..1, so scores compare;
    the earlier library on a tie); None when no library holds an entry sharing a word."""
    best: tuple[Library, Hit] | None = None
    for library in libraries:
        hit = library.lookup(question)
        if hit is None:
            continue
        if hit.method == "exact":
            return library, hit
        if best is None or hit.score > best[1].score:
            best = library, hit
    return best


class Library:
    """A library directory opened for one model and profile. Use ``Library.create`` or ``Library.open``.

    Every artifact it grafts (the prefix, each entry) is verified against ``trusted`` first;
    ``insecure_skip_verify`` is the only way not to, and must be asked for by name. An entry is
    used only when its artifact's signed text states the problem the index and the question
    name (``load_entry``), so an index pointed at another problem's artifact is refused.
    """

    def __init__(self, directory: Path, model: AnyModel, profile: DeterminismProfile, meta: dict[str, Any],
                 entries: list[Entry], trusted: TrustedKeys | None, *, insecure_skip_verify: bool = False,
                 graft_threshold: float = GRAFT_THRESHOLD) -> None:
        _require_trust(directory, trusted, insecure_skip_verify)
        if not 0.0 <= graft_threshold <= 1.0:
            raise LibraryError(f"the graft threshold {graft_threshold} is not a similarity between 0 and 1",
                               hint=f"pass {GRAFT_THRESHOLD} (the calibrated one), 0 to graft the most similar entry always, "
                               "or 1 to graft only exact matches")
        #: The least similarity at which a similar entry is grafted (``grafted_hit``).
        self.graft_threshold = graft_threshold
        self.directory = directory
        self.model = model
        self.profile = profile
        self.meta = meta
        self.entries = entries
        self.trusted = trusted
        self.insecure_skip_verify = insecure_skip_verify
        self._by_hash = {e.problem_hash: i for i, e in enumerate(entries)}
        self._text = _TextIndex()
        for e in entries:
            self._text.add(e.problem)
        self._prefix: LoadedArtifact | None = None
        self._energy = EnergyMeter(parameters_of(model))

    # --- opening ---------------------------------------------------------------------------------

    @classmethod
    def create(cls, directory: Path, model: AnyModel, profile: DeterminismProfile, *, kind: str, key: Path,
               passphrase: bytes | None = None, trusted: TrustedKeys | None = None,
               insecure_skip_verify: bool = False) -> Library:
        """A new library: capture the shared instruction prefix and write ``library.json``.

        The returned library verifies what it grafts against ``trusted``; without it, against
        the key it was created with (the only key that has signed anything in it yet).
        """
        if (directory / LIBRARY_FILE).exists():
            raise LibraryError(f"{directory} already holds a library", hint="deposit into it, or choose a new --library")
        if directory.exists() and any(p.name != ".lock" for p in directory.iterdir()):
            raise LibraryError(f"{directory} exists and is not empty", hint="choose a new --library directory")
        directory.mkdir(parents=True, exist_ok=True)
        prefix = capture(model, profile, INSTRUCTION, directory / LIBRARY_PREFIX_DIR, key=key, passphrase=passphrase)
        meta = {
            "format": FORMAT, "model": model.spec.name, "profile": profile.name, "kind": kind,
            "instruction": INSTRUCTION, "prefix_artifact": prefix.kv_digest,
        }
        write_atomic(directory / LIBRARY_FILE, json.dumps(meta, indent=2).encode() + b"\n", 0o644)
        (directory / LIBRARY_INDEX_FILE).touch()
        if trusted is None and not insecure_skip_verify:
            trusted = trust_signer(key, passphrase, name="library creator")
        return cls(directory, model, profile, meta, [], trusted, insecure_skip_verify=insecure_skip_verify)

    @classmethod
    def open(cls, directory: Path, model: AnyModel, profile: DeterminismProfile, *,
             trusted: TrustedKeys | None = None, insecure_skip_verify: bool = False,
             graft_threshold: float = GRAFT_THRESHOLD) -> Library:
        """Open an existing library for ``model`` and ``profile`` (both must be the library's).

        ``trusted``: the keys every grafted artifact must be signed by. Without them opening is
        refused (``NoTrustedKeysError``) unless ``insecure_skip_verify=True`` says to skip.
        ``graft_threshold``: the least similarity at which a similar entry is grafted.
        """
        meta = read_meta(directory)
        require_library_match(directory, meta, model=model.spec.name, profile=profile.name)
        _require_trust(directory, trusted, insecure_skip_verify)  # before the index is read
        return cls(directory, model, profile, meta, list(read_index(directory)), trusted,
                   insecure_skip_verify=insecure_skip_verify, graft_threshold=graft_threshold)

    # --- deposit ---------------------------------------------------------------------------------

    def prefix(self) -> LoadedArtifact:
        """The shared instruction prefix, loaded and checked once."""
        if self._prefix is None:
            prefix = load_artifact(self.directory / LIBRARY_PREFIX_DIR, self.model, self.profile, trusted=self.trusted,
                                   insecure_skip_verify=self.insecure_skip_verify)
            if prefix.kv_digest != self.meta["prefix_artifact"]:
                raise LibraryError(
                    f"{self.directory / LIBRARY_PREFIX_DIR} holds {prefix.kv_digest}, "
                    f"but {LIBRARY_FILE} names {self.meta['prefix_artifact']}",
                    hint="the library was altered; deposit into a new one",
                )
            signed = prefix.statement.predicate.source_text.text
            if prefix.parent is not None or signed != self.meta["instruction"]:
                raise LibraryError(
                    f"{self.directory / LIBRARY_PREFIX_DIR}: its signed text is not the instruction {LIBRARY_FILE} names",
                    hint="the library was altered; deposit into a new one",
                )
            self._prefix = prefix
        return self._prefix

    def deposit(self, dataset: Dataset, index: int, solution: str, *, key: Path, passphrase: bytes | None = None) -> Entry | None:
        """Deposit problem ``index`` of ``dataset`` with ``solution`` when the grader confirms it.

        Returns the entry (an existing one when the problem is already deposited), or None when
        the solution's final answer is not the dataset's key (nothing is written then).
        """
        if dataset.kind != self.meta["kind"]:
            raise LibraryError(f"{dataset.name} is a {dataset.kind} dataset; this library holds {self.meta['kind']} problems",
                               hint="use one library per kind of problem")
        problem = dataset.question(index)
        phash = problem_hash(problem)
        if phash in self._by_hash:
            return self.entries[self._by_hash[phash]]
        answer = extract_answer(dataset.kind, solution)
        text = entry_text(problem, solution, answer or "")
        if answer is None or not grade(dataset, index, text).correct:
            return None
        if stated_problem(text) != (problem.strip(), answer):
            # ask reads the problem back from the signed text: it must read back as this one.
            raise LibraryError(
                f"problem {index} of {dataset.name} cannot be stored unambiguously: its text or answer holds "
                f"{_SOLUTION.strip()!r} on a new line or braces that end its answer box",
                hint="skip this problem (--limit / a solutions file without it)",
            )
        out = self.directory / LIBRARY_ENTRIES_DIR / phash[:16]
        captured = capture(self.model, self.profile, text, out, key=key, parent=self.prefix(), passphrase=passphrase)
        entry = Entry(phash, problem, answer, captured.kv_digest, f"{LIBRARY_ENTRIES_DIR}/{phash[:16]}",
                      len(captured.statement.predicate.tokens.ids), index, dataset.name)
        with (self.directory / LIBRARY_INDEX_FILE).open("ab") as f:
            f.write(canonical_json(entry.to_json()) + b"\n")
            f.flush()
            os.fsync(f.fileno())
        self._by_hash[phash] = len(self.entries)
        self.entries.append(entry)
        self._text.add(problem)
        return entry

    # --- ask ---------------------------------------------------------------------------------------

    def lookup(self, question: str) -> Hit | None:
        """The entry for ``question``: the same normalized problem, else the most similar one."""
        exact = self._by_hash.get(problem_hash(question))
        if exact is not None:
            return Hit(self.entries[exact], "exact", 1.0)
        best = self._text.best(question)
        if best is None:
            return None
        return Hit(self.entries[best[0]], "similar", best[1])

    def load_entry(self, entry: Entry, question: str | None = None) -> LoadedArtifact:
        """An entry's artifact, checked, on the prefix: signature, digest, that it is the
        prefix's child, and that its signed text states the problem (and answer) the index
        entry names, and, for an exact hit (``question`` given), the question asked."""
        where = f"library {self.directory}: index entry {entry.problem_hash[:16]}"
        if entry.directory != f"{LIBRARY_ENTRIES_DIR}/{entry.problem_hash[:16]}":
            raise LibraryError(f"{where} points at {entry.directory!r}, not at {LIBRARY_ENTRIES_DIR}/{entry.problem_hash[:16]}",
                               hint="the index was altered; re-deposit the problem into a new library")
        if problem_hash(entry.problem) != entry.problem_hash:
            raise LibraryError(f"{where}: its problem text does not hash to its problem_hash",
                               hint="the index was altered; re-deposit the problem into a new library")
        prefix = self.prefix()
        art = load_artifact(self.directory / entry.directory, self.model, self.profile, trusted=self.trusted,
                            insecure_skip_verify=self.insecure_skip_verify, parent=prefix)
        if art.kv_digest != entry.artifact:
            raise LibraryError(f"{entry.directory} holds {art.kv_digest}, but the index names {entry.artifact}",
                               hint="the library was altered; deposit into a new one")
        if art.parent is not prefix:
            raise LibraryError(f"{where}: its artifact is not a child of the library's prefix",
                               hint="the library was altered; re-deposit the problem into a new library")
        source = art.statement.predicate.source_text
        signed_text = source.text or ""
        stated = stated_problem(signed_text)
        if stated is None or sha256_bytes(signed_text.encode("utf-8")) != source.digest:
            raise LibraryError(f"{where}: its artifact's signed text does not state a problem",
                               hint="the entry was not written by 'kvgraft library deposit'; re-deposit the problem")
        signed_hash = problem_hash(stated[0])
        if signed_hash != entry.problem_hash:
            raise LibraryError(
                f"{where} names problem {entry.problem_hash[:16]}, but its artifact {entry.artifact} is signed "
                f"for problem {signed_hash[:16]} ({stated[0][:60]!r})",
                hint="the index was pointed at another problem's artifact; re-deposit the problem into a new library",
            )
        if stated[1] != entry.answer:
            raise LibraryError(f"{where} says the answer is {entry.answer!r}, but its artifact is signed with "
                               f"{stated[1]!r}", hint="the index was altered; re-deposit the problem into a new library")
        if question is not None and problem_hash(question) != signed_hash:
            raise LibraryError(f"{where}: the question asked is not the problem its artifact is signed for",
                               hint="the index was altered; re-deposit the problem into a new library")
        return art

    def ask(self, question: str, *, max_new_tokens: int = 256, use_similar: bool = True,
            stop: Callable[[str], bool] | None = None, sampling: Sampling = GREEDY) -> Answer:
        """Answer ``question`` from the library: recall for a deposited problem (``recalled``), a
        grafted worked example for a new one similar enough (``assisted``), or the instruction
        prefix alone (``unassisted``: no entry at or above ``graft_threshold``).

        ``stop``: called after every decoded token with the answer's text so far (what
        ``Answer.text`` would be: a recall's opening ``\\boxed{`` included); true ends decoding,
        as the library's own rule does (the two are OR-ed). The engine server streams, honours
        stop strings, times out and cancels with it. ``sampling``: greedy by default; a recall
        is always greedy (its answer is the verified one).
        """
        hit = self.lookup(question)
        if hit is not None and hit.method == "similar" and not use_similar:
            hit = None
        return self.answer(question, hit, max_new_tokens=max_new_tokens, stop=stop, sampling=sampling)

    def answer(self, question: str, hit: Hit | None, *, max_new_tokens: int = 256,
               stop: Callable[[str], bool] | None = None, sampling: Sampling = GREEDY) -> Answer:
        """Answer ``question`` with ``hit`` (found by this library's ``lookup``, or None for the
        instruction prefix alone); ``ask`` is ``lookup`` then this. ``stop`` and ``sampling`` as
        for ``ask``."""
        t0 = time.perf_counter()
        self._energy.start()
        plan = self.plan(question, hit, max_new_tokens=max_new_tokens)
        job = plan.job(stop, sampling)
        decoded = continue_from(self.model, self.profile, job.artifact, job.suffix_ids, max_new_tokens=job.max_new_tokens,
                                keep_eos=job.keep_eos, stop=job.stop, sampling=job.sampling)
        joules, method = self._energy.stop(len(plan.ids) + len(decoded.tokens))
        return plan.answer(decoded, seconds=time.perf_counter() - t0, energy_joules=joules, energy_method=method,
                           sampling=job.sampling)

    def plan(self, question: str, hit: Hit | None, *, max_new_tokens: int = 256) -> Plan:
        """What answering ``question`` with ``hit`` runs, before anything runs: the artifact
        grafted (verified and checked against the index here), the suffix after it and its
        stop rule. ``hit`` None: the instruction prefix alone; method ``exact``: a recall;
        any other method (``similar``, or ``fixed`` for an entry the caller chose): the entry
        as a worked example before the question. A similar hit below ``graft_threshold`` is not
        grafted (``grafted_hit``): the instruction prefix alone, its score kept as ``best_score``."""
        best_score = hit.score if hit is not None else 0.0
        hit = grafted_hit(hit, self.graft_threshold)
        if hit is None:
            artifact = self.prefix()
            suffix, budget, own, head = question_text(question), max_new_tokens, stop_after_boxed, ""
        elif hit.method == "exact":
            artifact = self.load_entry(hit.entry, question)
            suffix, budget, own, head = RECALL_SUFFIX, min(RECALL_MAX_TOKENS, max_new_tokens), stop_at_brace, "\\boxed{"
        else:
            artifact = self.load_entry(hit.entry)
            suffix, budget, own, head = question_text(question), max_new_tokens, stop_after_boxed, ""
        ids = self.model.tokenizer.encode(suffix, first=False)
        check_window(self.model, artifact.statement.predicate.positions.end, ids)
        # Every text in the chain is signed and present: prefix() and load_entry() compared them.
        prompt = "".join(a.statement.predicate.source_text.text or "" for a in artifact.chain) + suffix
        return Plan(question=question, kind_of_problems=self.meta["kind"], hit=hit, artifact=artifact, ids=ids, budget=budget,
                    own=own, head=head, prompt=prompt, best_score=best_score)

    @property
    def stored_tokens(self) -> int:
        """Tokens held across all entries (the prefix counted once)."""
        return sum(e.tokens for e in self.entries)


def read_meta(directory: Path) -> dict[str, Any]:
    """``library.json``, checked for the fields a library needs."""
    path = directory / LIBRARY_FILE
    try:
        with path.open("rb") as f:
            raw = f.read(MAX_INDEX_LINE_BYTES + 1)
        if len(raw) > MAX_INDEX_LINE_BYTES:
            raise LibraryError(f"{path} is longer than {MAX_INDEX_LINE_BYTES} bytes; it is not a library file",
                               hint="the library was altered; deposit into a new one")
        meta = parse_json(raw, what=str(path))
    except DocumentError as e:
        raise LibraryError(f"{path} is not valid JSON: {e}", hint="the library was altered; deposit into a new one") from e
    except FileNotFoundError as e:
        raise LibraryError(f"{directory} is not a library (no {LIBRARY_FILE})",
                           hint="create one with 'kvgraft library deposit --library DIR ...'") from e
    except OSError as e:
        raise LibraryError(f"cannot read {path}: {e.strerror}") from e
    needed = {"format", "model", "profile", "kind", "instruction", "prefix_artifact"}
    if not isinstance(meta, dict) or not needed <= set(meta) or meta["format"] != FORMAT:
        raise LibraryError(f"{path} is not a {FORMAT} library file", hint="it was written by another tool or altered")
    return meta


def require_library_match(directory: Path, meta: dict[str, Any], *, model: str | None, profile: str | None) -> None:
    """The one rule of what a library grafts into: its state is ``meta["model"]``'s, made under
    ``meta["profile"]``, and grafts only there (the profile fixes the kernels, so another
    profile's logits would differ from the signed fresh ones).

    ``model`` / ``profile``: what the caller was asked for (a profile alias is resolved; None
    asks for the library's own). Needs only ``library.json`` (``read_meta``), so every caller
    refuses before a model loads. Raises ``LibraryError`` naming the flag to pass.
    """
    if model is not None and meta["model"] != model:
        raise LibraryError(f"the library {directory} holds {meta['model']} state, not {model}",
                           hint=f"pass --model {meta['model']}")
    asked = PROFILE_ALIASES.get(profile, profile) if profile is not None else None
    if asked is not None and asked != meta["profile"]:
        raise LibraryError(f"the library {directory} was deposited under the profile {meta['profile']}, not {asked}",
                           hint=f"pass --profile {meta['profile']} (a library's state grafts only under its own profile)")


def read_index(directory: Path) -> Iterator[Entry]:
    """The entries of the library ``directory``'s index, in deposit order, each line checked for
    an entry's fields and types (``LibraryError`` naming the line where one is not).

    Format: UTF-8 JSON, one object per line, each ending in ``\n``. Lines are split at ``\n``
    only: a problem's text, written raw, may hold U+2028 or U+0085, which ``str.splitlines``
    would split at. A last line without its ``\n`` is a deposit cut off mid-write and does not
    count. Reading the index trusts nothing: ``Library.open`` checks each entry's signed artifact.
    """
    path = directory / LIBRARY_INDEX_FILE
    with contextlib.ExitStack() as stack:
        try:
            f = stack.enter_context(path.open("rb"))
        except OSError as e:
            raise LibraryError(f"cannot read {path}: {e.strerror}") from e
        for n in itertools.count(1):
            # One line at a time, each bounded: a line far longer than any entry is not read whole.
            line = f.readline(MAX_INDEX_LINE_BYTES + 1)
            if len(line) > MAX_INDEX_LINE_BYTES:
                raise LibraryError(f"{path} line {n} is longer than {MAX_INDEX_LINE_BYTES} bytes; it is not a library entry",
                                   hint="the index was altered")
            if not line.endswith(b"\n"):
                # A deposit interrupted mid-line (or the end): the entry's artifact may exist, the line does not count.
                break
            try:
                obj = parse_json(line, what=f"{path} line {n}")
                entry = Entry(**obj)
            except (DocumentError, TypeError) as e:
                raise LibraryError(f"{path} line {n} is not a library entry: {e}", hint="the index was altered") from e
            wrong = [name for name, kind in _ENTRY_TYPES.items()
                     if not isinstance(getattr(entry, name), kind) or isinstance(getattr(entry, name), bool)]
            if wrong:
                raise LibraryError(f"{path} line {n} is not a library entry: {', '.join(wrong)} of the wrong type",
                                   hint="the index was altered")
            yield entry
