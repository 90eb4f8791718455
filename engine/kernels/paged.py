"""Scatter an artifact's keys and values into a paged block cache and gather them back.

The paged cache of one layer is two tensors ``[num_blocks, block_size, kv_heads, head_dim]``
(keys, values), the layout vLLM's flash-attention backend uses. A sequence owns the blocks its
block table lists: position ``p`` lives in slot ``block_table[p // block_size] * block_size +
p % block_size``. An artifact's layer tensors are ``[1, kv_heads, tokens, head_dim]``
(``docs/artifacts.md``). Both directions are pure copies, so kernel and reference agree bit for
bit by construction; the tests check it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.weak import WeakIdKeyDictionary

from kvgraft.engine._internal.kernel_errors import KernelError

from .backend import Backend, block_for, choose, kernels

#: Tokens per cache block.
BLOCK_SIZE = 16


def slot_mapping(block_table: torch.Tensor, start: int, length: int, *, block_size: int = BLOCK_SIZE) -> torch.Tensor:
    """The cache slots of positions ``[start, start + length)`` of the sequence ``block_table``
    describes, int64 ``[length]``."""
    if block_table.dim() != 1 or block_table.dtype not in (torch.int32, torch.int64):
        raise KernelError(f"a block table is a 1-D integer tensor, not {block_table.dtype} {tuple(block_table.shape)}")
    if start < 0 or length < 0:
        raise KernelError(f"positions [{start}, {start + length}) are not a range", hint="start and length are >= 0")
    needed = -(-(start + length) // block_size)
    if needed > block_table.numel():
        raise KernelError(f"positions up to {start + length} need {needed} blocks; "
                          f"the block table lists {block_table.numel()}",
                          hint="allocate more blocks to the sequence")
    pos = torch.arange(start, start + length, device=block_table.device)
    return block_table.to(torch.int64)[pos // block_size] * block_size + pos % block_size


def _check(
    keys: torch.Tensor, values: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, slots: torch.Tensor
) -> None:
    if keys.dim() != 4 or keys.shape[0] != 1 or keys.shape != values.shape:
        raise KernelError("artifact keys and values must both be [1, kv_heads, tokens, head_dim], "
                          f"got {tuple(keys.shape)} and {tuple(values.shape)}")
    if key_cache.dim() != 4 or key_cache.shape != value_cache.shape:
        raise KernelError("a paged cache is [num_blocks, block_size, kv_heads, head_dim] for keys and values, "
                          f"got {tuple(key_cache.shape)} and {tuple(value_cache.shape)}")
    if key_cache.shape[2:] != keys.shape[1:2] + keys.shape[3:]:
        raise KernelError(f"the cache holds {key_cache.shape[2]} heads of {key_cache.shape[3]}; "
                          f"the artifact {keys.shape[1]} of {keys.shape[3]}",
                          hint="use a cache made for this model")
    if keys.dtype != key_cache.dtype or values.dtype != value_cache.dtype:
        raise KernelError(f"dtype {keys.dtype} does not match the cache's {key_cache.dtype}")
    if slots.dim() != 1 or slots.numel() != keys.shape[2]:
        raise KernelError(f"{slots.numel()} slots for {keys.shape[2]} tokens", hint="compute them with slot_mapping")
    _check_range(slots, key_cache)
    if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        raise KernelError("the paged cache tensors must be contiguous")


def _check_range(slots: torch.Tensor, cache: torch.Tensor) -> None:
    """Every slot lies in ``cache``'s ``num_blocks * block_size`` slots."""
    capacity = cache.shape[0] * cache.shape[1]
    facts = _facts(slots)
    if facts.low < 0 or facts.high >= capacity:
        raise KernelError(f"slots run outside the cache's {capacity} slots")


@dataclass(frozen=True)
class _SlotFacts:
    """What the kernels check of a slot tensor: its least and greatest slot (0 and -1 when
    empty), and ``run``, ``s`` when the slots are ``s, s + 1, ..., s + n - 1`` (a sequence whose
    blocks were allocated in order, as a restore's pool allocates them), else None."""

    version: int
    low: int
    high: int
    run: int | None


#: Facts by slot tensor (by identity, held weakly), each valid while the tensor's version counter
#: (bumped by every in-place write) is the one recorded: a restore scatters the same few slot
#: tensors into every layer, and computing the facts anew (a reduction, an arange, a compare)
#: cost more than copying a 16-token segment.
_FACTS = WeakIdKeyDictionary()


def _facts(slots: torch.Tensor) -> _SlotFacts:
    """``slots``' facts, from ``_FACTS`` where its version still matches (an inference tensor
    has no version counter: its facts are computed every time)."""
    remembered = not slots.is_inference()
    version = slots._version if remembered else -1
    known: _SlotFacts | None = _FACTS.get(slots) if remembered else None
    if known is not None and known.version == version:
        return known
    n = slots.numel()
    if n == 0:
        facts = _SlotFacts(version, 0, -1, None)
    else:
        low, high = (int(x) for x in torch.aminmax(slots))
        first = int(slots[0])
        # A run's ends give it away; only then is the whole of it compared.
        is_run = low == first and high == first + n - 1 and torch.equal(
            slots, torch.arange(first, first + n, dtype=slots.dtype, device=slots.device))
        facts = _SlotFacts(version, low, high, first if is_run else None)
    if remembered:
        _FACTS[slots] = facts
    return facts


def _run_start(slots: torch.Tensor) -> int | None:
    """``s`` when ``slots`` is the run ``s, s + 1, ..., s + n - 1``, else None."""
    return _facts(slots).run


def scatter_kv_reference(
    keys: torch.Tensor, values: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, slots: torch.Tensor
) -> None:
    """Write artifact keys/values ``[1, H, t, d]`` into cache slots ``slots`` (torch)."""
    _check(keys, values, key_cache, value_cache, slots)
    _scatter_checked(keys, values, key_cache, value_cache, slots)


def _scatter_checked(
    keys: torch.Tensor, values: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, slots: torch.Tensor
) -> None:
    """``scatter_kv_reference`` past its checks (``scatter_kv`` made them already)."""
    h, d = key_cache.shape[2], key_cache.shape[3]
    # A run of slots is a slice of the flat cache: one strided copy instead of an indexed write
    # (the same bytes land in the same slots, 2-3x faster on the CPU).
    flat_k, flat_v = key_cache.view(-1, h, d), value_cache.view(-1, h, d)  # [slots, H, d]
    start = _run_start(slots)
    if start is not None:
        rows = slice(start, start + slots.numel())
        flat_k[rows].copy_(keys[0].transpose(0, 1))  # [H, t, d] -> [t, H, d]
        flat_v[rows].copy_(values[0].transpose(0, 1))
        return
    flat_k[slots] = keys[0].transpose(0, 1)  # [H, t, d] -> [t, H, d] into [slots, H, d]
    flat_v[slots] = values[0].transpose(0, 1)


def gather_kv_reference(
    key_cache: torch.Tensor, value_cache: torch.Tensor, slots: torch.Tensor,
    *, out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Read cache slots ``slots`` back into artifact layout ``[1, H, t, d]`` (torch): new dense
    tensors, or ``out``'s (any strides; a wider float dtype widens exactly)."""
    h, d = key_cache.shape[2], key_cache.shape[3]
    flat_k, flat_v = key_cache.view(-1, h, d), value_cache.view(-1, h, d)  # [slots, H, d]
    start = _run_start(slots)
    # A run is a slice: one copy into the dense layout, no indexed gather before it.
    rows = slice(start, start + slots.numel()) if start is not None else slots
    src_k = flat_k[rows].transpose(0, 1)[None]  # [t, H, d] -> [1, H, t, d]
    src_v = flat_v[rows].transpose(0, 1)[None]
    if out is None:
        # A copy always: with one KV head the slice is already dense, and ``contiguous`` would
        # hand back a view of the cache, which the cache's next writes would change.
        return src_k.clone(memory_format=torch.contiguous_format), src_v.clone(memory_format=torch.contiguous_format)
    out[0].copy_(src_k)
    out[1].copy_(src_v)
    return out


def scatter_kv(
    keys: torch.Tensor,
    values: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slots: torch.Tensor,
    *,
    backend: Backend = "auto",
) -> None:
    """Write artifact keys/values ``[1, H, t, d]`` into the paged cache at ``slots``, in place."""
    _check(keys, values, key_cache, value_cache, slots)
    if choose(backend, keys, values, key_cache, value_cache, slots) == "torch":
        _scatter_checked(keys, values, key_cache, value_cache, slots)
        return
    t, h, d = keys.shape[2], keys.shape[1], keys.shape[3]
    if t == 0:
        return
    if keys.stride() != values.stride():
        # One set of source strides serves both: give them the same layout.
        keys, values = keys.contiguous(), values.contiguous()
    # Source strides in elements (the artifact is read in place, whatever its layout); a cache
    # slot is h * d elements, a head d, an element 1.
    kernels().scatter_kv[(t, h)](
        keys, values, key_cache, value_cache, slots.to(torch.int64).contiguous(),
        keys.stride(2), keys.stride(1), keys.stride(3), h * d, d, 1, d,
        BLOCK_D=block_for(d),
    )


def gather_kv(
    key_cache: torch.Tensor, value_cache: torch.Tensor, slots: torch.Tensor, *,
    out: tuple[torch.Tensor, torch.Tensor] | None = None, backend: Backend = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Read the paged cache at ``slots`` back into artifact layout ``[1, H, t, d]``: new dense
    tensors, or written into ``out`` (two ``[1, H, t, d]`` tensors on the cache's device, any
    strides whose last is 1, the cache's dtype or a wider float one: the values widen exactly),
    which is returned."""
    contiguous = key_cache.is_contiguous() and value_cache.is_contiguous()
    if key_cache.dim() != 4 or key_cache.shape != value_cache.shape or not contiguous:
        raise KernelError("a paged cache is two contiguous [num_blocks, block_size, kv_heads, head_dim] tensors, "
                          f"got {tuple(key_cache.shape)} and {tuple(value_cache.shape)}")
    if slots.dim() != 1:
        raise KernelError(f"slots must be 1-D, got {tuple(slots.shape)}")
    _check_range(slots, key_cache)
    h, d, t = key_cache.shape[2], key_cache.shape[3], slots.numel()
    if out is not None:
        _check_out(out, key_cache, (1, h, t, d))
    if choose(backend, key_cache, value_cache, slots) == "torch":
        return gather_kv_reference(key_cache, value_cache, slots, out=out)
    keys, values = out if out is not None else (key_cache.new_empty(1, h, t, d), value_cache.new_empty(1, h, t, d))
    if keys.stride() != values.stride():
        raise KernelError("gather_kv's two outputs must have the same strides", hint="allocate them alike")
    if t:
        kernels().gather_kv[(t, h)](
            key_cache, value_cache, slots.to(torch.int64).contiguous(), keys, values,
            h * d, d, 1, keys.stride(2), keys.stride(1), keys.stride(3), d,
            BLOCK_D=block_for(d),
        )
    return keys, values


#: The half-precision cache dtypes a float32 output widens exactly.
_HALVES = (torch.float16, torch.bfloat16)


def _check_out(out: tuple[torch.Tensor, torch.Tensor], cache: torch.Tensor, shape: tuple[int, int, int, int]) -> None:
    """``out`` can take a gather of ``shape`` from ``cache`` without losing a bit."""
    for t in out:
        widens = t.dtype == cache.dtype or (t.dtype == torch.float32 and cache.dtype in _HALVES)
        if tuple(t.shape) != shape or t.device != cache.device or t.stride(-1) != 1 or not widens:
            raise KernelError(f"gather_kv cannot write a {shape} {cache.dtype} gather into a {tuple(t.shape)} "
                              f"{t.dtype} tensor on {t.device} with strides {t.stride()}",
                              hint="pass [1, H, t, d] tensors on the cache's device, last stride 1, dtype the cache's or wider")
