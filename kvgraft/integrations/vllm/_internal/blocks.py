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
import hashlib
import json
import math
import mmap
import os
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import numpy as np
import torch
from pydantic import ValidationError
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
#: Memory a block file is read into and checked in.
WritableBuffer = bytearray | mmap.mmap
#: Memory block tensors are viewed in.
Buffer = bytes | bytearray | mmap.mmap
#: Room for the safetensors header (names, shapes, offsets) beyond the tensors' own bytes.
_HEADER_SLACK: Final = 1 << 20

#: Bytes read (and hashed) at a time: small enough to stay in cache between the read and the hash.
_READ_CHUNK: Final = 256 * 1024
#: safetensors' dtype names, for the dtypes a KV cache can have.
_SAFETENSORS_DTYPES: Final[dict[str, torch.dtype]] = {
    "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2, "U8": torch.uint8,
}
#: Dtypes whose finiteness numpy checks (bfloat16 and float8 go to torch).
_NUMPY_FLOATS: Final[dict[torch.dtype, type[np.floating[Any]]]] = {torch.float32: np.float32, torch.float16: np.float16}

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


class PrefixDigests:
    """``token_digest`` of a prompt's growing prefixes, block after block, in one pass over the ids.

    ``token_digest(prompt[:end])`` for every block would hash the prompt again per block
    (quadratic: 249 blocks of an 8K prompt hash a million ids); this keeps the hash of
    ``canonical_json(prefix)`` without its closing bracket and adds each block's ids. Token ids are
    integers within I-JSON's exact range, whose canonical JSON is their digits joined by commas.
    """

    def __init__(self) -> None:
        self._hash = hashlib.sha256(b"[")
        self._count = 0

    @property
    def count(self) -> int:
        """How many ids the prefix holds."""
        return self._count

    def extend(self, ids: Sequence[int]) -> Sha256Digest:
        """Add ``ids`` to the prefix; the digest of the whole prefix so far."""
        if ids:
            text = ",".join(str(int(i)) for i in ids)
            self._hash.update(((("," if self._count else "") + text)).encode("ascii"))
            self._count += len(ids)
        closed = self._hash.copy()
        closed.update(b"]")
        return Sha256Digest("sha256:" + closed.hexdigest())


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
           parent: Sha256Digest | None, prefix: PrefixDigests | None = None) -> BlockClaim:
        """Block ``index`` of ``prompt`` whose previous block has chain key ``parent``.

        ``prefix``: the digests of the prompt's blocks before this one (``PrefixDigests`` holding
        exactly ``index`` blocks), extended by this block; without it the prefix is hashed whole.
        """
        size = binding.block_size
        ids = tuple(int(i) for i in prompt[index * size:(index + 1) * size])
        if len(ids) != size:
            raise ValueError(f"block {index} of a {len(prompt)}-token prompt is not full")
        if prefix is None:
            prefix_digest = token_digest([int(i) for i in prompt[:(index + 1) * size]])
        elif prefix.count != index * size:
            raise ValueError(f"the prefix digests hold {prefix.count} ids, block {index} starts at {index * size}")
        else:
            prefix_digest = prefix.extend(ids)
        return cls(binding, digest, index, ids, parent, block_chain_key(parent, digest, ids), prefix_digest)


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


def decode_block(data: Buffer) -> dict[str, torch.Tensor]:
    """The tensors of verified ``kv.safetensors`` bytes: views of ``data``, no copy (``block_views``)."""
    return block_views(data)


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


def _read_hashed(path: Path, limit: int, allocate: Callable[[int], WritableBuffer]) -> tuple[WritableBuffer, Sha256Digest]:
    """The file's bytes, read into ``allocate(size)``, and their sha256, hashed while read (each
    chunk while it is in cache: one pass over the bytes, not a read and then a hash); refused past
    ``limit`` bytes."""
    try:
        with path.open("rb", buffering=0) as f:
            size = os.fstat(f.fileno()).st_size
            if size > limit:
                raise BlockFileError(f"{path} is larger than the {limit} bytes a block under this binding can be")
            if size < 8:
                raise BlockFileError(f"{path} is not a readable safetensors file: {size} bytes")
            data = allocate(size)
            view = memoryview(data)
            h = hashlib.sha256()
            done = 0
            while done < size:
                n = f.readinto(view[done:done + _READ_CHUNK])
                if not n:
                    raise BlockFileError(f"{path} shrank while it was read")
                h.update(view[done:done + n])
                done += n
            if f.read(1):
                raise BlockFileError(f"{path} grew while it was read")
    except FileNotFoundError as e:
        raise BlockFileError(f"{path} is missing") from e
    except OSError as e:
        raise BlockFileError(f"cannot read {path}: {e.strerror}") from e
    return data, Sha256Digest("sha256:" + h.hexdigest())


def block_views(data: Buffer) -> dict[str, torch.Tensor]:
    """The tensors of ``kv.safetensors`` bytes as views of ``data`` (no copy), by name.

    The safetensors layout is checked as its own reader would: an 8-byte little-endian header
    length, a JSON header within the data, ``__metadata__`` naming ``FORMAT``, known dtypes, and
    ``data_offsets`` that tile the data region exactly in order, each the size its shape and dtype
    need. ``BlockFileError`` names the first thing wrong.
    """
    if len(data) < 8:
        raise BlockFileError(f"{KV_FILE} is not a readable safetensors file: {len(data)} bytes")
    (header_len,) = struct.unpack_from("<Q", data, 0)
    if header_len > min(len(data) - 8, _HEADER_SLACK):
        raise BlockFileError(f"{KV_FILE} is not a readable safetensors file: a {header_len}-byte header in {len(data)} bytes")
    try:
        header = json.loads(bytes(data[8:8 + header_len]))
    except ValueError as e:  # also UnicodeDecodeError
        raise BlockFileError(f"{KV_FILE} is not a readable safetensors file: its header is not JSON ({e})") from e
    if not isinstance(header, dict):
        raise BlockFileError(f"{KV_FILE} is not a readable safetensors file: its header is not an object")
    metadata = header.pop("__metadata__", None)
    if not isinstance(metadata, dict) or metadata.get("format") != FORMAT:
        raise BlockFileError(f"{KV_FILE} is not a {FORMAT} file")
    start = 8 + header_len
    entries = []
    for name, entry in header.items():
        try:
            dtype = _SAFETENSORS_DTYPES[entry["dtype"]]
            shape = [int(d) for d in entry["shape"]]
            begin, end = (int(o) for o in entry["data_offsets"])
        except (KeyError, TypeError, ValueError) as e:
            raise BlockFileError(f"{KV_FILE}: tensor {name!r} has a malformed header entry") from e
        numel = math.prod(shape)
        if min(shape, default=0) < 0 or end - begin != numel * torch.empty((), dtype=dtype).element_size():
            raise BlockFileError(f"{KV_FILE}: tensor {name!r} spans bytes {begin}..{end}, not the size of {entry['dtype']} {shape}")
        entries.append((begin, end, name, dtype, shape, numel))
    entries.sort()
    at = 0
    for begin, end, name, *_ in entries:
        if begin != at:
            raise BlockFileError(f"{KV_FILE}: tensor {name!r} starts at byte {begin}, not {at}: the tensors must tile the data")
        at = end
    if start + at != len(data):
        raise BlockFileError(f"{KV_FILE}: the tensors cover {at} bytes of a {len(data) - start}-byte data region")
    return {name: (torch.frombuffer(data, dtype=dtype, count=numel, offset=start + begin) if numel
                   else torch.empty(0, dtype=dtype)).view(shape)
            for begin, _, name, dtype, shape, numel in entries}


def _check_tensors(data: Buffer, binding: VllmBinding) -> None:
    tensors = block_views(data)
    if sorted(tensors) != binding.layers:
        raise BlockFileError(f"{KV_FILE} holds tensors {sorted(tensors)[:3]}..., not the {len(binding.layers)} bound layers")
    for name, tensor in tensors.items():
        if dtype_name(tensor.dtype) != binding.kv_cache_dtype or tensor.numel() != block_elements(binding):
            raise BlockFileError(f"{KV_FILE}: {name} is {dtype_name(tensor.dtype)} {list(tensor.shape)}, "
                                 f"the binding needs {binding.kv_cache_dtype} with {block_elements(binding)} elements")
    first = next(iter(tensors.values()))
    if not first.is_floating_point():
        return
    # The tensors tile the data region (block_views checked it), so one view covers every layer.
    # Its sum in float64 is finite exactly when every value is: a NaN or an infinity makes any sum
    # NaN or infinite, and float32 or float16 values cannot overflow a float64 sum (2**128 times a
    # million is far below 2**1024). One pass in numpy, single-threaded (torch's reductions start
    # OpenMP threads that would compete with vLLM's worker for its cores), no temporary, no copy.
    # Only when it fails are the layers looked at one by one, to name the first bad one.
    offset = len(data) - sum(t.numel() for t in tensors.values()) * first.element_size()
    if first.dtype in _NUMPY_FLOATS:
        region = np.frombuffer(data, dtype=_NUMPY_FLOATS[first.dtype], offset=offset)
        finite = bool(np.isfinite(np.add.reduce(region, dtype=np.float64)))
    else:
        finite = bool(torch.isfinite(torch.frombuffer(data, dtype=first.dtype, offset=offset)).all())
    if not finite:
        bad = next(name for name in sorted(tensors) if not bool(torch.isfinite(tensors[name]).all()))
        raise BlockFileError(f"{KV_FILE}: {bad} holds values that are not finite")


def read_verified_block(store: Path, claim: BlockClaim, trusted: TrustedKeys,
                        allocate: Callable[[int], WritableBuffer] = bytearray) -> WritableBuffer:
    """The verified ``kv.safetensors`` bytes of ``claim``'s block, or a ``KvgraftError`` naming why not
    (module docstring: every check, in order). Raises ``FileNotFoundError`` when no block is stored.

    The bytes are read into ``allocate(size)`` (a ``bytearray`` unless the caller hands out other
    memory, such as the connector's shared-memory files) and hashed while read; the buffer returned
    holds exactly the bytes hashed and checked."""
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
    data, got = _read_hashed(directory / KV_FILE, max_file_bytes(claim.binding), allocate)
    if hex_of(got) != typed.subject[0].digest.sha256:
        raise BlockFileError(f"{KV_FILE} has digest {got}, but the signed statement says sha256:{typed.subject[0].digest.sha256}")
    _check_tensors(data, claim.binding)
    return data
