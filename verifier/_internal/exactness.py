"""Re-check an exactness record offline, with numpy only.

A record directory holds ``record.dsse.json`` (the signed exactness statement) and
``logits/<hex>.f32`` files (float32 little-endian, row-major ``[tokens, vocab]``), named by
their own sha256. The verifier checks the signature, that the directory holds exactly the
statement's subjects, every logits file's digest, each sample's equality claim, KL divergence
and argmax agreement recomputed from the bytes, and the summary recounted. KL and argmax are
computed here and the engine calls this same code, so honest claims match to the last bit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvgraft.schemas import LOGITS_DIR, RECORD_FILE, ExactnessSample, ExactnessStatement, Sha256Digest, hex_of

from .dsse import read_envelope, verify_statement_envelope
from .errors import ClaimMismatchError, MalformedInputError
from .keys import TrustedKeys
from .subjects import verify_subjects


def logits_file_name(digest: Sha256Digest) -> str:
    """The record-relative name of the logits file whose bytes have ``digest``."""
    return f"{LOGITS_DIR}/{hex_of(digest)}.f32"


def _log_softmax(x: np.ndarray) -> np.ndarray:
    z = x.astype(np.float64) - x.max(axis=-1, keepdims=True).astype(np.float64)
    out: np.ndarray = z - np.log(np.exp(z).sum(axis=-1, keepdims=True))
    return out


@dataclass(frozen=True)
class LogitsComparison:
    """KL divergence (max over positions of KL(fresh || graft), nats) and argmax agreement."""

    kl_divergence: float
    argmax_agreement: float

    @property
    def argmax_all(self) -> bool:
        """Whether every position's argmax agrees."""
        return self.argmax_agreement == 1.0


def compare_logits(fresh: np.ndarray, graft: np.ndarray) -> LogitsComparison:
    """Compare two ``[tokens, vocab]`` float32 arrays; identical arrays give KL exactly 0."""
    if fresh.shape != graft.shape or fresh.ndim != 2 or fresh.shape[0] == 0:
        raise MalformedInputError(f"logits shapes {fresh.shape} and {graft.shape} cannot be compared")
    lp, lq = _log_softmax(fresh), _log_softmax(graft)
    per_position = (np.exp(lp) * (lp - lq)).sum(axis=-1)
    kl = float(max(0.0, per_position.max()))
    agree = float((fresh.argmax(axis=-1) == graft.argmax(axis=-1)).mean())
    return LogitsComparison(kl, agree)


def read_logits(path: Path, tokens: int, vocab: int) -> np.ndarray:
    """Read a logits file as float32 ``[tokens, vocab]``, refusing a wrong size."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise MalformedInputError(f"cannot read logits file {path}: {e.strerror}") from e
    if len(data) != tokens * vocab * 4:
        raise MalformedInputError(f"logits file {path} has {len(data)} bytes; [{tokens}, {vocab}] float32 needs {tokens * vocab * 4}")
    return np.frombuffer(data, dtype="<f4").reshape(tokens, vocab)


def _check_sample(directory: Path, s: ExactnessSample, vocab: int) -> LogitsComparison:
    if s.logits_files is None:
        raise MalformedInputError(f"sample {s.index} has no logits files to re-check", hint="records must attach logits files")
    if s.logits_files.fresh != s.fresh_logits_sha256 or s.logits_files.graft != s.graft_logits_sha256:
        raise ClaimMismatchError(f"sample {s.index}: the logits files named are not the ones whose digests it claims")
    if s.bitwise_equal != (s.fresh_logits_sha256 == s.graft_logits_sha256):
        raise ClaimMismatchError(f"sample {s.index} claims bitwise_equal={s.bitwise_equal}, but its two logits digests say otherwise")
    fresh = read_logits(directory / logits_file_name(s.fresh_logits_sha256), s.continuation_tokens, vocab)
    graft = read_logits(directory / logits_file_name(s.graft_logits_sha256), s.continuation_tokens, vocab)
    got = compare_logits(fresh, graft)
    if got.kl_divergence != s.kl_divergence and not math.isclose(got.kl_divergence, s.kl_divergence, rel_tol=1e-9, abs_tol=1e-12):
        raise ClaimMismatchError(f"sample {s.index} claims KL {s.kl_divergence!r}; recomputed {got.kl_divergence!r}")
    if got.argmax_agreement != s.argmax_agreement:
        raise ClaimMismatchError(f"sample {s.index} claims argmax agreement {s.argmax_agreement!r}; recomputed {got.argmax_agreement!r}")
    return got


def verify_exactness_record(directory: Path, trusted: TrustedKeys) -> tuple[ExactnessStatement, list[str]]:
    """Verify an exactness record directory; return the statement and the signer names."""
    envelope = read_envelope(directory / RECORD_FILE)
    verified, statement = verify_statement_envelope(envelope, trusted)
    if not isinstance(statement, ExactnessStatement):
        raise MalformedInputError(f"{directory / RECORD_FILE} is a {statement.predicate_type} statement, not an exactness record")
    # Every logits file is a subject: this checks each file's sha256 against the signed statement.
    verify_subjects(statement, directory, exclude=[directory / RECORD_FILE])
    p = statement.predicate
    comparisons = [_check_sample(directory, s, p.vocab_size) for s in p.samples]
    want = {
        "samples": len(p.samples),
        "bitwise_equal": sum(s.bitwise_equal for s in p.samples),
        "argmax_agree_all": sum(c.argmax_all for c in comparisons),
        "max_kl_divergence": max((c.kl_divergence for c in comparisons), default=0.0),
        "mean_argmax_agreement": (sum(c.argmax_agreement for c in comparisons) / len(comparisons)) if comparisons else 0.0,
    }
    for field, value in want.items():
        claimed = getattr(p.summary, field)
        if claimed != value and not (isinstance(value, float) and math.isclose(claimed, value, rel_tol=1e-12, abs_tol=1e-15)):
            raise ClaimMismatchError(f"the summary claims {field} = {claimed!r}; recounted {value!r}")
    if (p.level == "shifted") != (p.shift != 0) or any(s.shift != p.shift for s in p.samples):
        raise ClaimMismatchError(f"the record's level {p.level!r} does not fit its shift {p.shift}")
    if p.level != "shifted" and want["bitwise_equal"] != want["samples"]:
        raise ClaimMismatchError(
            f"the record claims {p.level} exactness but only {want['bitwise_equal']} of {want['samples']} samples are bitwise equal"
        )
    return statement, [k.name for k in verified.signers]
