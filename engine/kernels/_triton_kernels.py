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
    BLOCK_HALF: tl.constexpr,
):
    # One program per (kv head, token): out = k * cos + rotate_half(k) * sin, with
    # rotate_half(k) = [-k2, k1]; the same three roundings per element as the torch reference.
    row = tl.program_id(0)
    head = row // tokens
    token = row % tokens
    offs = tl.arange(0, BLOCK_HALF)
    inside = offs < half
    src = keys + head * src_h + token * src_t
    dst = out + head * dst_h + token * dst_t
    k1 = tl.load(src + offs, mask=inside)
    k2 = tl.load(src + half + offs, mask=inside)
    c1 = tl.load(cos + offs, mask=inside)
    c2 = tl.load(cos + half + offs, mask=inside)
    s1 = tl.load(sin + offs, mask=inside)
    s2 = tl.load(sin + half + offs, mask=inside)
    tl.store(dst + offs, k1 * c1 + (-k2) * s1, mask=inside)
    tl.store(dst + half + offs, k2 * c2 + k1 * s2, mask=inside)


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
