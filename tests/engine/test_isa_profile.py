"""Instruction-set-level profiles: the level pinned (ATen's kernels, MKL's reproducible branch,
oneDNN's ceiling), not the CPU's model name; each command a process of its own, started with the
level's environment, as a user on another machine of the same level would run it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvgraft.engine import ProfileMismatchError, cpu_description, current_profile
from kvgraft.engine._internal import profiles
from kvgraft.engine._internal.profiles import ISA_LEVELS, IsaLevel

PREFIX = "The quick brown fox jumps over the lazy dog. " * 8
CONTINUATION = " And then, after a long pause, the dog woke up."


def _supported(level: IsaLevel) -> bool:
    return level.name in cpu_description()["isa_levels"]


def _kvgraft(home: Path, level: IsaLevel | None, *args: object) -> dict[str, object]:
    env = {**os.environ, "KVGRAFT_HOME": str(home)}
    for var in ("ATEN_CPU_CAPABILITY", "MKL_CBWR", "ONEDNN_MAX_CPU_ISA"):
        env.pop(var, None)
    if level is not None:
        env.update(level.environment())
    done = subprocess.run([sys.executable, "-m", "kvgraft", "--json", *map(str, args)], capture_output=True, text=True, env=env,
                          timeout=300, check=False)
    out = json.loads(done.stdout.strip().splitlines()[-1]) if done.stdout.strip() else {}
    return {"code": done.returncode, "stderr": done.stderr, **out}


def _refused_here(home: Path, level: IsaLevel, texts: tuple[Path, Path]) -> None:
    """On a CPU without ``level`` the profile must refuse, naming the flags it lacks, before any
    kernel runs: torch may believe ``ATEN_CPU_CAPABILITY`` over a kernel that hides the level (a
    VM), and a kernel of that level then dies of SIGILL (exit -4) instead."""
    done = _kvgraft(home, level, "fresh", "--model", "tiny-llama-test", "--profile", f"cpu-fp32-{level.name}",
                    "--prefix-file", texts[0], "--text-file", texts[1])
    assert done["code"] == 1, done["stderr"]
    assert f"profile level {level.name} needs CPU flags this CPU lacks: {level.cpu_flags[0]}" in str(done["stderr"]), done["stderr"]


@pytest.fixture()
def texts(tmp_path: Path) -> tuple[Path, Path]:
    (tmp_path / "prefix.txt").write_text(PREFIX)
    (tmp_path / "cont.txt").write_text(CONTINUATION)
    return tmp_path / "prefix.txt", tmp_path / "cont.txt"


@pytest.mark.parametrize("name", sorted(ISA_LEVELS))
def test_a_level_capture_grafts_exactly_in_another_process_of_the_level(name: str, tmp_path: Path, texts: tuple[Path, Path],
                                                                         kvgraft_home: Path) -> None:
    level = ISA_LEVELS[name]
    if not _supported(level):
        _refused_here(kvgraft_home, level, texts)
        return
    profile = f"cpu-fp32-{name}"
    prefix, cont = texts
    art = tmp_path / "a"
    captured = _kvgraft(kvgraft_home, level, "capture", "--model", "tiny-llama-test", "--profile", profile, "--text-file", prefix,
                        "--out", art)
    assert captured["code"] == 0, captured["stderr"]
    from kvgraft.schemas import payload_unverified

    signed = json.loads(payload_unverified((art / "statement.dsse.json").read_bytes()))["predicate"]["profile"]
    # The level and the pins, never the CPU's model name.
    assert signed["device_fingerprint"] == "x86_64; isa-level=" + name + "; " + "; ".join(
        f"{k}={v}" for k, v in level.environment().items())
    grafted = _kvgraft(kvgraft_home, level, "graft", "--artifact", art, "--profile", profile, "--text-file", cont, "--trust-local-key")
    fresh = _kvgraft(kvgraft_home, level, "fresh", "--model", "tiny-llama-test", "--profile", profile, "--prefix-file", prefix,
                     "--text-file", cont)
    assert grafted["code"] == fresh["code"] == 0, grafted["stderr"] + fresh["stderr"]
    assert grafted["logits_sha256"] == fresh["logits_sha256"]
    # Started without the level's environment, the same profile is refused, naming the command.
    plain = _kvgraft(kvgraft_home, None, "graft", "--artifact", art, "--profile", profile, "--text-file", cont, "--trust-local-key")
    assert plain["code"] == 1 and f"profile level {name} needs this process started with {level.command_prefix()}" in plain["stderr"]


def test_the_two_levels_give_the_same_tokens_and_refuse_each_others_artifacts(tmp_path: Path, texts: tuple[Path, Path],
                                                                             kvgraft_home: Path) -> None:
    v3, v4 = ISA_LEVELS["x86-64-v3"], ISA_LEVELS["x86-64-v4"]
    if not (_supported(v3) and _supported(v4)):
        for level in (v3, v4):
            if not _supported(level):
                _refused_here(kvgraft_home, level, texts)
        return
    prefix, cont = texts
    args = ("fresh", "--model", "tiny-llama-test", "--prefix-file", prefix, "--text-file", cont)
    at_v3 = _kvgraft(kvgraft_home, v3, *args, "--profile", "cpu-fp32-x86-64-v3")
    at_v4 = _kvgraft(kvgraft_home, v4, *args, "--profile", "cpu-fp32-x86-64-v4")
    assert at_v3["code"] == at_v4["code"] == 0
    assert at_v3["argmax"] == at_v4["argmax"]
    art = tmp_path / "v4"
    assert _kvgraft(kvgraft_home, v4, "capture", "--model", "tiny-llama-test", "--profile", "cpu-fp32-x86-64-v4", "--text-file", prefix,
                    "--out", art)["code"] == 0
    refused = _kvgraft(kvgraft_home, v3, "graft", "--artifact", art, "--profile", "cpu-fp32-x86-64-v3", "--text-file", cont,
                       "--trust-local-key")
    assert refused["code"] == 1 and "profile.device_fingerprint" in refused["stderr"], refused["stderr"]


def test_a_level_profile_is_refused_in_a_process_not_started_with_it() -> None:
    # This test process was started without any level's environment.
    level = ISA_LEVELS["x86-64-v3"]
    with pytest.raises(ProfileMismatchError, match=r"ATEN_CPU_CAPABILITY=\(unset\)") as e:
        current_profile("cpu-fp32-x86-64-v3")
    assert level.command_prefix() in (e.value.hint or "")


def test_sigill_regression_a_level_the_cpu_lacks_is_refused_by_the_kernels_flags_not_torchs_word(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The bug: on a VM whose kernel hides AVX-512, torch still reported AVX512 when told
    # ATEN_CPU_CAPABILITY=avx512, the check passed, and loading the model died of SIGILL. The
    # flags are the kernel's (/proc/cpuinfo); here a CPU of level v3 only, on any machine.
    v3, v4 = ISA_LEVELS["x86-64-v3"], ISA_LEVELS["x86-64-v4"]
    monkeypatch.setattr(profiles, "_cpuinfo", lambda field: " ".join(v3.cpu_flags) if field == "flags" else None)
    for k, v in v4.environment().items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ProfileMismatchError, match="profile level x86-64-v4 needs CPU flags this CPU lacks: avx512f, avx512bw") as e:
        current_profile("cpu-fp32-x86-64-v4")
    assert e.value.hint == "choose a level this CPU has: --profile cpu-fp32-x86-64-v3"


def test_cpu_description_names_the_levels_whose_flags_the_kernel_reports(monkeypatch: pytest.MonkeyPatch) -> None:
    # What a cross-machine replay records of each CPU: a v3-only CPU lists v3, not v4.
    v3 = ISA_LEVELS["x86-64-v3"]
    monkeypatch.setattr(profiles, "_cpuinfo",
                        lambda field: " ".join(v3.cpu_flags) if field == "flags" else "Test CPU" if field == "model name" else None)
    described = cpu_description()
    assert described["cpu_model"] == "Test CPU"
    assert described["isa_levels"] == ["x86-64-v3"]
    monkeypatch.setattr(profiles, "_cpuinfo", lambda field: "sse2" if field == "flags" else None)
    assert cpu_description()["isa_levels"] == []
