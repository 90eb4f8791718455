"""Profiles that run the model in another device or dtype than the CPU in float32.

The CUDA profiles (``cuda-bf16``, ``cuda-bf16-invariant``) cannot run here: on a machine without a
GPU they are refused by name, and with one they demand cuBLAS's deterministic workspace. Their
path through the engine (the module moved in place, inputs on its device, a bfloat16 cache, the
restore through the paged pool on that device, logits back on the CPU in float32) is the one any
placed profile takes, so it runs here under a bfloat16 profile on the CPU, made for the test.
``scripts/gpu_check.sh`` runs the CUDA profiles themselves where a GPU is lent.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvgraft.engine import (
    KVState,
    ProfileMismatchError,
    applied,
    capture,
    current_profile,
    fresh,
    graft,
    load_artifact,
    load_model,
    trust_signer,
)
from kvgraft.engine._internal import profiles
from kvgraft.engine._internal.profiles import ProfileSettings

_BF16 = "test-cpu-bf16"


@pytest.fixture()
def bf16(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A bfloat16 profile on the CPU: the settings of cuda-bf16 but the device."""
    cuda = profiles.PROFILES["cuda-bf16"]
    monkeypatch.setitem(profiles.PROFILES, _BF16, ProfileSettings(
        exactness=cuda.exactness, threads=2, attention_implementation=cuda.attention_implementation,
        matmul_tiling=cuda.matmul_tiling, dtype=cuda.dtype, kv_dtype=cuda.kv_dtype, device="cpu"))
    yield _BF16


def test_a_bfloat16_profile_moves_the_model_and_grafts_bit_exactly(bf16: str, key: Path, tmp_path: Path) -> None:
    model = load_model("tiny-llama-test")  # its own copy: the move rounds the weights in place
    profile = current_profile(bf16)
    assert (profile.dtype, profile.device_kind) == ("bfloat16", "cpu")
    prefix, continuation = "The paged pool holds this prefix in blocks.", " Then the graft continues it."
    capture(model, profile, prefix, tmp_path / "a", key=key)
    assert next(model.module.parameters()).dtype == torch.bfloat16
    art = load_artifact(tmp_path / "a", model, profile, trusted=trust_signer(key))
    assert {t.dtype for t in art.tensors.values()} == {torch.bfloat16}
    g = graft(model, profile, art, continuation)
    f = fresh(model, profile, prefix, continuation)
    assert g.logits.dtype == torch.float32 and g.logits.device.type == "cpu"
    assert torch.equal(g.logits, f.logits)
    with applied(profile):
        state = KVState.restore(model, art.segments())
    assert state.cache.layers[0].keys.dtype == torch.bfloat16 and state.compute_dtype == torch.bfloat16


def test_a_model_moved_to_bfloat16_is_refused_by_a_float32_profile(bf16: str, key: Path, tmp_path: Path) -> None:
    model = load_model("tiny-llama-test")
    capture(model, current_profile(bf16), "Hello, world.", tmp_path / "a", key=key)
    with pytest.raises(ProfileMismatchError, match="the model was moved to cpu bfloat16 for another profile; "
                                                   "this one runs it on cpu in float32") as e:
        fresh(model, current_profile(), "Hello", " world")
    assert e.value.hint == "load the model again (kvgraft.engine.load_model) for a profile of another device or dtype"


@pytest.mark.parametrize("name", ["cuda-bf16", "cuda-bf16-invariant"])
def test_cuda_profiles_are_refused_without_a_gpu_or_the_cublas_workspace(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if not torch.cuda.is_available():
        with pytest.raises(ProfileMismatchError, match="a CUDA profile needs a GPU; torch sees none here") as e:
            current_profile(name)
        assert "NVIDIA GPU" in str(e.value.hint)
        return
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    with pytest.raises(ProfileMismatchError, match="CUBLAS_WORKSPACE_CONFIG=:4096:8; here CUBLAS_WORKSPACE_CONFIG=\\(unset\\)"):
        current_profile(name)


def test_cuda_profiles_name_their_device_dtype_and_kernels() -> None:
    own, batch = profiles.PROFILES["cuda-bf16"], profiles.PROFILES["cuda-bf16-invariant"]
    assert (own.device, own.dtype, own.kv_dtype, own.exactness) == ("cuda", "bfloat16", "bfloat16", "own-position")
    assert (batch.device, batch.exactness, batch.matmul_tiling) == ("cuda", "schedule-invariant", "fixed-m-16")
