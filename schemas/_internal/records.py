"""Records: exactness, evaluation, pre-registration and replay (docs/architecture.md, docs/records.md).

Each is an in-toto statement signed like an artifact; every figure it reports is backed by
digests of its inputs and outputs so that the verifier can recompute it offline.
"""

from __future__ import annotations

from typing import Final, Literal

from pydantic import Field, model_validator

from .digests import DigestField, HexDigestField
from .predicates import DeterminismProfile, ModelRef
from .statement import Contract, Statement

EXACTNESS_PREDICATE: Final = "https://kvgraft.dev/exactness/v1"
EVALUATION_PREDICATE: Final = "https://kvgraft.dev/evaluation/v1"
PRE_REGISTRATION_PREDICATE: Final = "https://kvgraft.dev/pre-registration/v1"
REPLAY_PREDICATE: Final = "https://kvgraft.dev/replay/v1"

#: An arm's name: what an evaluation record's ``design.arm`` says and the summary's key.
ARM_NAME_PATTERN: Final = r"^[a-z][a-z0-9@._-]{0,63}$"
#: The most arms, doc ids and comparisons a design holds (GSM8K test has 1,319 problems).
MAX_DESIGN_ARMS: Final = 16
MAX_DESIGN_DOCS: Final = 100_000

Scalar = str | int | float | bool | None


def _none(value: object) -> bool:
    """Whether an optional field is absent (left out of the JSON then)."""
    return value is None


# --- exactness -----------------------------------------------------------------------------


class DatasetRef(Contract):
    """The dataset file evaluated: name and sha256 of its bytes."""

    name: str
    digest: DigestField




class DesignRef(Contract):
    """The pre-registered design an evaluation is an arm of: the design's envelope digest (its
    ``record.dsse.json`` bytes, as logged) and the arm's name."""

    envelope_digest: DigestField
    arm: str = Field(pattern=ARM_NAME_PATTERN)


class LogitsFiles(Contract):
    """Raw logits attached to a sample, so the verifier recomputes KL and argmax with numpy."""

    fresh: DigestField
    graft: DigestField


class ExactnessSample(Contract):
    """One comparison of a grafted continuation against a fresh computation."""

    index: int = Field(ge=0)
    prefix_artifact: DigestField = Field(description="subject digest of the grafted artifact's tensors")
    prefix_tokens: int = Field(ge=1)
    continuation_digest: DigestField = Field(description="sha256 of the canonical JSON of the continuation's token ids")
    continuation_tokens: int = Field(ge=1)
    fresh_logits_sha256: DigestField = Field(description="sha256 of the fresh logits, float32 LE row-major [tokens, vocab]")
    graft_logits_sha256: DigestField
    bitwise_equal: bool
    kl_divergence: float = Field(ge=0.0, description="max over positions of KL(fresh || graft), in nats, float64")
    argmax_agreement: float = Field(ge=0.0, le=1.0, description="fraction of positions whose argmax agrees")
    shift: int = Field(default=0, description="positions the graft was moved by; non-zero is approximate")
    logits_files: LogitsFiles | None = None


class ExactnessSummary(Contract):
    """Counts over the samples."""

    samples: int = Field(ge=0)
    bitwise_equal: int = Field(ge=0)
    argmax_agree_all: int = Field(ge=0, description="samples whose argmax agrees at every position")
    max_kl_divergence: float = Field(ge=0.0)
    mean_argmax_agreement: float = Field(ge=0.0, le=1.0)


class ExactnessPredicate(Contract):
    """An exactness experiment: fresh vs grafted logits, sample by sample."""

    model: ModelRef
    profile: DeterminismProfile
    level: Literal["own-position", "schedule-invariant", "shifted"]
    shift: int = Field(default=0)
    vocab_size: int = Field(ge=1)
    data_sources: list[DatasetRef] = Field(default_factory=list)
    seed: int
    samples: list[ExactnessSample]
    summary: ExactnessSummary

    @model_validator(mode="after")
    def _counts(self) -> ExactnessPredicate:
        if self.summary.samples != len(self.samples):
            raise ValueError(f"summary counts {self.summary.samples} samples but {len(self.samples)} are listed")
        return self


class ExactnessStatement(Statement):
    """An in-toto statement whose predicate is an exactness record."""

    predicate_type: Literal["https://kvgraft.dev/exactness/v1"] = Field(
        default=EXACTNESS_PREDICATE, alias="predicateType"
    )
    predicate: ExactnessPredicate  # type: ignore[assignment]


# --- evaluation ----------------------------------------------------------------------------


class EvaluationItem(Contract):
    """One graded item; the three harness hashes use lm-evaluation-harness's definitions."""

    doc_id: int = Field(ge=0)
    doc_hash: HexDigestField
    prompt_hash: HexDigestField
    target_hash: HexDigestField
    output_hash: HexDigestField = Field(description="sha256 hex of the UTF-8 output text")
    extracted_answer: str | None
    correct: bool
    prompt_tokens: int = Field(ge=0)
    decode_tokens: int = Field(ge=0)
    library_entry: DigestField | None = Field(default=None, description="artifact grafted for this item")


class EvaluationAggregates(Contract):
    """Aggregates the verifier recomputes from the items."""

    items: int = Field(ge=0)
    correct: int = Field(ge=0)
    accuracy: float = Field(ge=0.0, le=1.0)
    prompt_tokens: int = Field(ge=0)
    decode_tokens: int = Field(ge=0)


class EvaluationPredicate(Contract):
    """An evaluation run: what was asked, what came out, and how it was graded."""

    model: ModelRef
    profile: DeterminismProfile
    dataset: DatasetRef
    settings: dict[str, str | int | float | bool | None] = Field(description="max_new_tokens, limit, prompt template digest, ...")
    items: list[EvaluationItem]
    aggregates: EvaluationAggregates
    outputs_digest: DigestField = Field(description="sha256 of the outputs file")
    library_artifacts: list[DigestField] = Field(default_factory=list)
    # Left out of the JSON when absent: a record of no design is the bytes it always was.
    design: DesignRef | None = Field(default=None, exclude_if=_none)


class EvaluationStatement(Statement):
    """An in-toto statement whose predicate is an evaluation record."""

    predicate_type: Literal["https://kvgraft.dev/evaluation/v1"] = Field(
        default=EVALUATION_PREDICATE, alias="predicateType"
    )
    predicate: EvaluationPredicate  # type: ignore[assignment]


# --- pre-registration and replay -----------------------------------------------------------


class DesignSplit(Contract):
    """A dataset split a design draws from: the file (name, sha256 of its bytes), the doc ids it
    uses, in order, and the rule that drew them (words, for the reader)."""

    name: str
    digest: DigestField
    doc_ids: list[int] = Field(max_length=MAX_DESIGN_DOCS)
    rule: str

    @model_validator(mode="after")
    def _distinct(self) -> DesignSplit:
        if any(i < 0 for i in self.doc_ids) or len(set(self.doc_ids)) != len(self.doc_ids):
            raise ValueError("doc_ids must be distinct non-negative integers")
        return self


class DesignArm(Contract):
    """One arm of a design: its name, what it does (words), and the settings its evaluation
    record must hold (each key with exactly this value: ``kvgraft-verify eval --design`` checks)."""

    name: str = Field(pattern=ARM_NAME_PATTERN)
    description: str
    settings: dict[str, Scalar]


class DesignComparison(Contract):
    """A pre-registered paired comparison: ``second - first`` on the same problems."""

    first: str = Field(pattern=ARM_NAME_PATTERN)
    second: str = Field(pattern=ARM_NAME_PATTERN)
    primary: bool = False


class DesignAnalysis(Contract):
    """The analysis fixed before any test output: the paired test, its level, the comparisons
    and the interval reported for each arm's accuracy."""

    test: Literal["mcnemar-exact-two-sided"]
    alpha: float = Field(gt=0.0, lt=1.0)
    interval: Literal["wilson-95"]
    comparisons: list[DesignComparison] = Field(min_length=1, max_length=MAX_DESIGN_ARMS * MAX_DESIGN_ARMS)


class ExperimentDesign(Contract):
    """An experiment's design, pre-registered (logged) before any test output exists: the
    splits, the arms (paired on ``test.doc_ids``), ``k`` samples per voted problem, the decode
    budget per decode, the decision rule and the analysis. The model, profile and test dataset
    are the pre-registration's own fields."""

    format: Literal["kvgraft-design/v1"] = "kvgraft-design/v1"
    test: DesignSplit
    train: DesignSplit | None = None
    arms: list[DesignArm] = Field(min_length=1, max_length=MAX_DESIGN_ARMS)
    k: int = Field(ge=1, le=64)
    budget: int = Field(ge=1, description="max_new_tokens of every decode")
    decision_rule: str
    analysis: DesignAnalysis

    @model_validator(mode="after")
    def _names(self) -> ExperimentDesign:
        names = [a.name for a in self.arms]
        if len(set(names)) != len(names):
            raise ValueError(f"arm names repeat: {names}")
        for c in self.analysis.comparisons:
            for name in (c.first, c.second):
                if name not in names:
                    raise ValueError(f"comparison names arm {name!r}, which is not among the arms {names}")
        return self


class PreRegistrationPredicate(Contract):
    """What a replay will run and the output digests it must reproduce, logged beforehand; or,
    with ``design``, an experiment's design: its arms' evaluation records name it, and count
    only when logged after it. A design expects no outputs (``expected_output_hashes`` empty)."""

    model: ModelRef
    profile: DeterminismProfile
    dataset: DatasetRef
    command: list[str] = Field(min_length=1, description="the replay's command line")
    settings: dict[str, str | int | float | bool | None]
    expected_output_hashes: dict[str, HexDigestField] = Field(description="doc_id -> output_hash")
    expected_outputs_digest: DigestField
    # Left out of the JSON when absent: a replay's pre-registration is the bytes it always was.
    design: ExperimentDesign | None = Field(default=None, exclude_if=_none)


class PreRegistrationStatement(Statement):
    """An in-toto statement whose predicate is a pre-registration."""

    predicate_type: Literal["https://kvgraft.dev/pre-registration/v1"] = Field(
        default=PRE_REGISTRATION_PREDICATE, alias="predicateType"
    )
    predicate: PreRegistrationPredicate  # type: ignore[assignment]


class PreRegistrationRef(Contract):
    """Where the pre-registration a replay answers to sits in the log."""

    envelope_digest: DigestField
    log_index: int = Field(ge=0)


class ReplayPredicate(Contract):
    """A replay's outcome, pointing at the pre-registration it must reproduce."""

    pre_registration: PreRegistrationRef
    output_hashes: dict[str, HexDigestField]
    outputs_digest: DigestField
    reproduced: bool


class ReplayStatement(Statement):
    """An in-toto statement whose predicate is a replay record."""

    predicate_type: Literal["https://kvgraft.dev/replay/v1"] = Field(
        default=REPLAY_PREDICATE, alias="predicateType"
    )
    predicate: ReplayPredicate  # type: ignore[assignment]
