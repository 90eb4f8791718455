"""Re-check that an evaluation record is an arm of a pre-registered design, run as designed and
logged after it (issue 39; docs/flywheel.md, "The capability experiment").

A design is a pre-registration whose predicate holds ``design`` (no expected outputs); an arm's
evaluation record names it by envelope digest and arm name (``design``). Checked here, offline:

- the design's signature, and that it is a design;
- the record names this design (envelope digest) and one of its arms;
- the record's model, profile name and dataset digest are the design's;
- its items are the design's test doc ids, in order;
- every setting the arm registers is the record's, with the same value;
- a voted arm's (``mode`` ``vote`` or ``flywheel``) every decision is the rule's over the
  answers its output lists (``decide`` over ``[sample]`` / ``[grafted]`` segments);
- both are proven in the log at one signed checkpoint, the design at a smaller index.

The voted output format and decision rule live here, the one place: the engine writes outputs
with ``compose`` and decides with ``decide``.

Each failure raises ``ClaimMismatchError`` (or ``LogProofError``) naming the departure.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kvgraft.schemas import LOG_PROOF_FILE, DesignArm, ExperimentDesign, sha256_bytes

from .errors import ClaimMismatchError, MalformedInputError
from .evaluation import VerifiedEvaluation, read_outputs
from .grading import Dataset, extract_answer
from .keys import TrustedKeys
from .replay import VerifiedPreRegistration, verify_log_proof, verify_pre_registration
from .tlog import Checkpoint

#: A voted output's segments: each finished decode after one of these lines, then the decision.
SAMPLE_HEAD, GRAFTED_HEAD, DECISION_HEAD = "[sample]\n", "[grafted]\n", "[decision] "
#: What a problem's output says when no finished decode gave an answer (no digits: nothing to extract).
NO_DECISION = DECISION_HEAD + "none: no finished decode gave an answer"
_SEPARATOR = "\n\n"


def decide(answers: Sequence[str | None], grafted: str | None = None) -> str | None:
    """The decision of ``answers`` (the samples', in order; None for no answer) and ``grafted``
    (the flywheel's grafted answer, or None): plurality, a tie going to ``grafted``, then to the
    answer given first."""
    given = [a for a in answers if a is not None] + ([grafted] if grafted is not None else [])
    if not given:
        return None
    counts = Counter(given)
    top = max(counts.values())
    if grafted is not None and counts[grafted] == top:
        return grafted
    return next(a for a in given if counts[a] == top)


def compose(samples: Sequence[str | None], grafted: str | None, decision: str | None) -> str:
    """A voted problem's output text: each finished decode's text after ``[sample]`` /
    ``[grafted]`` (None: cut off, left out), then ``[decision] #### ANSWER`` or ``NO_DECISION``."""
    parts = [SAMPLE_HEAD + text for text in samples if text is not None]
    if grafted is not None:
        parts.append(GRAFTED_HEAD + grafted)
    parts.append(f"{DECISION_HEAD}#### {decision}" if decision is not None else NO_DECISION)
    return _SEPARATOR.join(parts)


def _redecide(kind: str, output: str, where: str) -> tuple[str | None, str | None]:
    """(the decision ``output`` states, the rule's decision over the answers it lists)."""
    cut = output.rfind(_SEPARATOR + DECISION_HEAD)
    body, last = (output[:cut], output[cut + len(_SEPARATOR):]) if cut != -1 else ("", output)
    if not last.startswith(DECISION_HEAD):
        raise ClaimMismatchError(f"{where}: the output does not end with a {DECISION_HEAD.strip()} line")
    stated = None if last == NO_DECISION else last.removeprefix(DECISION_HEAD + "#### ")
    samples: list[str | None] = []
    grafted: str | None = None
    segments = body.split(_SEPARATOR + SAMPLE_HEAD) if body else []
    if segments:
        if not segments[0].startswith(SAMPLE_HEAD) and not segments[0].startswith(GRAFTED_HEAD):
            raise ClaimMismatchError(f"{where}: the output's first segment is neither a sample nor a grafted answer")
        segments[0] = segments[0].removeprefix(SAMPLE_HEAD)
    head_is_grafted = body.startswith(GRAFTED_HEAD)
    for n, segment in enumerate(segments):
        text, _, graft = segment.partition(_SEPARATOR + GRAFTED_HEAD)
        if n == 0 and head_is_grafted:
            text, graft = "", segment.removeprefix(GRAFTED_HEAD)
        else:
            samples.append(extract_answer(kind, text))
        if graft:
            grafted = extract_answer(kind, graft)
    return stated, decide(samples, grafted)


def verify_decisions(record_dir: Path, evaluation: VerifiedEvaluation, dataset: Dataset) -> None:
    """Every decision of a voted record is ``decide``'s over the answers its output lists."""
    _, lines = read_outputs(record_dir / "outputs.jsonl", "outputs file")
    for line in lines:
        where = f"doc {line.doc_id}"
        stated, recomputed = _redecide(dataset.kind, line.output, where)
        if stated != recomputed:
            raise ClaimMismatchError(f"{where}: the decision is {stated!r}, but the rule decides {recomputed!r} from "
                                     "the answers the output lists")


@dataclass(frozen=True)
class VerifiedDesign:
    """A verified design: the pre-registration, its design, and its proven log index."""

    pre_registration: VerifiedPreRegistration
    design: ExperimentDesign
    log_index: int


@dataclass(frozen=True)
class ConformingArm:
    """An evaluation record verified to follow its design: the arm, and both log indexes."""

    design: VerifiedDesign
    arm: DesignArm
    log_index: int


def verify_design(directory: Path, trusted: TrustedKeys, checkpoint: Checkpoint) -> VerifiedDesign:
    """Verify a design's directory: a signed pre-registration holding a design, proven in the log."""
    prereg = verify_pre_registration(directory, trusted)
    design = prereg.statement.predicate.design
    if design is None:
        raise MalformedInputError(f"{directory} is the pre-registration of a replay, not an experiment's design",
                                  hint="pass the design directory the experiment's arms name (--design)")
    index = verify_log_proof(prereg.envelope_bytes, directory / LOG_PROOF_FILE, checkpoint, what="the design")
    return VerifiedDesign(prereg, design, index)


def _show(value: object) -> str:
    return "absent" if value is _ABSENT else repr(value)


_ABSENT = object()


def verify_follows_design(record_dir: Path, evaluation: VerifiedEvaluation, design_dir: Path, trusted: TrustedKeys,
                          checkpoint: Checkpoint) -> ConformingArm:
    """Verify that the (already verified) evaluation in ``record_dir`` is an arm of the design in
    ``design_dir``, follows it, and was logged after it (module docstring)."""
    verified = verify_design(design_dir, trusted, checkpoint)
    design, pre = verified.design, verified.pre_registration.statement.predicate
    p = evaluation.statement.predicate
    ref = p.design
    digest = sha256_bytes(verified.pre_registration.envelope_bytes)
    if ref is None:
        raise ClaimMismatchError(f"the evaluation in {record_dir} names no design; it is not an arm of {design_dir}",
                                 hint="an arm's record names its design (evaluations run by the experiment's runner do)")
    if ref.envelope_digest != digest:
        raise ClaimMismatchError(f"the evaluation is an arm of design {ref.envelope_digest}, but {design_dir} is design {digest}",
                                 hint="pass the design the record names")
    arms = {a.name: a for a in design.arms}
    arm = arms.get(ref.arm)
    if arm is None:
        raise ClaimMismatchError(f"the evaluation says it is arm {ref.arm!r}, which the design does not register "
                                 f"(its arms: {', '.join(arms)})")
    where = f"arm {arm.name!r} departs from its design"
    if p.model != pre.model:
        raise ClaimMismatchError(f"{where}: model {p.model.name} ({p.model.weights_digest}), the design registers "
                                 f"{pre.model.name} ({pre.model.weights_digest})")
    if p.profile.name != pre.profile.name:
        raise ClaimMismatchError(f"{where}: profile {p.profile.name}, the design registers {pre.profile.name}")
    if p.dataset.digest != design.test.digest:
        raise ClaimMismatchError(f"{where}: dataset {p.dataset.name} ({p.dataset.digest}), the design's test split is "
                                 f"{design.test.name} ({design.test.digest})")
    got = [i.doc_id for i in p.items]
    if got != design.test.doc_ids:
        missing = [d for d in design.test.doc_ids if d not in set(got)]
        extra = [d for d in got if d not in set(design.test.doc_ids)]
        detail = (f"{len(missing)} registered problems missing (first {missing[:5]})" if missing else
                  f"{len(extra)} problems not registered (first {extra[:5]})" if extra else "in another order")
        raise ClaimMismatchError(f"{where}: its {len(got)} items are not the design's {len(design.test.doc_ids)} test problems: {detail}")
    for name, value in arm.settings.items():
        claimed = p.settings.get(name, _ABSENT)
        # bool is an int in Python: a registered 1 is not a recorded True.
        if claimed is _ABSENT or type(claimed) is not type(value) or claimed != value:
            raise ClaimMismatchError(f"{where}: setting {name} is {_show(claimed)}, the design registers {value!r}")
    if p.settings.get("mode") in ("vote", "flywheel"):
        verify_decisions(record_dir, evaluation, evaluation.dataset)
    index = verify_log_proof(evaluation.envelope_bytes, record_dir / LOG_PROOF_FILE, checkpoint, what="the evaluation record")
    if not verified.log_index < index:
        raise ClaimMismatchError(
            f"the evaluation was logged before its design: the record is at log index {index}, the design at {verified.log_index}",
            hint="an arm counts only when its design was logged first",
        )
    return ConformingArm(verified, arm, index)
