"""The Triton kernels' bodies, jitted on first use (``build``) so that ``TRITON_INTERPRET`` is read
when a kernel is first launched, not when this module is imported.

Imported only where ``triton`` is installed. No ``from __future__ import annotations`` here:
Triton reads the ``tl.constexpr`` annotations as objects.
"""

import functools
import os
from types import SimpleNamespace

import triton
import triton.language as tl


def _scatter_kv(
    keys, values, key_cache, value_cache, slots,
    src_t, src_h, src_d, dst_slot, dst_h, dst_d, head_dim,
    BLOCK_D: tl.constexpr,
):
    # One program per (token, kv head): copy one head_dim vector of keys and one of values.
    token = tl.program_id(0)
    head = tl.program_id(1)
    offs = tl.arange(0, BLOCK_D)
    inside = offs < head_dim
    slot = tl.load(slots + token)
    src = token * src_t + head * src_h + offs * src_d
    dst = slot * dst_slot + head * dst_h + offs * dst_d
    tl.store(key_cache + dst, tl.load(keys + src, mask=inside), mask=inside)
    tl.store(value_cache + dst, tl.load(values + src, mask=inside), mask=inside)


def _gather_kv(
    key_cache, value_cache, slots, keys, values,
    src_slot, src_h, src_d, dst_t, dst_h, dst_d, head_dim,
    BLOCK_D: tl.constexpr,
):
    # The inverse of _scatter_kv: one (token, kv head) vector from the cache slot to the output.
    token = tl.program_id(0)
    head = tl.program_id(1)
    offs = tl.arange(0, BLOCK_D)
    inside = offs < head_dim
    slot = tl.load(slots + token)
    src = slot * src_slot + head * src_h + offs * src_d
    dst = token * dst_t + head * dst_h + offs * dst_d
    tl.store(keys + dst, tl.load(key_cache + src, mask=inside), mask=inside)
    tl.store(values + dst, tl.load(value_cache + src, mask=inside), mask=inside)


def _rerotate(
    keys, out, cos, sin,
    src_h, src_t, dst_h, dst_t, tokens, half,
    BLOCK_HALF: tl.constexpr, OUT_BF16: tl.constexpr,
):
    # One program per (kv head, token): out = k * cos + rotate_half(k) * sin, with
    # rotate_half(k) = [-k2, k1], computed in float32 with the same three roundings per element
    # as the torch reference, then rounded once to the keys' dtype (to nearest, ties to even) on
    # the store. For bfloat16 the rounding is spelled out on the bits: Triton's CPU interpreter
    # truncates a float32 -> bfloat16 cast where a GPU rounds it.
    row = tl.program_id(0)
    head = row // tokens
    token = row % tokens
    offs = tl.arange(0, BLOCK_HALF)
    inside = offs < half
    src = keys + head * src_h + token * src_t
    dst = out + head * dst_h + token * dst_t
    k1 = tl.load(src + offs, mask=inside).to(tl.float32)
    k2 = tl.load(src + half + offs, mask=inside).to(tl.float32)
    c1 = tl.load(cos + offs, mask=inside).to(tl.float32)
    c2 = tl.load(cos + half + offs, mask=inside).to(tl.float32)
    s1 = tl.load(sin + offs, mask=inside).to(tl.float32)
    s2 = tl.load(sin + half + offs, mask=inside).to(tl.float32)
    first = k1 * c1 + (-k2) * s1
    second = k2 * c2 + k1 * s2
    if OUT_BF16:
        bits1 = first.to(tl.uint32, bitcast=True)
        bits2 = second.to(tl.uint32, bitcast=True)
        # Round to nearest even: add 0x7fff plus the lowest kept bit, keep the high 16 bits.
        first = ((bits1 + 0x7FFF + ((bits1 >> 16) & 1)) >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        second = ((bits2 + 0x7FFF + ((bits2 >> 16) & 1)) >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    tl.store(dst + offs, first.to(out.dtype.element_ty), mask=inside)
    tl.store(dst + half + offs, second.to(out.dtype.element_ty), mask=inside)


@functools.cache
def _build(interpret: bool) -> SimpleNamespace:
    # `interpret` keys the cache: triton.jit picks the interpreter when TRITON_INTERPRET=1.
    return SimpleNamespace(
        scatter_kv=triton.jit(_scatter_kv), gather_kv=triton.jit(_gather_kv), rerotate=triton.jit(_rerotate),
    )


def build() -> SimpleNamespace:
    """The jitted kernels for the current ``TRITON_INTERPRET`` setting."""
    return _build(os.environ.get("TRITON_INTERPRET", "0").lower() in {"1", "true", "on", "yes"})


def next_power_of_2(n: int) -> int:
    """Triton block sizes are powers of two."""
    return triton.next_power_of_2(n)
