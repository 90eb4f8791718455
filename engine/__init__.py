"""The engine: models, determinism profiles, KV capture and graft (extra ``engine``).

Imports ``kvgraft.schemas`` and ``kvgraft.verifier`` (to sign and check); never the registry.
``serve_engine`` runs the OpenAI-compatible server (``kvgraft engine serve``, docs/engine-serve.md),
which also needs litestar and uvicorn: they are imported only when it starts.
"""

# The artifact contract (file names, the home directory, the binding hashes) lives in
# kvgraft.schemas; the engine re-exports what its users have always found here.
from kvgraft.schemas import KV_FILE, STATEMENT_FILE, chain_key, kvgraft_home, token_digest

from ._internal.artifacts import (
    DEFAULT_MAX_CHAIN_DEPTH,
    Captured,
    LoadedArtifact,
    ensure_local_key,
    load_artifact,
    logits_digest,
    read_statement,
)
from ._internal.capability import FLYWHEEL_RULE, VOTE_RULE, run_voted_eval
from ._internal.errors import (
    ArtifactError,
    ArtifactSignatureError,
    ContextWindowError,
    EngineError,
    EngineServerConfigError,
    EngineServerError,
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
    UnknownProfileError,
    UnsafeTensorError,
)
from ._internal.evaluate import (
    EvalRun,
    journal_path,
    run_eval,
    run_replay,
    select,
    write_design,
    write_pre_registration,
)
from ._internal.exactness import draw_pairs, run_exactness, summary_table
from ._internal.kernel_errors import KernelError, ScheduleError
from ._internal.kvfile import deserialize, read_kv_file, serialize
from ._internal.kvstate import KVState, Segment
from ._internal.library import (
    GRAFT_THRESHOLD,
    INSTRUCTION,
    MAX_INDEX_LINE_BYTES,
    NOTHING_GRAFTED,
    Answer,
    Hit,
    Library,
    ProblemIndex,
    clean_solution,
    lookup_all,
    question_text,
    read_index,
    read_meta,
    require_library_match,
    worked_solution,
)
from ._internal.llamacpp import SETTINGS as LLAMACPP_SETTINGS
from ._internal.llamacpp import LlamaCppError, LlamaCppModel, LlamaCppState, server_binary
from ._internal.llamacpp import lib as llama_cpp_bindings
from ._internal.models import (
    MODELS,
    LoadedModel,
    ModelSpec,
    Wheel,
    cache_dir,
    ensure_cached,
    install,
    install_hint,
    is_cached,
    is_installed,
    load_model,
    locate_gguf,
    spec_for,
)
from ._internal.ops import (
    GREEDY,
    AnyModel,
    Continuation,
    DecodeJob,
    Sampling,
    capture,
    decode_batch,
    fresh,
    generate,
    graft,
    load_model_for,
    new_state,
    read_text,
)
from ._internal.profiles import (
    DEFAULT_PROFILE,
    FLYWHEEL_PROFILE,
    ISA_LEVELS,
    PROFILE_ALIASES,
    PROFILES,
    applied,
    compute_dtype,
    cpu_description,
    current_profile,
    flywheel_profile,
    require_same,
)
from ._internal.schedules import prefill, single_pass
from ._internal.serve import ServeConfig, ServeSettings, create_engine_app, serve_engine
from ._internal.slots import (
    ServerIdentity,
    SlotError,
    VerifiedSlot,
    envelope_path,
    read_slot,
    restore_slot,
    server_identity,
    sign_slot,
    verify_slot,
)
from ._internal.trust import (
    SKIP_WARNING,
    SKIPPED,
    TRUSTED_KEYS_ENV,
    Trust,
    home_trusted_keys_path,
    local_key_path,
    local_public_key_path,
    resolve_trust,
    trust_signer,
)
from ._internal.unassisted import ask_model

__all__ = [
    "ArtifactSignatureError", "DEFAULT_MAX_CHAIN_DEPTH", "LineageError", "NoTrustedKeysError", "SKIPPED", "SKIP_WARNING",
    "TRUSTED_KEYS_ENV", "Trust", "TrustOptionsError", "UnsafeTensorError", "home_trusted_keys_path",
    "local_public_key_path", "read_statement", "resolve_trust", "trust_signer",
    "EvaluationError", "KernelError", "LibraryError", "PROFILE_ALIASES", "ScheduleError", "prefill", "single_pass",
    "Answer", "GRAFT_THRESHOLD", "GREEDY", "Sampling", "ArtifactError", "Captured", "Hit", "Library", "Continuation", "DEFAULT_PROFILE", "FLYWHEEL_PROFILE", "flywheel_profile", "EngineError", "InputTextError", "KVState",
    "KV_FILE", "KvFileError", "LoadedArtifact", "LoadedModel", "MODELS", "ModelFileError", "ModelNotInstalledError",
    "ModelSpec", "PROFILES", "ProfileMismatchError", "STATEMENT_FILE", "Segment", "UnknownModelError", "UnknownProfileError", "applied",
    "cache_dir", "capture", "chain_key", "current_profile", "deserialize", "ensure_cached", "ensure_local_key",
    "fresh", "generate", "graft", "is_cached", "is_installed", "kvgraft_home", "load_artifact", "load_model", "local_key_path",
    "locate_gguf", "logits_digest", "read_kv_file", "read_text", "require_same", "serialize", "spec_for", "token_digest",
    "EvalRun", "clean_solution", "read_meta", "run_eval", "run_exactness", "run_replay", "select", "summary_table",
    "write_pre_registration", "write_design", "run_voted_eval", "FLYWHEEL_RULE", "VOTE_RULE", "Wheel", "install", "install_hint", "AnyModel", "LlamaCppError", "LlamaCppModel", "load_model_for", "server_binary", "LLAMACPP_SETTINGS", "LlamaCppState",
    "llama_cpp_bindings", "DecodeJob", "decode_batch", "new_state", "draw_pairs",
    "ServerIdentity", "SlotError", "VerifiedSlot", "envelope_path", "read_slot", "restore_slot", "server_identity", "sign_slot", "verify_slot",
    "ContextWindowError", "EngineServerConfigError", "EngineServerError", "NOTHING_GRAFTED", "ServeConfig", "ServeSettings",
    "ask_model", "create_engine_app", "ISA_LEVELS", "compute_dtype", "cpu_description", "lookup_all", "serve_engine", "ProblemIndex", "worked_solution", "journal_path", "read_index", "require_library_match", "MAX_INDEX_LINE_BYTES",
    "INSTRUCTION", "question_text",
]
