"""The cache layers ``KVState`` builds: full-attention layers append in place into buffers with
room (``_GrowingLayer``), with the same bits as transformers' concatenating ``DynamicLayer``;
a restore gathers into such buffers, so its first passes copy nothing but their own positions.
"""

from __future__ import annotations

import pytest
import torch
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from kvgraft.engine import KVState, LoadedModel, Segment, applied, current_profile, load_model
from kvgraft.engine._internal import invariant, kvstate
from kvgraft.engine._internal.invariant import InvariantSettings, tiled_linear
from tests.engine.cpu_support import bf16_runs_here

TEXT = "Question: Tom has 7 apples and eats 3. How many are left?\nAnswer: 7 - 3 = 4. He has 4 apples left.\n"


def _concatenating(state: KVState) -> KVState:
    """``state`` with its full layers made transformers' own ``DynamicLayer`` again (the old path)."""
    for layer in state.cache.layers:
        if type(layer) is kvstate._GrowingLayer:
            layer.__class__ = DynamicLayer
    return state


def _decode(state: KVState, ids: list[int], steps: int) -> tuple[torch.Tensor, list[int]]:
    rows = [state.extend(ids, keep_last=1)]
    tokens: list[int] = []
    for _ in range(steps):
        tokens.append(int(rows[-1][-1].argmax()))
        rows.append(state.extend([tokens[-1]]))
    return torch.cat(rows), tokens


@pytest.mark.parametrize("name", ["tiny-llama-test", pytest.param("smollm2-135m", marks=pytest.mark.slow)])
@pytest.mark.parametrize("profile_name", ["cpu-fp32-sdpa", "cpu-fp32", "cpu-fp32-sdpa-kv16", "cpu-bf16-sdpa"])
def test_in_place_appends_give_the_bits_of_concatenation(name: str, profile_name: str) -> None:
    if profile_name == "cpu-bf16-sdpa" and not bf16_runs_here(profile_name):
        return  # an AVX2-only CPU: the profile was refused by name instead
    model = load_model(name)
    ids = model.tokenizer.encode(TEXT, first=True)
    with applied(current_profile(profile_name)):
        grown, tokens = _decode(KVState(model), ids, 6)
        concatenated, same_tokens = _decode(_concatenating(KVState(model)), ids, 6)
    assert tokens == same_tokens
    assert torch.equal(grown, concatenated)


def test_decode_steps_write_into_the_room_and_reallocate_only_when_it_is_used_up(tiny: LoadedModel) -> None:
    ids = tiny.tokenizer.encode(TEXT, first=True)
    with applied(current_profile("cpu-fp32-sdpa")):
        state = KVState(tiny)
        state.extend(ids)
        layer = state.cache.layers[0]
        assert isinstance(layer, kvstate._GrowingLayer)
        first = layer.keys.data_ptr()
        for _ in range(kvstate.ROOM):
            state.extend([ids[-1]])
        assert layer.keys.data_ptr() == first, "a step inside the room copied the cache"
        assert layer.keys.shape[2] == len(ids) + kvstate.ROOM
        state.extend([ids[-1]])
        assert layer.keys.data_ptr() != first and layer.keys.shape[2] == len(ids) + kvstate.ROOM + 1
        # What export reads is the held positions, contiguous, in order.
        exported = state.export(0)["layers.0.keys"]
        assert exported.is_contiguous() and torch.equal(exported, layer.keys)


def test_export_then_extend_leaves_the_exported_tensors_as_they_were(tiny: LoadedModel) -> None:
    # Positions below the end are never written again: an artifact exported earlier keeps its bits.
    ids = tiny.tokenizer.encode(TEXT, first=True)
    with applied(current_profile("cpu-fp32-sdpa")):
        state = KVState(tiny)
        state.extend(ids[:20])
        exported = state.export(0)
        before = {k: v.clone() for k, v in exported.items()}
        state.extend(ids[20:])
    assert all(torch.equal(exported[k], before[k]) for k in before)


@pytest.mark.parametrize(("profile_name", "dtype"), [
    ("cpu-fp32-sdpa", torch.float32), ("cpu-fp32-sdpa-kv16", torch.float32), ("cpu-bf16-sdpa", torch.bfloat16)])
def test_restore_gathers_into_buffers_with_room(profile_name: str, dtype: torch.dtype) -> None:
    if profile_name == "cpu-bf16-sdpa" and not bf16_runs_here(profile_name):
        return  # an AVX2-only CPU: the profile was refused by name instead
    # A model of its own: a bfloat16 profile rounds the loaded weights in place.
    tiny = load_model("tiny-llama-test")
    ids = tiny.tokenizer.encode(TEXT, first=True)
    with applied(current_profile(profile_name)):
        source = KVState(tiny)
        source.extend(ids[:30])
        restored = KVState.restore(tiny, [Segment(source.export(0), 0, 30, tuple(ids[:30]))])
        layers = [layer for layer in restored.cache.layers if not isinstance(layer, DynamicSlidingWindowLayer)]
        pointers = [layer.keys.data_ptr() for layer in layers]
        # The cache holds the compute dtype, whatever the profile stores.
        assert all(layer.keys.dtype == dtype for layer in layers)
        got = restored.extend(ids[30:])
        expected = source.extend(ids[30:])
    assert torch.equal(got, expected)
    assert [layer.keys.data_ptr() for layer in layers] == pointers, "the first pass after a restore copied the cache"


def test_lm_head_tile_of_a_long_prefill_runs_on_one_thread_regression(monkeypatch: pytest.MonkeyPatch) -> None:
    # CI saw qwen2.5-coder-0.5b's greedy decode differ from its prefill under cpu-fp32-invariant:
    # a 44-token prefill keeping 5 rows ran its one lm-head tile on two threads, where MKL may
    # cut one GEMM as it likes; a decode step runs it on one. Fewer GEMMs than threads now run
    # on as many threads as GEMMs.
    seen: list[tuple[int, int]] = []
    real = torch.bmm

    def spy(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        seen.append((a.shape[0], torch.get_num_threads()))
        return real(a, b)

    monkeypatch.setattr(invariant.torch, "bmm", spy)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        w = torch.randn(96, 64)
        tiled_linear(torch.randn(5, 64), w, None, InvariantSettings())
        tiled_linear(torch.randn(40, 64), w, None, InvariantSettings())
        assert torch.get_num_threads() == 2
    finally:
        monkeypatch.undo()
        torch.set_num_threads(threads)
    assert seen == [(1, 1), (3, 2)]
