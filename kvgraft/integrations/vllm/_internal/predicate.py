"""The signed claim of one vLLM KV block: what computed it (the binding) and which tokens it holds.

A block artifact is a directory holding ``kv.safetensors`` (the block's slice of every attention
layer's paged cache, ``blocks.py``) and ``statement.dsse.json``: a DSSE envelope over an in-toto
Statement v1 whose only subject is ``kv.safetensors`` and whose predicate type is
``https://kvgraft.dev/vllm-kv-block/v1`` (``VllmBlockPredicate``).

Blocks chain: block ``i`` of a prompt names block ``i-1``'s chain key as its parent, and

    chain_key = sha256(parent chain key (32 raw bytes; 32 zero bytes for block 0)
                       || sha256(RFC 8785 JSON of the binding) (32 bytes)
                       || RFC 8785 JSON of the block's token ids)

so a key names the whole prefix up to the block's end, under one binding. The store is addressed
by that key (content addressing: the same prefix under the same binding is one directory).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Final, Literal

from pydantic import Field, model_validator

from kvgraft.schemas import (
    Contract,
    DigestField,
    PositionRange,
    Sha256Digest,
    Statement,
    TokenSpan,
    canonical_json,
    canonical_model,
    hex_of,
    sha256_bytes,
)

VLLM_BLOCK_PREDICATE: Final = "https://kvgraft.dev/vllm-kv-block/v1"
#: The layout every block file follows: for each attention layer, the block's slice of vLLM's
#: per-layer KV cache view, whose dimension 0 indexes blocks ([B, ...] -> [...]).
KV_LAYOUT: Final = "vllm-block-major/v1"


class VllmBinding(Contract):
    """Everything that decides the numbers in a block, as the running engine reports it.

    Two engines may share a block only when their bindings are equal field by field.
    """

    model_name: str = Field(min_length=1, description="the served model name")
    weights_digest: DigestField = Field(description="sha256 of the canonical JSON {weights file name: sha256} of the model directory")
    config_digest: DigestField = Field(description="sha256 of the canonical JSON of config.json")
    tokenizer_digest: DigestField = Field(description="sha256 of tokenizer.json (or of the canonical JSON of the tokenizer files' digests)")
    vllm_version: str
    torch_version: str
    device: str = Field(description="cpu: the CPU model name; otherwise the accelerator's name and capability")
    attention_backend: str
    block_size: int = Field(ge=1)
    model_dtype: str
    kv_cache_dtype: str = Field(description="the cache's storage dtype as vLLM resolved it")
    kv_layout: str = Field(description=f"the block file's layout, {KV_LAYOUT}")
    num_kv_heads: int = Field(ge=1)
    head_size: int = Field(ge=1)
    layers: list[str] = Field(min_length=1, description="attention layer names, sorted; the file's tensor names")
    settings: dict[str, str] = Field(description="every other engine setting that can change a bit of the KV (chunking, compilation, parallelism, threads)")


class VllmBlockPredicate(Contract):
    """What a signed vLLM KV block claims about its tensors file."""

    binding: VllmBinding
    binding_digest: DigestField = Field(description="sha256 of the RFC 8785 JSON of binding")
    chain_key: DigestField = Field(description="sha256(parent key || binding digest || token ids)")
    parent: DigestField | None = Field(description="the previous block's chain key, or null for block 0")
    block_index: int = Field(ge=0)
    positions: PositionRange
    tokens: TokenSpan = Field(description="this block's token ids and their digest")
    prefix_digest: DigestField = Field(description="sha256 of the canonical JSON of every token id from position 0 to positions.end")
    kvgraft_version: str
    created: str = Field(description="creation time, RFC 3339, informational")

    @model_validator(mode="after")
    def _consistent(self) -> VllmBlockPredicate:
        width = self.positions.end - self.positions.start
        if width != len(self.tokens.ids) or width != self.binding.block_size:
            raise ValueError(f"positions [{self.positions.start}, {self.positions.end}) must cover one block of "
                             f"{self.binding.block_size} tokens; {len(self.tokens.ids)} token ids are listed")
        if self.positions.start != self.block_index * self.binding.block_size:
            raise ValueError(f"block {self.block_index} must start at position {self.block_index * self.binding.block_size}")
        if (self.parent is None) != (self.block_index == 0):
            raise ValueError("only block 0 has no parent")
        return self


class VllmBlockStatement(Statement):
    """An in-toto statement whose predicate is a vLLM KV block."""

    predicate_type: Literal["https://kvgraft.dev/vllm-kv-block/v1"] = Field(default=VLLM_BLOCK_PREDICATE, alias="predicateType")
    predicate: VllmBlockPredicate  # type: ignore[assignment]


def binding_digest(binding: VllmBinding) -> Sha256Digest:
    """sha256 of the binding's RFC 8785 JSON."""
    return sha256_bytes(canonical_model(binding))


def block_chain_key(parent: Sha256Digest | None, binding: Sha256Digest, ids: Sequence[int]) -> Sha256Digest:
    """The chain key of a block (module docstring): ``binding`` is ``binding_digest(...)``."""
    h = hashlib.sha256()
    h.update(bytes.fromhex(hex_of(parent)) if parent else b"\0" * 32)
    h.update(bytes.fromhex(hex_of(binding)))
    h.update(canonical_json([int(i) for i in ids]))
    return Sha256Digest("sha256:" + h.hexdigest())


def chain_keys(binding: Sha256Digest, ids: Sequence[int], block_size: int, blocks: int) -> list[Sha256Digest]:
    """The chain keys of the first ``blocks`` full blocks of ``ids``."""
    keys: list[Sha256Digest] = []
    parent: Sha256Digest | None = None
    for i in range(blocks):
        parent = block_chain_key(parent, binding, ids[i * block_size:(i + 1) * block_size])
        keys.append(parent)
    return keys
