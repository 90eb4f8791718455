"""Re-check a pre-registered replay offline: both records, their log order, and the outputs.

A pre-registration is logged before its replay runs and names the output hashes the replay
must reproduce; the replay record points back at it by envelope digest and log index. Both
envelopes are proven in the registry's log against one signed checkpoint, so the order is
the log's, not the producer's say-so. Layouts and checks: docs/records.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvgraft.schemas import (
    EXPECTED_OUTPUTS_FILE,
    LOG_PROOF_FILE,
    OUTPUTS_FILE,
    RECORD_FILE,
    PreRegistrationStatement,
    ReplayStatement,
    Sha256Hex,
    Statement,
    sha256_bytes,
)

from .dsse import parse_envelope, verify_statement_envelope
from .errors import ClaimMismatchError, LogProofError, MalformedInputError
from .evaluation import MAX_ENVELOPE_BYTES, OutputLine, output_hash, read_outputs
from .files import read_input
from .keys import TrustedKeys, load_public_key, require_ed25519
from .subjects import verify_subjects
from .tlog import Checkpoint, hash_leaf, verify_checkpoint, verify_inclusion
from .tlog_cli import INCLUSION_KEYS, about_file, proof_object, read_checkpoint, unverified_origin


def load_checkpoint(checkpoint: Path, registry_key: Path) -> Checkpoint:
    """Read and verify a registry's signed checkpoint (signed under its own origin)."""
    key = require_ed25519(load_public_key(registry_key), f"the registry key {registry_key}")
    note = read_checkpoint(checkpoint, "checkpoint")
    with about_file("checkpoint", checkpoint):
        return verify_checkpoint(note, unverified_origin(note), key)


def verify_log_proof(entry: bytes, proof_path: Path, checkpoint: Checkpoint, *, what: str) -> int:
    """Verify that ``entry`` (envelope bytes as stored) is in the log at ``checkpoint``, using the
    inclusion PROOF file at ``proof_path``; return its log index.

    Raises ``LogProofError`` when the proof is missing or does not verify.
    """
    if not proof_path.exists():
        raise LogProofError(
            f"{what} has no inclusion proof ({proof_path} is missing)",
            hint="fetch the entry's inclusion proof for this checkpoint from the registry",
        )
    proof = proof_object(proof_path, "inclusion", INCLUSION_KEYS)
    if proof["tree_size"] != checkpoint.size:
        raise LogProofError(
            f"the inclusion proof of {what} is for a tree of size {proof['tree_size']}, "
            f"but the checkpoint is at size {checkpoint.size}",
            hint="fetch the inclusion proof for this checkpoint's tree size",
        )
    try:
        verify_inclusion(hash_leaf(entry), proof["log_index"], checkpoint.size, proof["hashes"], checkpoint.root_hash)
    except LogProofError as e:
        raise LogProofError(f"{what}: {e.message}", hint=e.hint) from e
    index: int = proof["log_index"]
    return index


def _signed_record(directory: Path, trusted: TrustedKeys, what: str) -> tuple[bytes, Statement, tuple[str, ...]]:
    record = directory / RECORD_FILE
    data = read_input(record, what, limit=MAX_ENVELOPE_BYTES)
    verified, statement = verify_statement_envelope(parse_envelope(data, source=f"{what} {record}"), trusted)
    return data, statement, tuple(k.name for k in verified.signers)


def _only_subject(statement: Statement, name: str, what: str) -> None:
    names = [s.name for s in statement.subject]
    if names != [name]:
        raise ClaimMismatchError(f"the {what}'s subjects are {names}; its only subject is {name}")


def _hashes_of(lines: list[OutputLine], what: str) -> dict[str, Sha256Hex]:
    hashes: dict[str, Sha256Hex] = {}
    for line in lines:
        key = str(line.doc_id)
        if key in hashes:
            raise MalformedInputError(f"{what} lists doc {line.doc_id} twice")
        hashes[key] = output_hash(line.output)
    return hashes


def _compare_hashes(claimed: dict[str, Sha256Hex], recomputed: dict[str, Sha256Hex], field: str, source: str) -> None:
    for doc in sorted(set(claimed) | set(recomputed), key=lambda d: (len(d), d)):
        if doc not in recomputed:
            raise ClaimMismatchError(f"{field} lists doc {doc}, which {source} does not hold")
        if doc not in claimed:
            raise ClaimMismatchError(f"{field} omits doc {doc}, which {source} holds")
        if claimed[doc] != recomputed[doc]:
            raise ClaimMismatchError(f"doc {doc}: {field} claimed {claimed[doc]}, recomputed {recomputed[doc]} from {source}")


@dataclass(frozen=True)
class VerifiedPreRegistration:
    """A verified pre-registration: its statement, envelope bytes (as logged) and signers."""

    statement: PreRegistrationStatement
    envelope_bytes: bytes
    signers: tuple[str, ...]


def verify_pre_registration(directory: Path, trusted: TrustedKeys) -> VerifiedPreRegistration:
    """Verify a pre-registration directory: signature, its expected-outputs file, and that the
    expected output hashes are those of that file. The log proof is checked by the caller."""
    data, statement, signers = _signed_record(directory, trusted, "pre-registration")
    if not isinstance(statement, PreRegistrationStatement):
        raise MalformedInputError(f"{directory / RECORD_FILE} is a {statement.predicate_type} statement, not a pre-registration")
    _only_subject(statement, EXPECTED_OUTPUTS_FILE, "pre-registration")
    verify_subjects(statement, directory, exclude=[directory / RECORD_FILE, directory / LOG_PROOF_FILE])
    raw, lines = read_outputs(directory / EXPECTED_OUTPUTS_FILE, "expected-outputs file")
    p = statement.predicate
    got = sha256_bytes(raw)
    if got != p.expected_outputs_digest:
        raise ClaimMismatchError(f"expected_outputs_digest claimed {p.expected_outputs_digest}, but {EXPECTED_OUTPUTS_FILE} has digest {got}")
    _compare_hashes(p.expected_output_hashes, _hashes_of(lines, EXPECTED_OUTPUTS_FILE), "expected_output_hashes", EXPECTED_OUTPUTS_FILE)
    return VerifiedPreRegistration(statement, data, signers)


@dataclass(frozen=True)
class VerifiedReplay:
    """A verified replay and its pre-registration, with both proven log indexes."""

    statement: ReplayStatement
    pre_registration: VerifiedPreRegistration
    signers: tuple[str, ...]
    envelope_bytes: bytes
    pre_registration_log_index: int
    log_index: int
    outputs: int

    @property
    def reproduced(self) -> bool:
        """Whether the replay reproduced every pre-registered output (verified, not claimed)."""
        return self.statement.predicate.reproduced


def verify_replay(replay_dir: Path, prereg_dir: Path, trusted: TrustedKeys, checkpoint: Checkpoint) -> VerifiedReplay:
    """Verify a replay directory against its pre-registration and the log at ``checkpoint``.

    Both envelopes must be proven in the log (``log.json`` in each directory), the
    pre-registration at a smaller index than the replay and at the index the replay names;
    the replay's output hashes are recomputed and ``reproduced`` re-decided. Raises
    ``ClaimMismatchError`` or ``LogProofError`` naming what differs.
    """
    prereg = verify_pre_registration(prereg_dir, trusted)
    data, statement, signers = _signed_record(replay_dir, trusted, "replay record")
    if not isinstance(statement, ReplayStatement):
        raise MalformedInputError(f"{replay_dir / RECORD_FILE} is a {statement.predicate_type} statement, not a replay record")
    p = statement.predicate
    _only_subject(statement, OUTPUTS_FILE, "replay record")
    verify_subjects(statement, replay_dir, exclude=[replay_dir / RECORD_FILE, replay_dir / LOG_PROOF_FILE])
    raw, lines = read_outputs(replay_dir / OUTPUTS_FILE, "replay outputs file")
    got = sha256_bytes(raw)
    if got != p.outputs_digest:
        raise ClaimMismatchError(f"outputs_digest claimed {p.outputs_digest}, but {OUTPUTS_FILE} has digest {got}")

    prereg_digest = sha256_bytes(prereg.envelope_bytes)
    if p.pre_registration.envelope_digest != prereg_digest:
        raise ClaimMismatchError(
            f"the replay answers to pre-registration {p.pre_registration.envelope_digest}, "
            f"but the pre-registration given has envelope digest {prereg_digest}",
            hint="pass the pre-registration this replay names",
        )
    prereg_index = verify_log_proof(prereg.envelope_bytes, prereg_dir / LOG_PROOF_FILE, checkpoint, what="the pre-registration")
    replay_index = verify_log_proof(data, replay_dir / LOG_PROOF_FILE, checkpoint, what="the replay record")
    if not prereg_index < replay_index:
        raise ClaimMismatchError(
            f"replay logged before its pre-registration: the replay is at log index {replay_index}, "
            f"the pre-registration at {prereg_index}",
            hint="a replay counts only when its pre-registration was logged first",
        )
    if p.pre_registration.log_index != prereg_index:
        raise ClaimMismatchError(
            f"pre_registration.log_index claimed {p.pre_registration.log_index}, but the pre-registration is proven at log index {prereg_index}"
        )
    recomputed = _hashes_of(lines, OUTPUTS_FILE)
    _compare_hashes(p.output_hashes, recomputed, "output_hashes", OUTPUTS_FILE)
    reproduced = recomputed == dict(prereg.statement.predicate.expected_output_hashes)
    if p.reproduced != reproduced:
        raise ClaimMismatchError(
            f"reproduced claimed {str(p.reproduced).lower()}, recomputed {str(reproduced).lower()}: "
            f"{_difference(recomputed, dict(prereg.statement.predicate.expected_output_hashes))}"
        )
    return VerifiedReplay(statement, prereg, signers, data, prereg_index, replay_index, len(lines))


def _difference(got: dict[str, Sha256Hex], expected: dict[str, Sha256Hex]) -> str:
    if got == expected:
        return "every output hash equals the pre-registered one"
    differing = sorted((d for d in set(got) | set(expected) if got.get(d) != expected.get(d)), key=lambda d: (len(d), d))
    shown = ", ".join(differing[:5]) + (f" and {len(differing) - 5} more" if len(differing) > 5 else "")
    return f"doc(s) {shown} differ from the pre-registered output hashes"
