"""Linear layers whose bfloat16 weights are laid out once for the CPU's matrix kernels.

``torch.nn.functional.linear`` on bfloat16 CPU tensors runs oneDNN's matmul, which lays the
weight out in its blocked format again on every call. A 20-token pass of smollm2-135m spent
50 ms in its 210 decoder weight products that way, 31 ms with each weight laid out once
(``torch.ops.mkldnn._reorder_linear_weight``, the layout inductor's weight freezing uses) and
multiplied by ``torch.ops.mkldnn._linear_pointwise`` (2 threads, AVX-512 EPYC).

Without AMX the products run the same oneDNN kernels and are equal to ``F.linear``'s bit for bit
(the test suite checks the registered models' layer shapes at 1 to 1,024 rows, with and without
bias, and smollm2-135m's output embedding at the rows a pass keeps; 4,096 rows were checked by
hand on an AVX-512 EPYC), so the ``cpu-bf16-sdpa`` records made before packing still hold there.
On a CPU with AMX (an Intel Xeon), oneDNN multiplies a weight laid out for ``ROWS_HINT`` rows
with other AMX kernels than the layout ``F.linear`` picks per call, for some shapes and row
counts: those products differ from ``F.linear``'s in the last bfloat16 bit, and are the same on
every call. The profile's exactness does not rest on matching ``F.linear``: capture, fresh
computation and graft all run the packed layers, and its fingerprint names the CPU.

The output embedding is packed too: one row per pass, but the largest matrix (49,152 x 576 for
smollm2-135m), whose product took 5.2 ms through ``F.linear`` and 2.6 ms packed. Its packed copy
costs its size again in memory (56 MB for smollm2-135m, 272 MB for qwen2.5-coder-0.5b), as every
packed layer's does: the plain weights stay for ties (most small models tie it to the input
embedding) and state dicts.

Where torch has no oneDNN (``torch.backends.mkldnn``), nothing is packed. Where oneDNN has no
bfloat16 kernels (an AVX2-only CPU, or ``ONEDNN_MAX_CPU_ISA`` capping them), a weight cannot be
laid out: ``PackedLinear`` refuses, and the profile was refused before that by name
(``profiles.BF16_CPU_FLAGS``).
"""

from __future__ import annotations

import torch

from .errors import ProfileMismatchError

#: Rows the layout is chosen for: a question's pass (any row count runs on it).
ROWS_HINT = 20


def can_pack() -> bool:
    """Whether this torch has the oneDNN linear ops the packed layers call."""
    ops = torch.ops.mkldnn
    return bool(torch.backends.mkldnn.is_available()) and hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise")


def bf16_kernels_enabled() -> bool:
    """Whether oneDNN runs bfloat16 kernels in this process, which laying a weight out needs:
    torch's own check (AVX-512 BW, VL and DQ, or AVX-NE-CONVERT, under any ``ONEDNN_MAX_CPU_ISA``
    cap). False where this torch cannot say (it then has no packing ops either)."""
    check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return bool(check()) if check is not None else False


class PackedLinear(torch.nn.Module):
    """``linear`` (bfloat16, on the CPU) with its weight laid out once for oneDNN.

    ``weight`` and ``bias`` stay the layer's own parameters (ties and state dicts are
    unchanged); the laid-out copy is ``packed``, a buffer made from them when the layer is made:
    a layer whose weight changes afterwards must be packed again (nothing in kvgraft changes a
    loaded model's weights).
    """

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        if linear.weight.dtype != torch.bfloat16 or linear.weight.device.type != "cpu":
            raise TypeError(f"only bfloat16 CPU weights are packed, not {linear.weight.dtype} on {linear.weight.device}")
        if not bf16_kernels_enabled():
            # torch's own error here is a bare RuntimeError from inside the reorder.
            raise ProfileMismatchError("oneDNN has no bfloat16 kernels in this process (an AVX2-only CPU, or ONEDNN_MAX_CPU_ISA "
                                       "caps them): bfloat16 weights cannot be packed",
                                       hint="use a float32 profile (the default, cpu-fp32-sdpa)")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        with torch.no_grad():
            packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), ROWS_HINT)
        self.register_buffer("packed", packed, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ weight.T + bias``: ``[..., in_features]`` -> ``[..., out_features]``."""
        bias = None if self.bias is None else self.bias.detach()
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")
        return out


def pack_linears(module: torch.nn.Module) -> int:
    """Replace every bfloat16 CPU ``nn.Linear`` below ``module``, the output embedding included,
    with a ``PackedLinear``, in place; how many were replaced (0 where ``can_pack`` is false)."""
    if not can_pack():
        return 0
    replaced = 0
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if (isinstance(child, torch.nn.Linear)
                    and child.weight.dtype == torch.bfloat16 and child.weight.device.type == "cpu"):
                setattr(parent, name, PackedLinear(child))
                replaced += 1
    return replaced
