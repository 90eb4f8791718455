"""kvgraft's data contracts: typed documents, RFC 8785 canonical JSON and digest types.

Nothing here imports torch, the engine or the registry: the standalone verifier depends on it.
Regenerate the JSON Schema files with ``python -m kvgraft.schemas``.
"""

from ._internal.canonical import canonical_json, canonical_model, parse_json
from ._internal.digests import (
    DigestField,
    HexDigestField,
    Sha256Digest,
    Sha256Hex,
    hex_of,
    parse_sha256,
    parse_sha256_hex,
    prefixed,
    sha256_bytes,
    sha256_file,
    sha256_stream,
)
from ._internal.documents import (
    SCHEMA_FILES,
    STATEMENT_MODELS,
    json_schema_text,
    parse_document,
    parse_statement,
    validate_document,
    write_json_schemas,
)
from ._internal.dsse import IN_TOTO_PAYLOAD_TYPE, Envelope, Signature
from ._internal.errors import CanonicalizationError, DocumentError, InvalidDigestError, KvgraftError, SchemaError
from ._internal.predicates import (
    KV_ARTIFACT_PREDICATE,
    DeterminismProfile,
    ExactnessLevel,
    KvArtifactPredicate,
    KvArtifactStatement,
    ModelRef,
    PositionRange,
    SourceText,
    TokenSpan,
)
from ._internal.records import (
    EVALUATION_PREDICATE,
    EXACTNESS_PREDICATE,
    PRE_REGISTRATION_PREDICATE,
    REPLAY_PREDICATE,
    DatasetRef,
    EvaluationAggregates,
    EvaluationItem,
    EvaluationPredicate,
    EvaluationStatement,
    ExactnessPredicate,
    ExactnessSample,
    ExactnessStatement,
    ExactnessSummary,
    LogitsFiles,
    PreRegistrationPredicate,
    PreRegistrationRef,
    PreRegistrationStatement,
    ReplayPredicate,
    ReplayStatement,
)
from ._internal.statement import STATEMENT_TYPE, Contract, Statement, Subject, SubjectDigest

__all__ = [
    "CanonicalizationError", "Contract", "DatasetRef", "DeterminismProfile", "DigestField",
    "DocumentError", "EVALUATION_PREDICATE", "EXACTNESS_PREDICATE", "Envelope",
    "EvaluationAggregates", "EvaluationItem", "EvaluationPredicate", "EvaluationStatement",
    "ExactnessLevel", "ExactnessPredicate", "ExactnessSample", "ExactnessStatement",
    "ExactnessSummary", "HexDigestField", "IN_TOTO_PAYLOAD_TYPE", "InvalidDigestError", "KvgraftError",
    "KV_ARTIFACT_PREDICATE", "KvArtifactPredicate", "KvArtifactStatement", "LogitsFiles",
    "ModelRef", "PRE_REGISTRATION_PREDICATE", "PositionRange", "PreRegistrationPredicate",
    "PreRegistrationRef", "PreRegistrationStatement", "REPLAY_PREDICATE", "ReplayPredicate",
    "ReplayStatement", "SCHEMA_FILES", "STATEMENT_MODELS", "STATEMENT_TYPE", "SchemaError",
    "Sha256Digest", "Sha256Hex", "Signature", "SourceText", "Statement", "Subject",
    "SubjectDigest", "TokenSpan", "canonical_json", "canonical_model", "hex_of",
    "json_schema_text", "parse_document", "parse_json", "parse_sha256", "parse_sha256_hex",
    "parse_statement", "prefixed", "sha256_bytes", "sha256_file", "sha256_stream",
    "validate_document", "write_json_schemas",
]
