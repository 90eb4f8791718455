"""Tokenizers behind one small interface: the real models' Hugging Face tokenizers (loaded from
the converted cache, never a hub) and a byte-level tokenizer for ``tiny-llama-test``."""

from __future__ import annotations

from typing import Any, Protocol

from kvgraft.schemas import Sha256Digest, sha256_bytes


class Tokenizer(Protocol):
    """What the engine needs from a tokenizer."""

    digest: Sha256Digest
    eos_token_id: int | None

    def encode(self, text: str, *, first: bool) -> list[int]:
        """Token ids of ``text``; ``first`` adds the model's start-of-text tokens (BOS)."""
        ...

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids``."""
        ...


class ByteTokenizer:
    """UTF-8 bytes as tokens 3..258, with BOS=1 and EOS=2; for the seeded test model."""

    bos_token_id = 1
    eos_token_id: int | None = 2
    vocab_size = 259
    digest: Sha256Digest = sha256_bytes(b"kvgraft byte tokenizer v1: bos=1 eos=2 byte b -> b+3")

    def encode(self, text: str, *, first: bool) -> list[int]:
        """Bytes of ``text`` shifted by 3, after BOS when ``first``."""
        ids = [b + 3 for b in text.encode("utf-8")]
        return [self.bos_token_id, *ids] if first else ids

    def decode(self, ids: list[int]) -> str:
        """The text of byte tokens; special tokens are dropped."""
        return bytes(i - 3 for i in ids if 3 <= i < 259).decode("utf-8", errors="replace")


class HfTokenizer:
    """A transformers tokenizer, identified by the digest of its cached tokenizer.json."""

    def __init__(self, tokenizer: Any, *, digest: Sha256Digest) -> None:
        self._tok = tokenizer
        self.digest = digest
        self.eos_token_id: int | None = tokenizer.eos_token_id

    def encode(self, text: str, *, first: bool) -> list[int]:
        """Token ids; only the first segment of a context gets the special start tokens."""
        return list(self._tok.encode(text, add_special_tokens=first))

    def decode(self, ids: list[int]) -> str:
        """Decoded text, special tokens skipped."""
        return str(self._tok.decode(ids, skip_special_tokens=True))
