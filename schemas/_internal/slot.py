"""A llama-server slot as a signed statement (``kvgraft slot sign``; docs/llamacpp.md).

llama-server saves a slot's KV state (``POST /slots/N?action=save``) as one file in
``llama_state_seq_save_file``'s format. Its statement has exactly one subject, that file by
sha256, and binds it to the server that saved it: the GGUF's sha256, the build, the format
version, the tokens and the shape of every cache. A registry logs it like a record (kind
``slot``), the file stored as the subject's blob.
"""

from __future__ import annotations

from typing import Final, Literal

from pydantic import Field

from .digests import DigestField
from .statement import Contract, Statement, Subject

SLOT_PREDICATE: Final = "https://kvgraft.dev/llama-slot/v1"


class SlotCache(Contract):
    """One KV cache of the slot: how many cells, layers and bytes per row, and which positions."""

    cells: int = Field(ge=0)
    layers: int = Field(ge=0)
    key_row_bytes: int = Field(ge=0)
    value_row_bytes: int = Field(ge=0)
    positions_digest: DigestField


class SlotPredicate(Contract):
    """What a signed slot binds: the server's GGUF (sha256 and file name) and build
    (``build_info`` of its ``/props``), the slot format version, the tokens and their digest,
    and every cache's shape."""

    gguf_sha256: DigestField
    gguf_file: str = Field(min_length=1, max_length=4096)
    build_info: str = Field(min_length=1, max_length=4096)
    format_version: int
    tokens: list[int]
    tokens_digest: DigestField
    caches: list[SlotCache] = Field(max_length=16)
    created: str = Field(min_length=1, max_length=64)


class SlotStatement(Statement):
    """An in-toto statement whose only subject is a llama-server slot file."""

    predicate_type: Literal["https://kvgraft.dev/llama-slot/v1"] = Field(default=SLOT_PREDICATE, alias="predicateType")
    subject: list[Subject] = Field(min_length=1, max_length=1)
    predicate: SlotPredicate  # type: ignore[assignment]
