"""Determinism profiles: a named, frozen set of everything that can change a bit.

``current_profile(name)`` describes this machine under profile ``name``; ``applied(profile)``
pins threads and deterministic algorithms (and the KV cache's storage dtype, ``kv_dtype``) for
the span of a ``with`` block and restores the previous settings on exit; ``require_same``
refuses a graft whose profile differs, naming every differing field.

A profile's ``dtype`` names the weights' dtype and, when the cache stores another, the cache's:
``float32`` (both float32), ``float32+kv-float16`` (float32 weights and arithmetic; every key
and value rounded to float16 as it enters the cache, during capture, fresh computation and graft
alike, so artifacts hold half the bytes and a graft still equals its fresh computation bit for
bit within the profile) or ``bfloat16`` (weights, arithmetic and cache: ``cpu-bf16-sdpa`` and
the CUDA profiles; the loaded float32 weights are rounded once, in place, by ``placed``).
A profile whose kernels need CPU flags (``ProfileSettings.cpu_flags``: ``cpu-bf16-sdpa`` needs
oneDNN's bfloat16 kernels, AVX-512 BW/VL/DQ or AVX-NE-CONVERT) is refused by name on a CPU that
lacks them, before any kernel runs, with the profile to use instead.

An instruction-set-level profile (``cpu-fp32-x86-64-v3``, ``-v4``) pins the level every math
library torch calls dispatches to, not the CPU's model name: ATen's vector kernels
(``ATEN_CPU_CAPABILITY``), MKL's conditional numerical reproducibility (``MKL_CBWR``) and
oneDNN's ISA ceiling (``ONEDNN_MAX_CPU_ISA``). MKL runs its ``COMPATIBLE`` branch (SSE2 without
the approximate ``rcpps``/``rsqrtps``) at every level, strict: its AVX2 and AVX-512 branches are
Intel's only, and on any other CPU ``MKL_CBWR=AVX2`` silently runs MKL's ``AUTO`` branch
instead, which is why a record registered under ``MKL_CBWR=AVX2,STRICT`` on an AMD EPYC
replayed on an Intel Xeon with 43 of 50 samples equal (results/exactness). ``COMPATIBLE`` is
the one branch MKL supports, and keeps equal, on Intel and other x86 CPUs alike. It is slow: a
256 x 576 x 1,536 float32 product takes 3x as long as in the AVX2 branch, and smollm2-135m's
50-sample exactness experiment about 10x (2 threads, Intel Xeon). Each variable is read once
when its library starts, so the process must be started with them (``IsaLevel.command_prefix``);
``current_profile`` refuses one that was not, and a CPU whose kernel does not report the level's
flags (``/proc/cpuinfo``), before any kernel runs: torch takes ``ATEN_CPU_CAPABILITY`` at its
word on a VM that hides AVX-512, and its AVX-512 code would then die of SIGILL. An artifact
captured under a level then grafts bit-exactly on any machine that supports the level (and runs
the same torch, transformers and thread count).
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import platform
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import transformers

from kvgraft.schemas import DeterminismProfile, ExactnessLevel, ModelRef, Sha256Digest

from . import fast_attention, invariant
from .errors import ProfileMismatchError, UnknownModelError, UnknownProfileError
from .packed_linear import bf16_kernels_enabled, can_pack, pack_linears

if TYPE_CHECKING:
    from transformers import PreTrainedModel


@dataclass(frozen=True)
class IsaLevel:
    """An instruction-set level and the environment that pins every math library to it."""

    name: str
    #: ``ATEN_CPU_CAPABILITY``: ATen's vectorized kernels.
    aten: str
    #: What ``torch.backends.cpu.get_cpu_capability()`` then reports.
    torch_capability: str
    #: ``MKL_CBWR``: MKL's reproducible code branch, strict (``_MKL_PORTABLE`` at every level).
    mkl_cbwr: str
    #: ``ONEDNN_MAX_CPU_ISA``: the highest ISA oneDNN may use.
    onednn_max_isa: str
    #: The CPU flags (``/proc/cpuinfo``, the kernel's view) the level's code needs. Checked
    #: before torch's own report, which can claim a level the kernel has not enabled (a VM that
    #: hides AVX-512): code of that level then dies of SIGILL instead of being refused.
    cpu_flags: tuple[str, ...]

    def environment(self) -> dict[str, str]:
        """The variables the process must be started with."""
        return {"ATEN_CPU_CAPABILITY": self.aten, "MKL_CBWR": self.mkl_cbwr, "ONEDNN_MAX_CPU_ISA": self.onednn_max_isa}

    def command_prefix(self) -> str:
        """``env VAR=value ...``, to put before a command."""
        return _env_prefix(self.environment())


def _env_prefix(environment: dict[str, str]) -> str:
    """``env VAR=value ...``: the command prefix that starts a process with ``environment``."""
    return "env " + " ".join(f"{k}={v}" for k, v in environment.items())


def _unmet(environment: dict[str, str]) -> list[str]:
    """``VAR=actual`` for each variable of ``environment`` this process was not started with."""
    return [f"{k}={os.environ.get(k, '(unset)')}" for k, v in environment.items() if os.environ.get(k) != v]


#: MKL's branch at every level: the one it runs alike on every vendor's CPU (module docstring).
_MKL_PORTABLE = "COMPATIBLE,STRICT"

#: The x86-64 micro-architecture levels a profile can pin (psABI names).
ISA_LEVELS: dict[str, IsaLevel] = {
    "x86-64-v3": IsaLevel("x86-64-v3", aten="avx2", torch_capability="AVX2", mkl_cbwr=_MKL_PORTABLE, onednn_max_isa="AVX2",
                          cpu_flags=("avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "movbe", "xsave")),
    "x86-64-v4": IsaLevel("x86-64-v4", aten="avx512", torch_capability="AVX512", mkl_cbwr=_MKL_PORTABLE,
                          onednn_max_isa="AVX512_CORE", cpu_flags=("avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl")),
}


#: What oneDNN's bfloat16 kernels need, which every CPU bfloat16 profile runs (its weights packed
#: for them, packed_linear.py): AVX-512 BW, VL and DQ, or AVX-NE-CONVERT (torch's own check,
#: ``torch.ops.mkldnn._is_mkldnn_bf16_supported``). On an AVX2-only CPU packing dies of a
#: RuntimeError straight from torch ("bf16 path needs the cpu support avx_ne_convert or ...").
BF16_CPU_FLAGS: tuple[tuple[str, ...], ...] = (("avx512bw", "avx512vl", "avx512dq"), ("avx_ne_convert",))


@dataclass(frozen=True)
class ProfileSettings:
    """The knobs a named profile fixes; the rest of the profile is read off the machine."""

    exactness: ExactnessLevel
    threads: int
    attention_implementation: str
    matmul_tiling: str
    dtype: str = "float32"
    #: The dtype keys and values are stored in (rounded to as they enter the cache).
    kv_dtype: str = "float32"
    #: The instruction-set level pinned instead of the CPU's model name (``ISA_LEVELS``), if any.
    isa_level: str | None = None
    #: Where the model runs: ``cpu``, ``cuda`` (the first GPU) or ``llamacpp`` (llama.cpp on the
    #: CPU, on the GGUF itself: llamacpp.py).
    device: str = "cpu"
    #: The CPU flags (``/proc/cpuinfo``) the profile's kernels need, as alternatives: the CPU must
    #: report every flag of at least one tuple; empty: none (``current_profile`` refuses the
    #: profile by name on a CPU that lacks them, before any kernel runs).
    cpu_flags: tuple[tuple[str, ...], ...] = ()


#: The named profiles. ``cpu-fp32`` is own-position exact: a graft equals recomputing the same
#: prefix then the same continuation with the same schedule. ``cpu-fp32-invariant`` is
#: schedule-invariant exact: a graft plus its continuation equals one single-pass prefill, for
#: any chunking, batch and thread count (fixed-shape kernels, see invariant.py).
PROFILES: dict[str, ProfileSettings] = {
    "cpu-fp32": ProfileSettings(exactness="own-position", threads=2, attention_implementation="eager", matmul_tiling="default"),
    "cpu-fp32-invariant": ProfileSettings(
        exactness="schedule-invariant", threads=2, attention_implementation=invariant.ATTENTION_NAME,
        matmul_tiling=invariant.tiling_name(invariant.InvariantSettings()),
    ),
    # Half-size artifacts: own-position exact, the cache rounded to float16 (llama.cpp's default
    # cache type, so its f16 state is the size peer).
    "cpu-fp32-kv16": ProfileSettings(exactness="own-position", threads=2, attention_implementation="eager",
                                     matmul_tiling="default", kv_dtype="float16"),
    # The fast own-position profile: SDPA on the grouped K/V heads as they are (fast_attention.py).
    "cpu-fp32-sdpa": ProfileSettings(exactness="own-position", threads=2,
                                     attention_implementation=fast_attention.ATTENTION_NAME, matmul_tiling="default"),
    # Both: the fast attention on the half-size cache.
    "cpu-fp32-sdpa-kv16": ProfileSettings(exactness="own-position", threads=2, attention_implementation=fast_attention.ATTENTION_NAME,
                                          matmul_tiling="default", kv_dtype="float16"),
    # The CPU profile that races llama.cpp: bfloat16 weights, cache and arithmetic (the CPU's
    # bfloat16 dot products where it has them, half the bytes of weights and cache to read) and
    # SDPA on the grouped heads; own-position exact, as cpu-fp32-sdpa is. Rounding the weights to
    # bfloat16 makes it another model's numbers than the float32 profiles' (llama.cpp rounds its
    # activations to 8 bits for the same reason): an artifact grafts exactly only within it.
    "cpu-bf16-sdpa": ProfileSettings(exactness="own-position", threads=2, attention_implementation=fast_attention.ATTENTION_NAME,
                                     matmul_tiling="default", dtype="bfloat16", kv_dtype="bfloat16", cpu_flags=BF16_CPU_FLAGS),
    # Machine-independent within a level: the level pinned, not the CPU model (see the module docstring).
    **{f"cpu-fp32-{level}": ProfileSettings(exactness="own-position", threads=2, attention_implementation="eager",
                                            matmul_tiling="default", isa_level=level) for level in ISA_LEVELS},
    # On a GPU: bfloat16 weights, cache and arithmetic (no TF32, no reduced-precision
    # reductions), SDPA on the grouped heads; own-position exact, as cpu-fp32-sdpa is.
    "cuda-bf16": ProfileSettings(exactness="own-position", threads=1, attention_implementation=fast_attention.ATTENTION_NAME,
                                 matmul_tiling="default", dtype="bfloat16", kv_dtype="bfloat16", device="cuda"),
    # Batch-invariant on a GPU: the invariant kernels' fixed shapes (every linear layer a batch of
    # [16, K] x [K, 2048] GEMMs, so cuBLAS picks one algorithm, split-K or not, for every call;
    # attention over absolute-position key blocks summed in a fixed order), as Thinking Machines'
    # batch-invariant ops and vLLM's batch-invariant mode fix them.
    "cuda-bf16-invariant": ProfileSettings(
        exactness="schedule-invariant", threads=1, attention_implementation=invariant.ATTENTION_NAME,
        matmul_tiling=invariant.tiling_name(invariant.InvariantSettings()), dtype="bfloat16", kv_dtype="bfloat16", device="cuda",
    ),
    # llama.cpp on the pinned GGUF itself (its own quantized weights and kernels, f16 cache, flash
    # attention), at llama.cpp's speed; own-position exact. The context settings, the build and
    # the state format are pinned in llamacpp.py (SETTINGS, build_fingerprint).
    "llamacpp-cpu": ProfileSettings(exactness="own-position", threads=2, attention_implementation="llama.cpp-flash-attn",
                                    matmul_tiling="ggml", dtype="gguf", kv_dtype="float16", device="llamacpp"),
}
#: The profile a command runs under when none is named: the fast own-position one. ``cpu-fp32``
#: (eager attention, the repeated K/V heads materialised) stays for the artifacts made under it.
DEFAULT_PROFILE = "cpu-fp32-sdpa"
#: The profile the flywheel and ``engine serve`` run under when none is named (a new library's
#: deposits, an evaluation without a library, a server without one): llama.cpp on the GGUF, which
#: decodes 3-5x faster than the torch profiles on these CPUs (bench/results/llamacpp.json).
#: Where llama-cpp-python is not installed they fall back to ``DEFAULT_PROFILE`` (``flywheel_profile``).
FLYWHEEL_PROFILE = "llamacpp-cpu"


def flywheel_profile(model: str) -> str:
    """``FLYWHEEL_PROFILE`` for ``model`` where the pinned llama-cpp-python is installed and the
    model has a GGUF file; else ``DEFAULT_PROFILE`` (a model built in code, or no llama.cpp).

    Only for commands that make new state (a new library, an evaluation or a server without a
    library): what already exists keeps the profile it was made under (a library's metadata).
    """
    from . import llamacpp
    from .models import spec_for

    return FLYWHEEL_PROFILE if llamacpp.installed() and spec_for(model).gguf_file is not None else DEFAULT_PROFILE


#: Short names accepted wherever a profile is named (``--profile invariant``).
PROFILE_ALIASES: dict[str, str] = {
    "invariant": "cpu-fp32-invariant", "default": DEFAULT_PROFILE, "eager": "cpu-fp32", "kv16": "cpu-fp32-kv16",
    "sdpa": "cpu-fp32-sdpa",
    "sdpa-kv16": "cpu-fp32-sdpa-kv16",
    "bf16": "cpu-bf16-sdpa",
    "llamacpp": "llamacpp-cpu",
}
#: The storage dtypes a cache may have, by the name a profile's ``dtype`` gives them.
KV_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
#: The dtypes a profile's weights and arithmetic may have.
COMPUTE_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16}
#: What a CUDA profile's process must be started with: cuBLAS's deterministic workspace, which
#: ``torch.use_deterministic_algorithms`` needs and cuBLAS reads once, at its first call.
CUDA_ENVIRONMENT: dict[str, str] = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
_KV_MARK = "+kv-"
#: The cache dtype of the profile applied now (``applied``); float32 outside any.
_APPLIED_KV_DTYPE: contextvars.ContextVar[torch.dtype] = contextvars.ContextVar("kvgraft_kv_dtype", default=torch.float32)
#: The attention implementation of the profile applied now; None outside any (the model's own).
_APPLIED_ATTENTION: contextvars.ContextVar[str | None] = contextvars.ContextVar("kvgraft_attention", default=None)
#: Where the profile applied now runs the model, and in which dtype; the CPU in float32 outside any.
_APPLIED_PLACEMENT: contextvars.ContextVar[tuple[str, torch.dtype]] = contextvars.ContextVar(
    "kvgraft_placement", default=("cpu", torch.float32))


def compute_dtype(profile: DeterminismProfile) -> torch.dtype:
    """The dtype of ``profile``'s weights and arithmetic (the part of ``dtype`` before ``+kv-``)."""
    name = profile.dtype.partition(_KV_MARK)[0]
    try:
        return COMPUTE_DTYPES[name]
    except KeyError as e:
        raise UnknownModelError(f"profile {profile.name} computes in {name!r}, which kvgraft does not run",
                                hint=f"use a profile of {', '.join(PROFILES)}") from e


def kv_dtype(profile: DeterminismProfile) -> torch.dtype:
    """The dtype ``profile``'s cache stores keys and values in (see the module docstring)."""
    weights, mark, cache = profile.dtype.partition(_KV_MARK)
    name = cache if mark else weights
    try:
        return KV_DTYPES[name]
    except KeyError as e:
        raise UnknownModelError(f"profile {profile.name} names a cache dtype {name!r}, which kvgraft does not store",
                                hint=f"use a profile of {', '.join(PROFILES)}") from e


@contextlib.contextmanager
def pass_attention(module: PreTrainedModel) -> Iterator[None]:
    """For one forward pass of ``module``: the applied profile's attention implementation named
    in the module's config (transformers looks it up there at every layer), the previous name
    back after. Outside any profile, or when the names agree, nothing changes."""
    name = _APPLIED_ATTENTION.get()
    config = module.config
    previous = config._attn_implementation
    if name is None or name == previous:
        yield
        return
    config._attn_implementation = name
    try:
        yield
    finally:
        config._attn_implementation = previous


def applied_placement() -> tuple[torch.device, torch.dtype]:
    """The device and dtype the profile ``applied`` now runs the model in (the CPU in float32
    when none is)."""
    device, dtype = _APPLIED_PLACEMENT.get()
    return torch.device(device), dtype


def placed(module: PreTrainedModel) -> PreTrainedModel:
    """``module`` on the applied profile's device in its dtype, moved there in place on first use.

    A model is loaded on the CPU in float32. A CUDA profile moves it to the GPU in bfloat16;
    that rounds the weights, so the same loaded model is refused afterwards by a float32 profile
    (load it again) rather than silently run with rounded weights.
    """
    device, dtype = applied_placement()
    first = next(module.parameters())
    if first.device.type == device.type and first.dtype == dtype:
        return module
    if first.dtype != torch.float32:
        raise ProfileMismatchError(
            f"the model was moved to {first.device.type} {str(first.dtype).removeprefix('torch.')} for another profile; "
            f"this one runs it on {device.type} in {str(dtype).removeprefix('torch.')}",
            hint="load the model again (kvgraft.engine.load_model) for a profile of another device or dtype")
    # torch's own Module.to: transformers wraps PreTrainedModel.to in a decorator mypy cannot call.
    torch.nn.Module.to(module, device=device, dtype=dtype)
    if device.type == "cpu" and dtype == torch.bfloat16:
        # The same products, bit for bit, without laying each weight out again per call.
        pack_linears(module)
    return module


def _cuda_fingerprint() -> str:
    """The GPU as kernels see it, once this process is checked to be able to run a CUDA profile."""
    if not torch.cuda.is_available():
        raise ProfileMismatchError("a CUDA profile needs a GPU; torch sees none here",
                                   hint="run CUDA profiles on a machine with an NVIDIA GPU and a CUDA build of torch")
    wrong = _unmet(CUDA_ENVIRONMENT)
    if wrong:
        prefix = _env_prefix(CUDA_ENVIRONMENT)
        raise ProfileMismatchError(f"a CUDA profile needs this process started with {prefix}; here {', '.join(wrong)}",
                                   hint=f"run the command as: {prefix} kvgraft ...")
    major, minor = torch.cuda.get_device_capability(0)
    return (f"{torch.cuda.get_device_name(0)}; sm_{major}{minor}; cuda={torch.version.cuda}; "
            f"cudnn={torch.backends.cudnn.version()}")


def _llamacpp_profile(name: str, s: ProfileSettings) -> DeterminismProfile:
    """The llama.cpp profile on this machine: its fingerprint names the build (llamacpp.py)."""
    from . import llamacpp

    return DeterminismProfile(
        name=name, exactness=s.exactness, device_kind=s.device, device_fingerprint=llamacpp.build_fingerprint(),
        dtype=f"{s.dtype}{_KV_MARK}{s.kv_dtype}", torch_version=torch.__version__, transformers_version="unused",
        kernel_versions=llamacpp.SETTINGS.describe(), threads=s.threads, attention_implementation=s.attention_implementation,
        matmul_tiling=s.matmul_tiling, prefill_chunk=llamacpp.SETTINGS.n_batch, deterministic_algorithms=True,
    )


def applied_kv_dtype() -> torch.dtype:
    """The cache dtype of the profile ``applied`` now (float32 when none is): what a new
    ``KVState`` stores its keys and values in."""
    return _APPLIED_KV_DTYPE.get()


def _cpuinfo(field: str) -> str | None:
    """The first CPU's ``field`` in the kernel's ``/proc/cpuinfo``; None where it has none."""
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith(field):
                    return line.split(":", 1)[1].strip()
    return None


def _cpu_model() -> str:
    return _cpuinfo("model name") or platform.processor() or "unknown"


def _cpu_flags() -> frozenset[str] | None:
    """The first CPU's flags as its kernel reports them; None where there is no ``/proc/cpuinfo``."""
    listed = _cpuinfo("flags")
    return frozenset(listed.split()) if listed is not None else None


def _levels_held(flags: frozenset[str]) -> list[str]:
    """The instruction-set levels (``ISA_LEVELS`` names, lowest first) all of whose flags are in ``flags``."""
    return [name for name, level in ISA_LEVELS.items() if set(level.cpu_flags) <= flags]


def cpu_description() -> dict[str, str | list[str]]:
    """This CPU for a record a person reads: its model name, the ISA torch dispatches to, and
    the instruction-set levels whose flags its kernel reports (what a level profile needs)."""
    return {"cpu_model": _cpu_model(), "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "isa_levels": _levels_held(_cpu_flags() or frozenset())}


def device_fingerprint() -> str:
    """The CPU as kernels see it: architecture, model name and the ISA torch dispatches to."""
    return f"{platform.machine()}; {_cpu_model()}; torch-cpu-capability={torch.backends.cpu.get_cpu_capability()}"


def isa_fingerprint(level: IsaLevel) -> str:
    """The device fingerprint of an instruction-set-level profile, once this process is checked
    to run at ``level`` (``ProfileMismatchError`` naming the command that would otherwise)."""
    reported = _cpu_flags()
    flags = reported if reported is not None else frozenset(level.cpu_flags)  # no cpuinfo: torch's report decides
    lacking = [flag for flag in level.cpu_flags if flag not in flags]
    if lacking:
        held = [f"--profile cpu-fp32-{name}" for name in _levels_held(flags)]
        raise ProfileMismatchError(
            f"profile level {level.name} needs CPU flags this CPU lacks: {', '.join(lacking)} (/proc/cpuinfo)",
            hint=(f"choose a level this CPU has: {', '.join(held)}" if held else
                  "no instruction-set level fits this CPU: use a profile without one (the default)"),
        )
    wrong = _unmet(level.environment())
    capability = torch.backends.cpu.get_cpu_capability()
    if capability != level.torch_capability:
        wrong.append(f"torch dispatches to {capability}")
    if wrong:
        raise ProfileMismatchError(
            f"profile level {level.name} needs this process started with {level.command_prefix()}; "
            f"here {', '.join(wrong)}",
            hint=f"run the command as: {level.command_prefix()} kvgraft ... (a CPU without {level.torch_capability} "
            "cannot run this level: choose a lower one)",
        )
    return f"{platform.machine()}; isa-level={level.name}; " + "; ".join(f"{k}={v}" for k, v in level.environment().items())


def _require_cpu_flags(name: str, settings: ProfileSettings) -> str:
    """Refuse profile ``name`` on a CPU whose ``/proc/cpuinfo`` lacks every one of its
    ``cpu_flags`` alternatives (where there is no ``/proc/cpuinfo``, nothing is refused here);
    return the hint a refusal gives (the profile to use instead)."""
    instead = f"use --profile {DEFAULT_PROFILE}, the default, which runs on any x86-64 CPU"
    flags = _cpu_flags() if settings.cpu_flags else None
    if flags is not None and not any(set(option) <= flags for option in settings.cpu_flags):
        lacking = [[flag for flag in option if flag not in flags] for option in settings.cpu_flags]
        named = ", or ".join(", ".join(option[:-1]) + " and " + option[-1] if len(option) > 1 else option[0]
                             for option in lacking)
        raise ProfileMismatchError(f"profile {name} needs CPU flags this CPU lacks: {named} (/proc/cpuinfo)", hint=instead)
    return instead


def _require_cpu(name: str, settings: ProfileSettings) -> None:
    """Refuse (``ProfileMismatchError``, one line naming the profile, what this CPU or process
    lacks and the profile to use) a CPU profile this process cannot run: the CPU's flags
    (``settings.cpu_flags``, read off ``/proc/cpuinfo``; where there is none, torch decides),
    then, for a bfloat16 profile, whether oneDNN enables its bfloat16 kernels here at all
    (``ONEDNN_MAX_CPU_ISA`` can cap them on a CPU that has the flags)."""
    instead = _require_cpu_flags(name, settings)
    if settings.dtype == "bfloat16" and can_pack() and not bf16_kernels_enabled():
        cap = os.environ.get("ONEDNN_MAX_CPU_ISA")
        raise ProfileMismatchError(
            f"profile {name} needs oneDNN's bfloat16 kernels, which torch does not enable in this process"
            + (f" (ONEDNN_MAX_CPU_ISA={cap} caps them)" if cap else ""),
            hint=instead + (", or start the process without ONEDNN_MAX_CPU_ISA" if cap else ""))


def current_profile(name: str | None = None) -> DeterminismProfile:
    """The full profile ``name`` (or its alias; None: ``DEFAULT_PROFILE``) on this machine with
    these library versions."""
    name = PROFILE_ALIASES.get(name, name) if name is not None else DEFAULT_PROFILE
    try:
        s = PROFILES[name]
    except KeyError as e:
        raise UnknownProfileError(f"no determinism profile named {name!r}; known: {', '.join(PROFILES)}", hint=f"use --profile {DEFAULT_PROFILE} (the default)") from e
    kernel_versions = {"mkldnn": str(torch.backends.mkldnn.is_available()), "openmp": str(torch.backends.openmp.is_available())}
    if s.exactness == "schedule-invariant":
        kernel_versions["kvgraft_invariant"] = invariant.settings_from_tiling(s.matmul_tiling).describe()
    if s.device == "llamacpp":
        return _llamacpp_profile(name, s)
    if s.device == "cuda":
        fingerprint = _cuda_fingerprint()
    else:
        _require_cpu(name, s)
        fingerprint = device_fingerprint() if s.isa_level is None else isa_fingerprint(ISA_LEVELS[s.isa_level])
    return DeterminismProfile(
        name=name,
        exactness=s.exactness,
        device_kind=s.device,
        device_fingerprint=fingerprint,
        dtype=s.dtype if s.kv_dtype == s.dtype else f"{s.dtype}{_KV_MARK}{s.kv_dtype}",
        torch_version=torch.__version__,
        transformers_version=transformers.__version__,
        kernel_versions=kernel_versions,
        threads=s.threads,
        attention_implementation=s.attention_implementation,
        matmul_tiling=s.matmul_tiling,
        prefill_chunk=None,
        deterministic_algorithms=True,
    )


@contextlib.contextmanager
def applied(profile: DeterminismProfile) -> Iterator[None]:
    """Pin the profile's threads, deterministic algorithms, device and dtype (``placed``), cache
    dtype and attention (named for each forward pass by ``pass_attention``), on a GPU full-precision
    reductions (no TF32, no reduced-precision bfloat16 sums, no cuDNN autotuning), and for a
    schedule-invariant profile install the invariant kernels; restore the previous state after.
    A llama.cpp profile pins nothing here: its context was made with its settings (llamacpp.py)."""
    if profile.device_kind == "llamacpp":
        with torch.no_grad():
            yield
        return
    kernels = (
        invariant.installed(invariant.settings_from_tiling(profile.matmul_tiling))
        if profile.exactness == "schedule-invariant" else contextlib.nullcontext()
    )
    threads = torch.get_num_threads()
    deterministic = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    fill = torch.utils.deterministic.fill_uninitialized_memory  # type: ignore[attr-defined]
    grad = torch.is_grad_enabled()
    cache_dtype = _APPLIED_KV_DTYPE.set(kv_dtype(profile))
    placement = _APPLIED_PLACEMENT.set(("cuda" if profile.device_kind == "cuda" else "cpu", compute_dtype(profile)))
    gpu = _GpuMath() if profile.device_kind == "cuda" else None
    if profile.attention_implementation == fast_attention.ATTENTION_NAME:
        fast_attention.register()
    attention = _APPLIED_ATTENTION.set(profile.attention_implementation)
    _set_threads(profile.threads)
    torch.use_deterministic_algorithms(profile.deterministic_algorithms)
    # Deterministic mode also fills every new tensor with NaN before its kernel writes it, a
    # guard against kernels that read memory they never wrote. Every kernel the engine runs
    # writes its outputs whole (a read of unwritten memory would show as NaN or as bits that
    # vary between runs, which the exactness and invariance tests compare), so the fill only
    # costs a write of every new tensor and the page faults of touching it early: most of a
    # 4K graft's restore.
    torch.utils.deterministic.fill_uninitialized_memory = False  # type: ignore[attr-defined]
    torch.set_grad_enabled(False)
    try:
        with kernels:
            yield
    finally:
        if gpu is not None:
            gpu.restore()
        _APPLIED_PLACEMENT.reset(placement)
        _APPLIED_ATTENTION.reset(attention)
        _APPLIED_KV_DTYPE.reset(cache_dtype)
        torch.set_grad_enabled(grad)
        torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)
        torch.utils.deterministic.fill_uninitialized_memory = fill  # type: ignore[attr-defined]
        torch.set_num_threads(threads)


#: Thread counts whose intra-op workers have done a first piece of work in this process.
_WARMED: set[int] = set()


def _set_threads(n: int) -> None:
    """``torch.set_num_threads(n)``, then, the first time a process runs ``n`` threads, one
    vectorized ``exp`` split across all of them, before any model computation.

    Why: on an Intel Xeon (AVX-512, AMX; torch 2.13.0+cpu) the first piece of work an intra-op
    worker thread does in a process sometimes computes a vectorized transcendental wrongly: the
    first ``cos`` of a [1, 131, 16] float32 tensor, split over 2 threads, came out 1.5e-4 off in
    the worker's half (angles past 64 radians) in about one fresh process in five, and exact in
    every later call. A capture's rotary embedding is such a first call, so the same text gave
    two different artifacts in two processes (``test_two_processes_capture_identical_bytes``
    failed in ``make test``). After any earlier parallel op the first ``cos`` was exact in 50 of
    50 processes. The cause is below torch (not found); this makes every worker's first work a
    throwaway one. 64 K elements per thread, about 0.1 ms, once per process and thread count.
    """
    torch.set_num_threads(n)
    if n > 1 and n not in _WARMED:
        torch.exp(torch.zeros(n * 65536))
        _WARMED.add(n)


class _GpuMath:
    """Full-precision, non-autotuned GPU math while a CUDA profile is applied (the previous
    settings back on ``restore``)."""

    def __init__(self) -> None:
        matmul, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
        self.saved = (matmul.allow_tf32, matmul.allow_bf16_reduced_precision_reduction,
                      matmul.allow_fp16_reduced_precision_reduction, cudnn.allow_tf32, cudnn.benchmark, cudnn.deterministic)
        matmul.allow_tf32 = False
        matmul.allow_bf16_reduced_precision_reduction = False
        matmul.allow_fp16_reduced_precision_reduction = False
        cudnn.allow_tf32, cudnn.benchmark, cudnn.deterministic = False, False, True

    def restore(self) -> None:
        matmul, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
        (matmul.allow_tf32, matmul.allow_bf16_reduced_precision_reduction, matmul.allow_fp16_reduced_precision_reduction,
         cudnn.allow_tf32, cudnn.benchmark, cudnn.deterministic) = self.saved


def require_same(
    *,
    artifact_model: ModelRef,
    model: ModelRef,
    artifact_tokenizer: Sha256Digest,
    tokenizer: Sha256Digest,
    artifact_profile: DeterminismProfile,
    profile: DeterminismProfile,
) -> None:
    """Raise ``ProfileMismatchError`` naming every field where the artifact and this context differ."""
    diffs: list[str] = []
    for field in ModelRef.model_fields:
        a, b = getattr(artifact_model, field), getattr(model, field)
        if a != b:
            diffs.append(f"model.{field}: artifact {a}, here {b}")
    if artifact_tokenizer != tokenizer:
        diffs.append(f"tokenizer_digest: artifact {artifact_tokenizer}, here {tokenizer}")
    for field in DeterminismProfile.model_fields:
        a, b = getattr(artifact_profile, field), getattr(profile, field)
        if a != b:
            diffs.append(f"profile.{field}: artifact {a!r}, here {b!r}")
    if diffs:
        # Since the default profile changed (issue 16), a name mismatch is the likeliest cause: say which to pass.
        hint = (f"pass --profile {artifact_profile.name}, the profile the artifact was captured under"
                if artifact_profile.name != profile.name and artifact_profile.name in PROFILES else None)
        raise ProfileMismatchError(f"the artifact was made in another context: {'; '.join(diffs)}", hint=hint)
