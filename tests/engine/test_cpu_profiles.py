"""A profile that needs CPU flags (``ProfileSettings.cpu_flags``) is refused by name, in one line
naming the flags the CPU lacks and the profile to use, before any kernel runs.

``make test`` on an AVX2-only AMD EPYC failed 18 tests, every one under ``cpu-bf16-sdpa``, with
torch's ``RuntimeError: mkldnn_reorder_linear_weight: bf16 path needs the cpu support
avx_ne_convert or avx512bw, avx512vl and avx512dq``. These tests emulate such a CPU on any
machine: its flags by replacing the ``/proc/cpuinfo`` reader, and oneDNN's view of it with
``ONEDNN_MAX_CPU_ISA=AVX2`` (which torch honours; it is read once, so in a fresh process).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvgraft.engine import ProfileMismatchError, current_profile
from kvgraft.engine._internal import profiles
from tests.engine.cpu_support import BF16_KERNELS

#: The flags an AVX2-only x86-64 CPU reports (an AMD EPYC's, the AVX-512 and AVX-NE-CONVERT ones absent).
AVX2_FLAGS = ("fpu sse sse2 ssse3 sse4_1 sse4_2 popcnt aes pclmulqdq avx avx2 f16c fma bmi1 bmi2 movbe xsave adx sha_ni "
              "rdrand rdseed")
REFUSAL = ("profile cpu-bf16-sdpa needs CPU flags this CPU lacks: avx512bw, avx512vl and avx512dq, or avx_ne_convert "
           "(/proc/cpuinfo)")
HINT = "use --profile cpu-fp32-sdpa, the default, which runs on any x86-64 CPU"


def test_avx2_only_cpu_regression_bf16_profile_is_refused_by_name_not_by_torchs_runtime_error(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(profiles, "_cpuinfo", lambda field: AVX2_FLAGS if field == "flags" else None)
    for name in ("cpu-bf16-sdpa", "bf16"):
        with pytest.raises(ProfileMismatchError) as e:
            current_profile(name)
        assert (e.value.message, e.value.hint) == (REFUSAL, HINT)
        assert str(e.value) == f"{REFUSAL} (hint: {HINT})" and "\n" not in str(e.value)
    # The profile the hint names runs on the same CPU, as every float32 profile without a level does.
    assert current_profile("cpu-fp32-sdpa").name == "cpu-fp32-sdpa"
    assert current_profile().name == "cpu-fp32-sdpa"


def test_a_cpu_with_either_set_of_flags_runs_the_bf16_profile(monkeypatch: pytest.MonkeyPatch) -> None:
    # torch's check is an or: AVX-512 BW, VL and DQ (Intel since Skylake-SP, AMD since Zen 4), or
    # AVX-NE-CONVERT (Intel's AVX2-only cores since Sierra Forest); a part of one set is not enough.
    for extra in ("avx512bw avx512vl avx512dq", "avx_ne_convert"):
        monkeypatch.setattr(profiles, "_cpuinfo", lambda field, extra=extra: f"{AVX2_FLAGS} {extra}" if field == "flags" else None)
        profiles._require_cpu_flags("cpu-bf16-sdpa", profiles.PROFILES["cpu-bf16-sdpa"])
    monkeypatch.setattr(profiles, "_cpuinfo", lambda field: f"{AVX2_FLAGS} avx512f avx512bw avx512vl" if field == "flags" else None)
    with pytest.raises(ProfileMismatchError, match="^profile cpu-bf16-sdpa needs CPU flags this CPU lacks: avx512dq, or "
                                                   "avx_ne_convert "):
        profiles._require_cpu_flags("cpu-bf16-sdpa", profiles.PROFILES["cpu-bf16-sdpa"])


def test_every_cpu_bfloat16_profile_needs_the_flags_onednns_bfloat16_kernels_need() -> None:
    # One rule: every CPU profile computing in bfloat16 packs its weights for oneDNN (placed).
    cpu_bf16 = {name for name, s in profiles.PROFILES.items() if s.device == "cpu" and s.dtype == "bfloat16"}
    assert "cpu-bf16-sdpa" in cpu_bf16
    assert {name: profiles.PROFILES[name].cpu_flags for name in cpu_bf16} == dict.fromkeys(cpu_bf16, profiles.BF16_CPU_FLAGS)


def test_the_flag_rule_agrees_with_torchs_own_check_on_this_cpu() -> None:
    # kvgraft refuses the profile exactly where torch's packing would raise: on every CPU this
    # runs on, its flag rule is torch's check (a process capped by ONEDNN_MAX_CPU_ISA differs
    # from its CPU; the refusal still follows torch there).
    rule = any(set(option) <= (profiles._cpu_flags() or frozenset()) for option in profiles.BF16_CPU_FLAGS)
    if "ONEDNN_MAX_CPU_ISA" not in os.environ:
        assert rule == BF16_KERNELS
    try:
        current_profile("cpu-bf16-sdpa")
        runs = True
    except ProfileMismatchError:
        runs = False
    assert runs == BF16_KERNELS


# ``kvgraft capture ARGS`` run twice in a fresh process: first on an AVX2-only CPU's flags
# (sys.argv[1]), then on the flags this test process reads (sys.argv[2]); each exit status on a
# line of stdout.
_CLI_TWICE = """
import sys
from kvgraft.cli import main
from kvgraft.engine._internal import profiles
for flags in sys.argv[1:3]:
    profiles._cpuinfo = lambda field: flags if field == "flags" else None
    print(main(sys.argv[3:]), flush=True)
"""


def test_avx2_only_cpu_regression_kvgraft_capture_refuses_the_bf16_profile_in_one_line(kvgraft_home: Path, tmp_path: Path) -> None:
    # As on the AVX2-only EPYC: oneDNN capped at AVX2 (torch's own check says no bfloat16
    # kernels, and packing raised its RuntimeError here too before the refusal), with the CPU's
    # flags first an AVX2-only CPU's, then this one's.
    text = tmp_path / "t.txt"
    text.write_text("Hello, world.")
    out = tmp_path / "art"
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2", "KVGRAFT_HOME": str(kvgraft_home)}
    here = profiles._cpu_flags() or frozenset()
    r = subprocess.run([sys.executable, "-c", _CLI_TWICE, AVX2_FLAGS, " ".join(sorted(here)), "capture", "--model", "tiny-llama-test", "--profile",
                        "bf16", "--text-file", str(text), "--out", str(out)],
                       env=env, capture_output=True, text=True, timeout=300, check=False)
    assert (r.returncode, r.stdout) == (0, "1\n1\n"), r.stderr
    lines = r.stderr.splitlines()
    assert lines[0] == f"kvgraft: ProfileMismatchError: {REFUSAL} (hint: {HINT})"
    if any(set(option) <= here for option in profiles.BF16_CPU_FLAGS):
        # This CPU has the flags: the cap is what the refusal names.
        assert lines[1:] == ["kvgraft: ProfileMismatchError: profile cpu-bf16-sdpa needs oneDNN's bfloat16 kernels, which "
                             f"torch does not enable in this process (ONEDNN_MAX_CPU_ISA=AVX2 caps them) (hint: {HINT}, or "
                             "start the process without ONEDNN_MAX_CPU_ISA)"]
    else:
        assert lines[1:] == lines[:1]
    assert not out.exists()
