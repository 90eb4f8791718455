"""Re-rotate cached keys by a further RoPE angle, for grafts shifted to other positions.

RoPE rotations compose: a key rotated for position ``p`` becomes the key for ``p + k`` when
rotated by the angle of ``k``. ``cos``/``sin`` are the model's own for a shift of ``k``
positions (per layer base for Gemma 3), ``[head_dim]`` or anything that broadcasts to it. The
result is approximate as a graft (it is not what recomputing at ``p + k`` gives), but kernel and
reference agree bit for bit: both do ``k * cos + rotate_half(k) * sin`` in float32 with the same
three roundings per element (no fused multiply-add), then round once to the keys' dtype (a no-op
for float32 keys; for bfloat16 or float16 keys it fixes what the arithmetic rounds to, which
otherwise would depend on whether a backend rounds each operation or only the result).

``rerotate`` is the engine's one re-rotation: ``KVState.restore(..., shift=k)`` calls it
on every layer's keys, so a shifted graft, the kernel and this reference compute one thing.
"""

from __future__ import annotations

import torch

from kvgraft.engine._internal.kernel_errors import KernelError

from .backend import Backend, block_for, choose, kernels


def _angles(keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    d = keys.shape[-1]
    if keys.dim() != 4 or d % 2:
        raise KernelError(
            f"keys must be [batch, kv_heads, tokens, head_dim] with an even head_dim, got {tuple(keys.shape)}"
        )
    if cos.numel() != d or sin.numel() != d:
        raise KernelError(f"cos and sin must hold one angle per head dimension ({d}), "
                          f"got {cos.numel()} and {sin.numel()}",
                          hint="a shift is one angle for every token")
    if cos.dtype != keys.dtype or sin.dtype != keys.dtype:
        raise KernelError(f"cos/sin dtype {cos.dtype} does not match the keys' {keys.dtype}")
    return cos.reshape(d), sin.reshape(d)  # [1, 1, 1, d] (the model's shape) -> [d]


def rerotate_reference(keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``keys * cos + rotate_half(keys) * sin`` in torch, for keys ``[B, H, t, d]``."""
    cos, sin = _angles(keys, cos, sin)
    half = keys.shape[-1] // 2
    wide, cos32, sin32 = keys.to(torch.float32), cos.to(torch.float32), sin.to(torch.float32)
    rotated_half = torch.cat([-wide[..., half:], wide[..., :half]], dim=-1)  # [B, H, t, d]
    return (wide * cos32 + rotated_half * sin32).to(keys.dtype)


def rerotate(keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, backend: Backend = "auto") -> torch.Tensor:
    """Rotate post-RoPE keys ``[B, H, t, d]`` by a further angle; a new tensor."""
    cos, sin = _angles(keys, cos, sin)
    if choose(backend, keys, cos, sin) == "torch":
        return rerotate_reference(keys, cos, sin)
    b, h, t, d = keys.shape
    rows = keys.reshape(b * h, t, d)  # [B, H, t, d] -> [B*H, t, d] (a view when it can be)
    out = torch.empty(b * h, t, d, dtype=keys.dtype, device=keys.device)
    if rows.stride(2) != 1:
        rows = rows.contiguous()
    if b * h * t:
        kernels().rerotate[(b * h * t,)](
            rows, out, cos.contiguous(), sin.contiguous(),
            rows.stride(0), rows.stride(1), out.stride(0), out.stride(1), t, d // 2,
            BLOCK_HALF=block_for(d // 2), OUT_BF16=keys.dtype == torch.bfloat16,
            # On a GPU the compiler may fuse k*c + r*s into one FMA, changing a rounding.
            enable_fp_fusion=False,
        )
    return out.view(b, h, t, d)  # [B*H, t, d] -> [B, H, t, d]
