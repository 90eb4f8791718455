"""Block artifacts on disk: write one signed block, and read one back only if it verifies.

A block directory is ``<store>/<chain key hex>/`` holding exactly ``kv.safetensors`` and
``statement.dsse.json`` (``predicate.py``). ``kv.safetensors`` holds one tensor per attention
layer, named by the layer, each the block's slice of that layer's KV cache view (dimension 0 of
vLLM's per-layer view indexes blocks), in the cache's dtype, with ``__metadata__``
``{"format": "kvgraft-vllm-kv-block/v1"}``.

``read_verified_block`` returns the file's bytes only after every check holds, in this order:
the envelope's size, its signatures against the trusted keys (and the predicate type's
threshold), the statement's type and predicate, the binding equal to the engine's field by field,
the token ids equal to the request's, the token and prefix digests, the chain key recomputed and
equal to the one looked up, the parent, the directory holding exactly the subject, the file's
size bound, its digest, and its tensors: names, dtype, element count, all finite. The bytes
returned are the bytes hashed, so what is loaded is what was verified.
"""

from __future__ import annotations

import datetime
import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import torch
from pydantic import ValidationError
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

import kvgraft
from kvgraft.schemas import (
    KV_FILE,
    STATEMENT_FILE,
    PositionRange,
    Sha256Digest,
    Subject,
    SubjectDigest,
    TokenSpan,
    hex_of,
    sha256_bytes,
    token_digest,
    write_staged_directory,
)
from kvgraft.verifier import (
    SigningKey,
    TrustedKeys,
    envelope_json,
    read_envelope,
    sign_statement,
    verify_statement_envelope,
)

from .errors import BindingMismatchError, BlockFileError, ChainMismatchError
from .predicate import (
    VLLM_BLOCK_PREDICATE,
    VllmBinding,
    VllmBlockPredicate,
    VllmBlockStatement,
    block_chain_key,
)

FORMAT: Final = "kvgraft-vllm-kv-block/v1"
#: Room for the safetensors header (names, shapes, offsets) beyond the tensors' own bytes.
_HEADER_SLACK: Final = 1 << 20

_DTYPES: Final[dict[str, torch.dtype]] = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2, "uint8": torch.uint8,
}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"``."""
    return str(dtype).removeprefix("torch.")


def block_elements(binding: VllmBinding) -> int:
    """Elements of one layer's block: keys and values of ``block_size`` tokens."""
    return 2 * binding.num_kv_heads * binding.block_size * binding.head_size


def max_file_bytes(binding: VllmBinding) -> int:
    """The largest ``kv.safetensors`` a block under ``binding`` can be."""
    item = torch.empty((), dtype=_DTYPES.get(binding.kv_cache_dtype, torch.float32)).element_size()
    return len(binding.layers) * block_elements(binding) * item + _HEADER_SLACK


@dataclass(frozen=True)
class BlockClaim:
    """What a block is asked to be: its place in a request's chain, under one binding."""

    binding: VllmBinding
    binding_digest: Sha256Digest
    index: int
    ids: tuple[int, ...]
    parent: Sha256Digest | None
    key: Sha256Digest
    prefix_digest: Sha256Digest

    @classmethod
    def of(cls, binding: VllmBinding, digest: Sha256Digest, prompt: Sequence[int], index: int,
           parent: Sha256Digest | None) -> BlockClaim:
        """Block ``index`` of ``prompt`` whose previous block has chain key ``parent``."""
        size = binding.block_size
        ids = tuple(int(i) for i in prompt[index * size:(index + 1) * size])
        if len(ids) != size:
            raise ValueError(f"block {index} of a {len(prompt)}-token prompt is not full")
        return cls(binding, digest, index, ids, parent, block_chain_key(parent, digest, ids),
                   token_digest([int(i) for i in prompt[:(index + 1) * size]]))


def loadable_blocks(prompt_tokens: int, block_size: int) -> int:
    """How many full blocks of a prompt may be loaded: at least two prompt tokens stay to compute.

    vLLM needs the last token's logits, so one token always stays. But a step that computes a
    single prompt token runs vLLM's decode kernels, and on the CPU build their last bits differ from
    the prefill's (the exactness record's samples of 257 and 737 tokens differed, every other length
    was equal): so a prompt one token past a block boundary leaves its last full block to compute.
    """
    blocks = (prompt_tokens - 1) // block_size
    if blocks > 0 and prompt_tokens - blocks * block_size == 1:
        blocks -= 1
    return blocks


def block_dir(store: Path, key: Sha256Digest) -> Path:
    """Where the block with chain key ``key`` lives in ``store``."""
    return store / hex_of(key)


def encode_block(tensors: dict[str, torch.Tensor]) -> bytes:
    """The ``kv.safetensors`` bytes of one block (tensors on the CPU, contiguous)."""
    return save_safetensors({name: t.contiguous() for name, t in sorted(tensors.items())}, metadata={"format": FORMAT})


def decode_block(data: bytes) -> dict[str, torch.Tensor]:
    """The tensors of verified ``kv.safetensors`` bytes."""
    return load_safetensors(data)


def sign_block(claim: BlockClaim, kv: bytes, signer: SigningKey) -> dict[str, bytes]:
    """The files of a block directory: ``kv.safetensors`` and its signed statement."""
    size = claim.binding.block_size
    predicate = VllmBlockPredicate(
        binding=claim.binding,
        binding_digest=claim.binding_digest,
        chain_key=claim.key,
        parent=claim.parent,
        block_index=claim.index,
        positions=PositionRange(start=claim.index * size, end=(claim.index + 1) * size),
        tokens=TokenSpan(ids=list(claim.ids), digest=token_digest(list(claim.ids))),
        prefix_digest=claim.prefix_digest,
        kvgraft_version=kvgraft.__version__,
        created=datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
    )
    statement = VllmBlockStatement(
        subject=[Subject(name=KV_FILE, digest=SubjectDigest(sha256=hex_of(sha256_bytes(kv))))],
        predicate=predicate,
    )
    return {KV_FILE: kv, STATEMENT_FILE: envelope_json(sign_statement(statement, [signer]))}


def write_block(store: Path, claim: BlockClaim, kv: bytes, signer: SigningKey) -> Path:
    """Write the block atomically (staged beside, fsynced, renamed); an existing one is kept."""
    target = block_dir(store, claim.key)
    return write_staged_directory(target, sign_block(claim, kv, signer))


def _first_difference(want: VllmBinding, got: VllmBinding) -> str:
    mine, theirs = want.model_dump(mode="json"), got.model_dump(mode="json")
    for name, value in mine.items():
        if theirs.get(name) != value:
            if isinstance(value, dict):
                keys = sorted(set(value) | set(theirs.get(name) or {}))
                diff = [k for k in keys if value.get(k) != (theirs.get(name) or {}).get(k)]
                return f"{name}.{diff[0]}: block has {(theirs.get(name) or {}).get(diff[0])!r}, engine has {value.get(diff[0])!r}"
            return f"{name}: block has {theirs.get(name)!r}, engine has {value!r}"
    return "the bindings differ"


def _check_predicate(predicate: VllmBlockPredicate, claim: BlockClaim) -> None:
    if predicate.binding != claim.binding:
        raise BindingMismatchError(f"block was computed under another binding ({_first_difference(claim.binding, predicate.binding)})")
    if predicate.binding_digest != claim.binding_digest:
        raise BindingMismatchError(f"block's binding digest {predicate.binding_digest} is not its binding's")
    if predicate.block_index != claim.index:
        raise ChainMismatchError(f"block claims index {predicate.block_index}, the request needs block {claim.index}")
    if tuple(predicate.tokens.ids) != claim.ids:
        raise ChainMismatchError(f"block {claim.index} holds other token ids than the request's")
    if predicate.tokens.digest != token_digest(list(claim.ids)):
        raise ChainMismatchError(f"block {claim.index}'s tokens digest {predicate.tokens.digest} is not the digest of its ids")
    if predicate.prefix_digest != claim.prefix_digest:
        raise ChainMismatchError(f"block {claim.index}'s prefix digest is not the request's: another prefix")
    if predicate.parent != claim.parent:
        raise ChainMismatchError(f"block {claim.index} names parent {predicate.parent}, the request's previous block is {claim.parent}")
    recomputed = block_chain_key(predicate.parent, predicate.binding_digest, predicate.tokens.ids)
    if recomputed != predicate.chain_key or recomputed != claim.key:
        raise ChainMismatchError(f"block {claim.index}'s chain key {predicate.chain_key} does not recompute "
                                 f"({recomputed}); looked up as {claim.key}")


def _read_bounded(path: Path, limit: int) -> bytes:
    try:
        with path.open("rb") as f:
            data = f.read(limit + 1)
    except FileNotFoundError as e:
        raise BlockFileError(f"{path} is missing") from e
    except OSError as e:
        raise BlockFileError(f"cannot read {path}: {e.strerror}") from e
    if len(data) > limit:
        raise BlockFileError(f"{path} is larger than the {limit} bytes a block under this binding can be")
    return data


def _check_tensors(data: bytes, binding: VllmBinding) -> None:
    try:
        (header_len,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8:8 + header_len])
        tensors = decode_block(data)
    except (struct.error, ValueError, RuntimeError) as e:  # safetensors raises SafetensorError (a RuntimeError)
        raise BlockFileError(f"{KV_FILE} is not a readable safetensors file: {e}") from e
    if header.get("__metadata__", {}).get("format") != FORMAT:
        raise BlockFileError(f"{KV_FILE} is not a {FORMAT} file")
    if sorted(tensors) != binding.layers:
        raise BlockFileError(f"{KV_FILE} holds tensors {sorted(tensors)[:3]}..., not the {len(binding.layers)} bound layers")
    for name, tensor in tensors.items():
        if dtype_name(tensor.dtype) != binding.kv_cache_dtype or tensor.numel() != block_elements(binding):
            raise BlockFileError(f"{KV_FILE}: {name} is {dtype_name(tensor.dtype)} {list(tensor.shape)}, "
                                 f"the binding needs {binding.kv_cache_dtype} with {block_elements(binding)} elements")
    # One pass over every layer (one call, not one per layer: a block's layers are small tensors);
    # only when it fails are the layers looked at one by one, to name the first bad one.
    if next(iter(tensors.values())).is_floating_point() and not bool(torch.isfinite(torch.cat([t.reshape(-1) for t in tensors.values()])).all()):
        bad = next(name for name in sorted(tensors) if not bool(torch.isfinite(tensors[name]).all()))
        raise BlockFileError(f"{KV_FILE}: {bad} holds values that are not finite")


def read_verified_block(store: Path, claim: BlockClaim, trusted: TrustedKeys) -> bytes:
    """The verified ``kv.safetensors`` bytes of ``claim``'s block, or a ``KvgraftError`` naming why not
    (module docstring: every check, in order). Raises ``FileNotFoundError`` when no block is stored."""
    directory = block_dir(store, claim.key)
    envelope_path = directory / STATEMENT_FILE
    if not envelope_path.is_file():
        raise FileNotFoundError(envelope_path)
    _, statement = verify_statement_envelope(read_envelope(envelope_path), trusted)
    if statement.predicate_type != VLLM_BLOCK_PREDICATE:
        raise BlockFileError(f"{envelope_path} is a {statement.predicate_type} statement, not a vLLM KV block")
    try:
        typed = VllmBlockStatement.model_validate(statement.model_dump(by_alias=True), strict=False)
    except ValidationError as e:
        raise BlockFileError(f"{envelope_path}: the block's predicate is malformed: {e.errors()[0]['msg']}") from e
    _check_predicate(typed.predicate, claim)
    if [s.name for s in typed.subject] != [KV_FILE]:
        raise BlockFileError(f"{envelope_path} names subjects {[s.name for s in typed.subject]}, not [{KV_FILE!r}]")
    extra = sorted(p.name for p in directory.iterdir() if p.name not in (KV_FILE, STATEMENT_FILE))
    if extra:
        raise BlockFileError(f"{directory} holds {', '.join(extra)} beside the block's two files")
    data = _read_bounded(directory / KV_FILE, max_file_bytes(claim.binding))
    got = sha256_bytes(data)
    if hex_of(got) != typed.subject[0].digest.sha256:
        raise BlockFileError(f"{KV_FILE} has digest {got}, but the signed statement says sha256:{typed.subject[0].digest.sha256}")
    _check_tensors(data, claim.binding)
    return data
