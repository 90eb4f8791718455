"""The KV artifact predicate and the pieces every predicate shares (model, profile)."""

from __future__ import annotations

from typing import Final, Literal

from pydantic import Field, model_validator

from .digests import DigestField
from .statement import Contract, Statement

KV_ARTIFACT_PREDICATE: Final = "https://kvgraft.dev/kv-artifact/v1"

ExactnessLevel = Literal["own-position", "schedule-invariant"]


class ModelRef(Contract):
    """Which model produced a state: its name and fingerprint (GGUF sha256 + config digest)."""

    name: str = Field(min_length=1, description="kvgraft model name, e.g. smollm2-135m")
    weights_digest: DigestField = Field(description="sha256 of the GGUF file (or of the seeded weights)")
    config_digest: DigestField = Field(description="sha256 of the canonical JSON of the model config")


class DeterminismProfile(Contract):
    """Everything that can change a bit of the computation, frozen under a name.

    Two states may be grafted into each other only when their profiles are equal field by field.
    """

    name: str = Field(min_length=1)
    exactness: ExactnessLevel
    device_kind: str = Field(description="cpu, cuda, ...")
    device_fingerprint: str = Field(description="CPU model and ISA flags, or GPU name and compute capability")
    dtype: str = Field(description="torch dtype of the weights, and after '+kv-' the cache's when it stores another, e.g. float32 or float32+kv-float16")
    torch_version: str
    transformers_version: str
    kernel_versions: dict[str, str] = Field(default_factory=dict)
    threads: int = Field(ge=1)
    attention_implementation: str
    matmul_tiling: str = Field(description="e.g. 'default' or 'fixed-m-16'")
    prefill_chunk: int | None = Field(default=None, ge=1, description="None means single pass")
    deterministic_algorithms: bool


class TokenSpan(Contract):
    """The token ids a state covers and their digest (sha256 of canonical JSON of the list)."""

    ids: list[int] = Field(description="token ids in order")
    digest: DigestField


class PositionRange(Contract):
    """Absolute positions ``[start, end)`` the state occupies."""

    start: int = Field(ge=0)
    end: int = Field(ge=0)

    @model_validator(mode="after")
    def _ordered(self) -> PositionRange:
        if self.end < self.start:
            raise ValueError(f"position range [{self.start}, {self.end}) ends before it starts")
        return self


class SourceText(Contract):
    """The text the tokens came from: its digest always, the text itself optionally."""

    digest: DigestField
    text: str | None = None


class KvArtifactPredicate(Contract):
    """What a signed KV artifact claims about its tensors file (docs/artifacts.md)."""

    model: ModelRef
    tokenizer_digest: DigestField
    profile: DeterminismProfile
    parent: DigestField | None = Field(description="subject digest of the parent artifact's tensors, or null")
    chain_key: DigestField = Field(description="sha256(parent_key || model || profile || token ids)")
    tokens: TokenSpan
    positions: PositionRange
    source_text: SourceText
    next_token_logits_digest: DigestField = Field(description="sha256 of the float logits at the last position")
    engine_versions: dict[str, str]
    created: str = Field(description="creation time, RFC 3339, informational")

    @model_validator(mode="after")
    def _span_matches(self) -> KvArtifactPredicate:
        width = self.positions.end - self.positions.start
        if width != len(self.tokens.ids):
            raise ValueError(
                f"positions [{self.positions.start}, {self.positions.end}) cover {width} tokens "
                f"but {len(self.tokens.ids)} token ids are listed"
            )
        return self


class KvArtifactStatement(Statement):
    """An in-toto statement whose predicate is a KV artifact."""

    predicate_type: Literal["https://kvgraft.dev/kv-artifact/v1"] = Field(
        default=KV_ARTIFACT_PREDICATE, alias="predicateType"
    )
    predicate: KvArtifactPredicate  # type: ignore[assignment]
