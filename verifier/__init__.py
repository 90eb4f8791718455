"""kvgraft's offline verifier: signatures, digests and records, with no engine and no torch.

Verification functions return what they proved or raise a subclass of ``VerificationError``;
they never return a bool.
"""

# The record file names and the atomic writer belong to the artifact contract (kvgraft.schemas);
# they are re-exported here because verifier users have always found them here.
from kvgraft.schemas import EXPECTED_OUTPUTS_FILE, LOG_PROOF_FILE, LOGITS_DIR, OUTPUTS_FILE, RECORD_FILE, write_atomic

from ._internal.audit import AuditLine, AuditReport, audit_report
from ._internal.dsse import (
    VerifiedEnvelope,
    b64decode_any,
    envelope_json,
    pae,
    parse_envelope,
    read_envelope,
    sign_envelope,
    sign_statement,
    verify_envelope,
    verify_statement_envelope,
)
from ._internal.errors import (
    BadSignatureError,
    ChainKeyMismatchError,
    ClaimMismatchError,
    DigestMismatchError,
    IdentityMismatchError,
    KeyFileError,
    LogEntryError,
    LogProofError,
    MalformedInputError,
    SubjectMismatchError,
    ThresholdNotMetError,
    TokenDigestMismatchError,
    UnknownKeyError,
    UnsupportedPayloadTypeError,
    UntrustedRootError,
    VerificationError,
)
from ._internal.evaluation import (
    OutputLine,
    VerifiedEvaluation,
    evaluation_aggregates,
    output_hash,
    outputs_file_bytes,
    parse_outputs,
    read_outputs,
    verify_evaluation_record,
)
from ._internal.exactness import (
    LogitsComparison,
    compare_logits,
    logits_file_name,
    read_logits,
    verify_exactness_record,
)
from ._internal.grading import (
    Dataset,
    DatasetKind,
    Grade,
    HarnessHashes,
    extract_answer,
    grade,
    harness_hashes,
    load_dataset,
    normalize_number,
)
from ._internal.keys import (
    KeyId,
    SigningKey,
    TrustedKey,
    TrustedKeys,
    ephemeral_signing_key,
    generate_private_key,
    keyid_of,
    load_private_key,
    load_public_key,
    load_trusted_keys,
    open_signing_key,
    parse_public_key,
    parse_trusted_keys,
    public_key_pem,
    save_private_key,
    save_public_key,
    trusted_key,
)
from ._internal.lineage import ArtifactLineage, verify_artifact_lineage
from ._internal.replay import (
    VerifiedPreRegistration,
    VerifiedReplay,
    load_checkpoint,
    verify_log_proof,
    verify_pre_registration,
    verify_replay,
)
from ._internal.subjects import verify_subjects
from ._internal.tlog import (
    Checkpoint,
    MerkleTree,
    format_vkey,
    hash_leaf,
    merkle_root,
    parse_checkpoint,
    parse_vkey,
    sign_checkpoint,
    verify_checkpoint,
    verify_consistency,
    verify_inclusion,
)
from ._internal.tlog_cli import consistency_proof_document, inclusion_proof_document

__all__ = [
    "BadSignatureError", "Checkpoint", "MerkleTree", "consistency_proof_document", "format_vkey", "hash_leaf", "inclusion_proof_document", "merkle_root", "parse_checkpoint", "parse_vkey", "sign_checkpoint", "verify_checkpoint", "verify_consistency", "verify_inclusion", "ClaimMismatchError", "DigestMismatchError", "IdentityMismatchError", "KeyFileError", "KeyId", "LogEntryError", "LogProofError",
    "MalformedInputError", "SigningKey", "SubjectMismatchError", "ThresholdNotMetError",
    "TrustedKey", "TrustedKeys", "UnknownKeyError", "UnsupportedPayloadTypeError",
    "UntrustedRootError", "VerificationError", "VerifiedEnvelope", "b64decode_any",
    "envelope_json", "ephemeral_signing_key", "generate_private_key", "keyid_of",
    "load_private_key", "load_public_key", "load_trusted_keys", "open_signing_key", "pae",
    "parse_envelope", "parse_public_key", "parse_trusted_keys", "public_key_pem", "read_envelope",
    "save_private_key", "save_public_key", "sign_envelope", "sign_statement", "trusted_key",
    "Dataset", "DatasetKind", "Grade", "HarnessHashes", "extract_answer", "grade", "harness_hashes",
    "load_dataset", "normalize_number",
    "AuditLine", "AuditReport", "audit_report", "EXPECTED_OUTPUTS_FILE", "LOG_PROOF_FILE", "OUTPUTS_FILE", "OutputLine", "VerifiedEvaluation",
    "VerifiedPreRegistration", "VerifiedReplay", "evaluation_aggregates", "load_checkpoint", "output_hash",
    "outputs_file_bytes", "parse_outputs", "read_outputs", "verify_evaluation_record", "verify_log_proof",
    "verify_pre_registration", "verify_replay",
    "ArtifactLineage", "ChainKeyMismatchError", "TokenDigestMismatchError", "verify_artifact_lineage",
    "LOGITS_DIR", "RECORD_FILE", "LogitsComparison", "compare_logits", "logits_file_name", "read_logits", "verify_exactness_record", "verify_envelope", "verify_statement_envelope", "verify_subjects", "write_atomic",
]
