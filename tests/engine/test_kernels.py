"""The graft kernels against their torch references, bit for bit, with Triton's CPU interpreter
(``TRITON_INTERPRET=1``): scatter into and gather from a paged block cache (block size 16) for
ragged lengths, block boundaries and the head layouts of tiny (2 x 16), SmolLM2 (3 x 64) and
Gemma 3 (1 x 256); RoPE re-rotation against its reference with the models' own
angles. Where no Triton is installed the Triton half is skipped and says so.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvgraft.engine import KVState, LoadedModel, Segment, applied, capture, current_profile, load_artifact, trust_signer
from kvgraft.engine._internal.kernel_errors import KernelError
from kvgraft.engine.kernels import (
    BLOCK_SIZE,
    choose,
    gather_kv,
    gather_kv_reference,
    rerotate,
    rerotate_reference,
    scatter_kv,
    scatter_kv_reference,
    slot_mapping,
    triton_available,
)

needs_triton = pytest.mark.skipif(not triton_available(), reason="triton is not installed: the kernels ran as their torch references only")

#: (kv_heads, head_dim) of tiny-llama-test, SmolLM2-135M and Gemma 3 270M.
LAYOUTS = [(2, 16), (3, 64), (1, 256)]
#: (start, length): ragged lengths, starting and ending on, before and after block boundaries.
SPANS = [(0, 1), (0, 15), (0, 16), (0, 17), (15, 2), (16, 16), (5, 44), (31, 33)]


@pytest.fixture(autouse=True)
def interpret(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Run Triton kernels in the CPU interpreter for every test here."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    yield


def _kv(h: int, d: int, t: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(1, h, t, d, generator=gen), torch.randn(1, h, t, d, generator=gen)


def _cache(h: int, d: int, blocks: int = 12) -> tuple[torch.Tensor, torch.Tensor]:
    # Filled with a marker, so a write to a wrong slot or a missed slot shows.
    return torch.full((blocks, BLOCK_SIZE, h, d), -7.0), torch.full((blocks, BLOCK_SIZE, h, d), 7.0)


def test_slot_mapping() -> None:
    table = torch.tensor([4, 0, 9], dtype=torch.int32)
    assert slot_mapping(table, 14, 4).tolist() == [4 * 16 + 14, 4 * 16 + 15, 0, 1]
    assert slot_mapping(table, 32, 3).tolist() == [144, 145, 146]
    assert slot_mapping(table, 0, 0).tolist() == []
    with pytest.raises(KernelError, match="positions up to 49 need 4 blocks; the block table lists 3"):
        slot_mapping(table, 40, 9)
    with pytest.raises(KernelError, match="a block table is a 1-D integer tensor"):
        slot_mapping(table.float(), 0, 1)


#: A scattered block table (the sequence's blocks neither first nor in order: the references'
#: indexed copies) and an in-order one (a restore's pool: one run of slots, the references' slice copies).
TABLES = {"scattered": [7, 2, 10, 0, 5], "in-order": [3, 4, 5, 6, 7]}


@needs_triton
@pytest.mark.parametrize(("h", "d"), LAYOUTS)
@pytest.mark.parametrize(("start", "length"), SPANS)
@pytest.mark.parametrize("table", sorted(TABLES))
def test_scatter_and_gather_kernels_equal_the_references(h: int, d: int, start: int, length: int, table: str) -> None:
    keys, values = _kv(h, d, length, seed=start * 100 + length)
    slots = slot_mapping(torch.tensor(TABLES[table], dtype=torch.int64), start, length)
    kc, vc = _cache(h, d)
    rk, rv = _cache(h, d)
    scatter_kv(keys, values, kc, vc, slots, backend="triton")
    scatter_kv_reference(keys, values, rk, rv, slots)
    assert torch.equal(kc, rk) and torch.equal(vc, rv)
    untouched = torch.ones(kc.shape[0] * BLOCK_SIZE, dtype=torch.bool)
    untouched[slots] = False
    assert (kc.view(-1, h, d)[untouched] == -7.0).all()
    gk, gv = gather_kv(kc, vc, slots, backend="triton")
    ek, ev = gather_kv_reference(kc, vc, slots)
    assert torch.equal(gk, ek) and torch.equal(gv, ev)
    assert torch.equal(gk, keys) and torch.equal(gv, values)


@pytest.mark.parametrize(("h", "d"), LAYOUTS)
@pytest.mark.parametrize(("start", "length"), SPANS)
def test_reference_slice_copy_of_a_run_of_slots_equals_the_indexed_copy(h: int, d: int, start: int, length: int) -> None:
    # The references copy a run of slots as one slice: the same bytes in the same slots as
    # the indexed write and read every other block table takes.
    keys, values = _kv(h, d, length, seed=start + 7 * length)
    slots = slot_mapping(torch.tensor(TABLES["in-order"], dtype=torch.int64), start, length)
    kc, vc = _cache(h, d)
    scatter_kv_reference(keys, values, kc, vc, slots)
    ik, iv = _cache(h, d)
    ik.view(-1, h, d)[slots] = keys[0].transpose(0, 1)
    iv.view(-1, h, d)[slots] = values[0].transpose(0, 1)
    assert torch.equal(kc, ik) and torch.equal(vc, iv)
    gk, gv = gather_kv_reference(kc, vc, slots)
    assert torch.equal(gk, keys) and torch.equal(gv, values) and gk.is_contiguous() and gv.is_contiguous()
    # A non-contiguous source (a slice of a bigger state) lands the same.
    wide_k, wide_v = _kv(h, d, length + 2, seed=3)
    wide_k[:, :, 1:1 + length] = keys
    wide_v[:, :, 1:1 + length] = values
    sk, sv = _cache(h, d)
    scatter_kv_reference(wide_k[:, :, 1:1 + length], wide_v[:, :, 1:1 + length], sk, sv, slots)
    assert torch.equal(sk, kc) and torch.equal(sv, vc)


@needs_triton
def test_ragged_batch_of_artifacts_shares_one_cache() -> None:
    h, d = 3, 64
    table = {"a": torch.tensor([3, 8]), "b": torch.tensor([0, 1, 6]), "c": torch.tensor([11])}
    spans = {"a": (0, 17), "b": (16, 20), "c": (0, 5)}
    kc, vc = _cache(h, d)
    rk, rv = _cache(h, d)
    tensors = {}
    for i, (name, (start, length)) in enumerate(spans.items()):
        keys, values = _kv(h, d, length, seed=i)
        # A non-contiguous view (as a slice of a bigger state would be) is read in place.
        wide_k, wide_v = _kv(h, d, length + 3, seed=10 + i)
        wide_k[:, :, 1:1 + length], wide_v[:, :, 1:1 + length] = keys, values
        keys, values = wide_k[:, :, 1:1 + length], wide_v[:, :, 1:1 + length]
        tensors[name] = (keys, values)
        slots = slot_mapping(table[name], start, length)
        scatter_kv(keys, values, kc, vc, slots, backend="triton")
        scatter_kv_reference(keys, values, rk, rv, slots)
    assert torch.equal(kc, rk) and torch.equal(vc, rv)
    for name, (start, length) in spans.items():
        gk, gv = gather_kv(kc, vc, slot_mapping(table[name], start, length), backend="triton")
        assert torch.equal(gk, tensors[name][0]) and torch.equal(gv, tensors[name][1])


@needs_triton
def test_artifact_through_the_paged_cache_grafts_the_same(tiny: LoadedModel, key: Path, tmp_path: Path) -> None:
    profile = current_profile("cpu-fp32-invariant")
    capture(tiny, profile, "A paged cache holds this prefix in blocks of sixteen tokens.", tmp_path / "a", key=key)
    art = load_artifact(tmp_path / "a", tiny, profile, trusted=trust_signer(key))
    (segment,) = art.segments()
    n = segment.end
    slots = slot_mapping(torch.tensor([5, 1, 3, 0, 6]), 0, n)
    moved = {}
    for i in range(tiny.module.config.num_hidden_layers):
        keys, values = segment.tensors[f"layers.{i}.keys"], segment.tensors[f"layers.{i}.values"]
        kc, vc = _cache(keys.shape[1], keys.shape[3], blocks=8)
        scatter_kv(keys, values, kc, vc, slots, backend="triton")
        moved[f"layers.{i}.keys"], moved[f"layers.{i}.values"] = gather_kv(kc, vc, slots, backend="triton")
    assert all(torch.equal(moved[k], segment.tensors[k]) for k in segment.tensors)
    continuation = tiny.tokenizer.encode(" Then it continues.", first=False)
    with applied(profile):
        direct = KVState.restore(tiny, [segment]).extend(continuation)
        paged = KVState.restore(tiny, [Segment(moved, 0, n, segment.token_ids)]).extend(continuation)
    assert torch.equal(direct, paged)


def _angles(d: int, shift: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    freqs = torch.cat([shift * inv_freq, shift * inv_freq])
    return freqs.cos()[None, None, None], freqs.sin()[None, None, None]  # [d] -> [1, 1, 1, d]


@needs_triton
@pytest.mark.parametrize(("h", "d"), LAYOUTS)
@pytest.mark.parametrize(("t", "shift"), [(1, 1), (16, 3), (33, -5), (40, 517)])
def test_rerotate_kernel_equals_reference(h: int, d: int, t: int, shift: int) -> None:
    keys, _ = _kv(h, d, t, seed=t)
    cos, sin = _angles(d, shift, 10000.0)
    ref = rerotate_reference(keys, cos, sin)
    assert torch.equal(rerotate(keys, cos, sin, backend="triton"), ref)
    # A strided view of a bigger cache (as a layer's held window is) gives the same bits.
    wide, _ = _kv(h, d, t + 4, seed=99)
    wide[:, :, 2:2 + t] = keys
    assert torch.equal(rerotate(wide[:, :, 2:2 + t], cos, sin, backend="triton"), ref)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("h", "d"), LAYOUTS)
def test_rerotate_of_half_precision_keys_rounds_once_to_nearest_even_like_the_reference(
    h: int, d: int, dtype: torch.dtype
) -> None:
    # The bug: Triton's interpreter truncated the float32 -> bfloat16 cast a GPU rounds, so the
    # kernel and the reference differed by one unit in the last place. Both now compute in
    # float32 and round once, to nearest even.
    keys, _ = _kv(h, d, 40, seed=d)
    keys = keys.to(dtype)
    cos, sin = (a.to(dtype) for a in _angles(d, 7, 10000.0))
    ref = rerotate_reference(keys, cos, sin)
    wide = (keys.float() * cos.float() + torch.cat([-keys[..., d // 2:], keys[..., :d // 2]], -1).float() * sin.float())
    assert ref.dtype == dtype and torch.equal(ref, wide.to(dtype))
    assert torch.equal(rerotate(keys, cos, sin, backend="triton"), ref)


@needs_triton
@pytest.mark.slow
@pytest.mark.parametrize("name", ["smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b"])
def test_rerotate_with_the_models_own_rotary(name: str) -> None:
    # The real models' rotary modules (Gemma 3: local and global bases; Qwen2.5: theta 1e6), built from the
    # converted configs without loading any weights.
    from transformers import AutoConfig
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding

    from kvgraft.engine import ensure_cached, spec_for

    config = AutoConfig.from_pretrained(ensure_cached(spec_for(name), progress=False))
    # Qwen2's config has no head_dim: its attention divides the width by the heads.
    h, d = config.num_key_value_heads, getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    keys, _ = _kv(h, d, 21, seed=5)
    x, pos = torch.zeros(1), torch.tensor([[12]])  # a shift of 12 positions
    if name == "gemma3-270m":
        rotary = Gemma3RotaryEmbedding(config)
        angles = [rotary(x, pos, kind) for kind in sorted(set(config.layer_types))]
        assert len(angles) == 2 and not torch.equal(angles[0][0], angles[1][0])
    elif name == "qwen2.5-coder-0.5b":
        angles = [Qwen2RotaryEmbedding(config)(x, pos)]
    else:
        angles = [LlamaRotaryEmbedding(config)(x, pos)]
    for cos, sin in angles:
        cos, sin = cos[:, None], sin[:, None]  # [1, 1, d] -> [1, 1, 1, d], as the engine shapes them
        assert torch.equal(rerotate(keys, cos, sin, backend="triton"), rerotate_reference(keys, cos, sin))


# --- references and refusals without Triton -------------------------------------------------------


def test_references_round_trip_and_refuse_bad_input() -> None:
    keys, values = _kv(3, 64, 20, seed=1)
    kc, vc = _cache(3, 64, blocks=2)
    slots = slot_mapping(torch.tensor([1, 0]), 4, 20)
    scatter_kv(keys, values, kc, vc, slots, backend="torch")
    k, v = gather_kv(kc, vc, slots, backend="torch")
    assert torch.equal(k, keys) and torch.equal(v, values)
    with pytest.raises(KernelError, match="the cache holds 3 heads of 64; the artifact 1 of 256"):
        scatter_kv(*_kv(1, 256, 20, seed=2), kc, vc, slots, backend="torch")
    with pytest.raises(KernelError, match="19 slots for 20 tokens"):
        scatter_kv(keys, values, kc, vc, slots[:19], backend="torch")
    with pytest.raises(KernelError, match="slots run outside the cache's 32 slots"):
        gather_kv(kc, vc, torch.tensor([32]), backend="torch")
    with pytest.raises(KernelError, match="cos and sin must hold one angle per head dimension"):
        rerotate(keys, torch.ones(32), torch.ones(32), backend="torch")
    with pytest.raises(KernelError, match="unknown kernel backend 'cuda'"):
        choose("cuda", keys)  # type: ignore[arg-type]


def test_triton_backend_refused_on_cpu_without_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    keys = torch.zeros(1, 1, 1, 2)
    assert choose("auto", keys) == "torch"
    with pytest.raises(KernelError, match="cannot run the Triton kernel"):
        choose("triton", keys)


@pytest.mark.parametrize("table", sorted(TABLES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_gather_into_strided_float32_buffers_widens_exactly(table: str, dtype: torch.dtype) -> None:
    # A restore gathers straight into the cache's buffers: views of the first positions of a
    # longer [1, h, capacity, d] tensor, float32 whatever the pool stores.
    h, d, length = 3, 64, 44
    keys, values = (t.to(dtype) for t in _kv(h, d, length, seed=11))
    slots = slot_mapping(torch.tensor(TABLES[table], dtype=torch.int64), 5, length)
    kc, vc = (t.to(dtype) for t in _cache(h, d))
    scatter_kv_reference(keys, values, kc, vc, slots)
    backends = ["torch", "triton"] if triton_available() else ["torch"]
    for backend in backends:
        room_k, room_v = torch.full((1, h, length + 9, d), 5.0), torch.full((1, h, length + 9, d), 5.0)
        out = (room_k[:, :, :length], room_v[:, :, :length])
        got = gather_kv(kc, vc, slots, out=out, backend=backend)  # type: ignore[arg-type]
        assert got[0] is out[0] and got[1] is out[1]
        assert torch.equal(room_k[:, :, :length], keys.float()) and torch.equal(room_v[:, :, :length], values.float())
        assert (room_k[:, :, length:] == 5.0).all() and (room_v[:, :, length:] == 5.0).all(), f"{backend} wrote past its positions"


def test_gather_refuses_an_output_that_would_lose_bits() -> None:
    h, d = 2, 16
    kc, vc = _cache(h, d)
    slots = slot_mapping(torch.tensor([0, 1], dtype=torch.int64), 0, 20)
    narrow = (torch.empty(1, h, 20, d, dtype=torch.float16), torch.empty(1, h, 20, d, dtype=torch.float16))
    with pytest.raises(KernelError, match=r"cannot write a \(1, 2, 20, 16\) torch.float32 gather into a \(1, 2, 20, 16\) torch.float16"):
        gather_kv(kc, vc, slots, out=narrow)
    short = (torch.empty(1, h, 19, d), torch.empty(1, h, 19, d))
    with pytest.raises(KernelError, match=r"into a \(1, 2, 19, 16\) torch.float32 tensor"):
        gather_kv(kc, vc, slots, out=short)


@pytest.mark.parametrize("h", [1, 3])
def test_gather_of_one_kv_head_returns_new_tensors_not_views_of_the_pool(h: int) -> None:
    # Regression: with one KV head (Gemma 3 270M) a run of slots is already dense, and the torch
    # reference returned a view of the cache; a restore that refilled its pool for the next
    # layer changed the sliding layers' keys under them (graft != fresh on gemma3).
    keys, values = _kv(h, 8, 32, seed=3)
    kc, vc = _cache(h, 8, blocks=2)
    slots = slot_mapping(torch.tensor([0, 1]), 0, 32)
    scatter_kv(keys, values, kc, vc, slots, backend="torch")
    k, v = gather_kv(kc, vc, slots, backend="torch")
    kc.zero_()
    vc.zero_()
    assert torch.equal(k, keys) and torch.equal(v, values)
    assert k.is_contiguous() and v.is_contiguous()


@pytest.mark.parametrize("backend", ["torch", "triton"] if triton_available() else ["torch"])
def test_slots_rewritten_in_place_after_a_scatter_are_checked_and_followed_anew(backend: str) -> None:
    # The kernels remember what they checked of a slot tensor (its range, whether it is a run)
    # for as long as its version counter stands: an in-place write must void that.
    h, d = 3, 64
    keys, values = _kv(h, d, 16, seed=5)
    slots = slot_mapping(torch.tensor([1, 2], dtype=torch.int64), 0, 16)  # a run: 16..31
    kc, vc = _cache(h, d, blocks=4)
    scatter_kv(keys, values, kc, vc, slots, backend=backend)  # type: ignore[arg-type]
    assert torch.equal(kc.view(-1, h, d)[16:32], keys[0].transpose(0, 1))
    slots.copy_(slots.flip(0))  # the same slots backwards: no longer a run
    scatter_kv(keys, values, kc, vc, slots, backend=backend)  # type: ignore[arg-type]
    assert torch.equal(kc.view(-1, h, d)[16:32], keys[0].transpose(0, 1).flip(0))
    gk, _ = gather_kv(kc, vc, slots, backend=backend)  # type: ignore[arg-type]
    assert torch.equal(gk, keys)
    slots[3] = 64  # one past the cache's 64 slots
    with pytest.raises(KernelError, match="slots run outside the cache's 64 slots"):
        scatter_kv(keys, values, kc, vc, slots, backend=backend)  # type: ignore[arg-type]
    with pytest.raises(KernelError, match="slots run outside the cache's 64 slots"):
        gather_kv(kc, vc, slots, backend=backend)  # type: ignore[arg-type]


def test_scatter_and_gather_take_slots_made_under_inference_mode() -> None:
    # Inference tensors keep no version counter, so nothing is remembered of them: each call checks.
    h, d = 2, 16
    keys, values = _kv(h, d, 20, seed=6)
    kc, vc = _cache(h, d, blocks=4)
    with torch.inference_mode():
        slots = slot_mapping(torch.tensor([2, 0, 3], dtype=torch.int64), 12, 20)
        scatter_kv_reference(keys, values, kc, vc, slots)
        gk, gv = gather_kv_reference(kc, vc, slots)
        assert torch.equal(gk, keys) and torch.equal(gv, values)
        slots[0] = -1
        with pytest.raises(KernelError, match="slots run outside the cache's 64 slots"):
            scatter_kv_reference(keys, values, kc, vc, slots)
