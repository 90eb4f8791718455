"""Hand-built, valid documents for the contract tests (the engine will make real ones)."""

from __future__ import annotations

from kvgraft.schemas import (
    DeterminismProfile,
    KvArtifactPredicate,
    KvArtifactStatement,
    ModelRef,
    PositionRange,
    SourceText,
    Subject,
    SubjectDigest,
    TokenSpan,
    canonical_json,
    hex_of,
    sha256_bytes,
)


def profile() -> DeterminismProfile:
    """A plausible CPU profile."""
    return DeterminismProfile(
        name="cpu-fp32-own-position",
        exactness="own-position",
        device_kind="cpu",
        device_fingerprint="x86_64 avx2 avx512f",
        dtype="float32",
        torch_version="2.13.0",
        transformers_version="5.0.0",
        threads=1,
        attention_implementation="eager",
        matmul_tiling="default",
        deterministic_algorithms=True,
    )


def kv_artifact_statement() -> KvArtifactStatement:
    """A KV artifact statement over three tokens at positions [0, 3)."""
    ids = [1, 2, 3]
    tensors = sha256_bytes(b"tensors")
    return KvArtifactStatement(
        subject=[Subject(name="kv.safetensors", digest=SubjectDigest(sha256=hex_of(tensors)))],
        predicate=KvArtifactPredicate(
            model=ModelRef(name="tiny-llama-test", weights_digest=sha256_bytes(b"w"), config_digest=sha256_bytes(b"c")),
            tokenizer_digest=sha256_bytes(b"tok"),
            profile=profile(),
            parent=None,
            chain_key=sha256_bytes(b"chain"),
            tokens=TokenSpan(ids=ids, digest=sha256_bytes(canonical_json(ids))),
            positions=PositionRange(start=0, end=3),
            source_text=SourceText(digest=sha256_bytes(b"abc"), text="abc"),
            next_token_logits_digest=sha256_bytes(b"logits"),
            engine_versions={"kvgraft": "0.1.0"},
            created="2026-11-29T12:00:00Z",
        ),
    )
