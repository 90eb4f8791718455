"""What this CPU runs, for the tests of a profile that needs CPU flags (``ProfileSettings.cpu_flags``).

A test of such a profile runs as it always did where the CPU has the flags; where it lacks them
(an AVX2-only CPU for ``cpu-bf16-sdpa``), it asserts kvgraft's refusal of the profile by name
instead. Which case holds is torch's own check, not kvgraft's, so a wrong flag rule fails a test
(``test_cpu_profiles.py`` checks that the rule and torch's check agree).
"""

from __future__ import annotations

import pytest
import torch

from kvgraft.engine import ProfileMismatchError, current_profile

#: Whether oneDNN runs bfloat16 kernels in this process: torch's check (AVX-512 BW, VL and DQ, or
#: AVX-NE-CONVERT, under any ONEDNN_MAX_CPU_ISA cap), the one its weight packing raises on.
BF16_KERNELS = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())

#: The refusal of a bfloat16 CPU profile: for the CPU's flags, or for oneDNN's cap in this process.
BF16_REFUSAL = (r"needs (CPU flags this CPU lacks: avx512bw, avx512vl and avx512dq, or avx_ne_convert \(/proc/cpuinfo\)"
                r"|oneDNN's bfloat16 kernels, which torch does not enable in this process)")


def bf16_runs_here(name: str = "cpu-bf16-sdpa") -> bool:
    """True where this CPU runs bfloat16 profile ``name``. Where it does not, assert that kvgraft
    refuses ``name`` by name, naming what is missing and the default profile, and return False:
    the calling test ends there, having checked the refusal instead."""
    if BF16_KERNELS:
        return True
    with pytest.raises(ProfileMismatchError, match=f"^profile {name} {BF16_REFUSAL}") as e:
        current_profile(name)
    assert (e.value.hint or "").startswith("use --profile cpu-fp32-sdpa, the default"), e.value.hint
    return False
