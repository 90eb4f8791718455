"""The engine: models, determinism profiles, KV capture and graft (extra ``engine``).

Imports ``kvgraft.schemas`` and ``kvgraft.verifier`` (to sign and check); never the registry.
"""

from ._internal.artifacts import (
    DEFAULT_MAX_CHAIN_DEPTH,
    KV_FILE,
    STATEMENT_FILE,
    Captured,
    LoadedArtifact,
    chain_key,
    ensure_local_key,
    load_artifact,
    local_key_path,
    logits_digest,
    read_statement,
    token_digest,
)
from ._internal.errors import (
    ArtifactError,
    ArtifactSignatureError,
    EngineError,
    EvaluationError,
    InputTextError,
    KvFileError,
    LibraryError,
    LineageError,
    ModelFileError,
    ModelNotInstalledError,
    NoTrustedKeysError,
    ProfileMismatchError,
    TrustOptionsError,
    UnknownModelError,
    UnsafeTensorError,
)
from ._internal.kernel_errors import KernelError, ScheduleError
from ._internal.kvfile import deserialize, read_kv_file, serialize
from ._internal.kvstate import KVState, Segment
from ._internal.library import Answer, Hit, Library
from ._internal.models import (
    MODELS,
    LoadedModel,
    ModelSpec,
    cache_dir,
    ensure_cached,
    is_cached,
    is_installed,
    kvgraft_home,
    load_model,
    locate_gguf,
    spec_for,
)
from ._internal.ops import Continuation, capture, fresh, generate, graft, read_text
from ._internal.profiles import DEFAULT_PROFILE, PROFILE_ALIASES, PROFILES, applied, current_profile, require_same
from ._internal.schedules import prefill, single_pass
from ._internal.trust import (
    SKIP_WARNING,
    SKIPPED,
    TRUSTED_KEYS_ENV,
    Trust,
    home_trusted_keys_path,
    local_public_key_path,
    resolve_trust,
    trust_signer,
)

__all__ = [
    "ArtifactSignatureError", "DEFAULT_MAX_CHAIN_DEPTH", "LineageError", "NoTrustedKeysError", "SKIPPED", "SKIP_WARNING",
    "TRUSTED_KEYS_ENV", "Trust", "TrustOptionsError", "UnsafeTensorError", "home_trusted_keys_path",
    "local_public_key_path", "read_statement", "resolve_trust", "trust_signer",
    "EvaluationError", "KernelError", "LibraryError", "PROFILE_ALIASES", "ScheduleError", "prefill", "single_pass",
    "Answer", "ArtifactError", "Captured", "Hit", "Library", "Continuation", "DEFAULT_PROFILE", "EngineError", "InputTextError", "KVState",
    "KV_FILE", "KvFileError", "LoadedArtifact", "LoadedModel", "MODELS", "ModelFileError", "ModelNotInstalledError",
    "ModelSpec", "PROFILES", "ProfileMismatchError", "STATEMENT_FILE", "Segment", "UnknownModelError", "applied",
    "cache_dir", "capture", "chain_key", "current_profile", "deserialize", "ensure_cached", "ensure_local_key",
    "fresh", "generate", "graft", "is_cached", "is_installed", "kvgraft_home", "load_artifact", "load_model", "local_key_path",
    "locate_gguf", "logits_digest", "read_kv_file", "read_text", "require_same", "serialize", "spec_for", "token_digest",
]
