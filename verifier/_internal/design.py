"""Re-check that an evaluation record is an arm of a pre-registered design, run as designed and
logged after it (issue 39; docs/flywheel.md, "The capability experiment").

A design is a pre-registration whose predicate holds ``design`` (no expected outputs); an arm's
evaluation record names it by envelope digest and arm name (``design``). Checked here, offline:

- the design's signature, and that it is a design;
- the record names this design (envelope digest) and one of its arms;
- the record's model, profile name and dataset digest are the design's;
- its items are the design's test doc ids, in order;
- every setting the arm registers is the record's, with the same value;
- both are proven in the log at one signed checkpoint, the design at a smaller index.

Each failure raises ``ClaimMismatchError`` (or ``LogProofError``) naming the departure.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvgraft.schemas import LOG_PROOF_FILE, DesignArm, ExperimentDesign, sha256_bytes

from .errors import ClaimMismatchError, MalformedInputError
from .evaluation import VerifiedEvaluation
from .keys import TrustedKeys
from .replay import VerifiedPreRegistration, verify_log_proof, verify_pre_registration
from .tlog import Checkpoint


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
    index = verify_log_proof(evaluation.envelope_bytes, record_dir / LOG_PROOF_FILE, checkpoint, what="the evaluation record")
    if not verified.log_index < index:
        raise ClaimMismatchError(
            f"the evaluation was logged before its design: the record is at log index {index}, the design at {verified.log_index}",
            hint="an arm counts only when its design was logged first",
        )
    return ConformingArm(verified, arm, index)
