"""Packed bfloat16 linear layers: the same products as ``F.linear``, bit for bit where oneDNN has no
AMX; with AMX, within bfloat16 rounding and deterministic."""

from __future__ import annotations

import pytest
import torch

from kvgraft.engine import LoadedModel, ProfileMismatchError, applied, current_profile, load_model
from kvgraft.engine._internal.packed_linear import PackedLinear, can_pack, pack_linears
from kvgraft.engine._internal.profiles import placed
from tests.engine.cpu_support import BF16_KERNELS, bf16_runs_here

pytestmark = pytest.mark.skipif(not can_pack(), reason="this torch has no oneDNN linear ops")


@pytest.fixture
def own_tiny() -> LoadedModel:
    """A tiny model of the test's own: these tests round and pack its weights in place."""
    return load_model("tiny-llama-test")

# On a CPU with AMX, oneDNN multiplies a weight laid out once for a pass's rows with other AMX
# kernels than the layout F.linear picks per call, for some shapes and row counts (an Intel Xeon
# here: 576x576 from 300 rows, 576x1536 and 896x896 at 512, 128x896 with bias at 64): the
# products differ from F.linear's in the last bfloat16 bit. Where oneDNN has no AMX (an AMD EPYC
# with AVX-512 BF16 here) both run the same kernels and the bits are equal.
AMX = bool(torch.cpu._is_amx_tile_supported())


def assert_as_f_linear(got: torch.Tensor, want: torch.Tensor, packed: PackedLinear, x: torch.Tensor, what: object) -> None:
    """Bit for bit equal to F.linear without AMX; with it, equal within bfloat16's rounding and
    the same bits on every call (the profile packs in capture, fresh and graft alike, so its
    own exactness does not depend on matching F.linear)."""
    assert got.shape == want.shape, what
    if not AMX:
        assert torch.equal(got, want), what
        return
    torch.testing.assert_close(got, want, msg=lambda m: f"{what}: {m}")
    with torch.no_grad():
        assert torch.equal(packed(x), got), what


def packs_here() -> bool:
    """True where oneDNN lays bfloat16 weights out here; where it cannot (an AVX2-only CPU),
    assert that a packed layer is refused by name instead of torch's bare RuntimeError, and
    return False: the calling test ends there."""
    if BF16_KERNELS:
        return True
    with pytest.raises(ProfileMismatchError, match="^oneDNN has no bfloat16 kernels in this process .*: bfloat16 weights "
                                                   "cannot be packed"):
        PackedLinear(torch.nn.Linear(4, 4).to(torch.bfloat16))
    return False


# The registered models' decoder shapes (smollm2-135m, qwen2.5-coder-0.5b, gemma3-270m's MLP).
SHAPES = [(576, 576), (192, 576), (1536, 576), (576, 1536), (896, 896), (128, 896), (4864, 896), (896, 4864), (2048, 640)]


@pytest.mark.parametrize(("out_features", "in_features"), SHAPES)
def test_a_packed_linear_equals_f_linear_bit_for_bit_at_every_row_count_without_amx(out_features: int, in_features: int) -> None:
    if not packs_here():
        return  # an AVX2-only CPU: packing was refused by name instead
    g = torch.Generator().manual_seed(out_features * 7 + in_features)
    for bias in (False, True):
        linear = torch.nn.Linear(in_features, out_features, bias=bias).to(torch.bfloat16)
        packed = PackedLinear(linear)
        assert packed.weight is linear.weight and packed.bias is linear.bias
        for rows in (1, 3, 16, 20, 64, 255, 1024):
            x = torch.randn(1, rows, in_features, generator=g).to(torch.bfloat16)  # [B, rows, in]
            with torch.no_grad():
                want = torch.nn.functional.linear(x, linear.weight, linear.bias)
                got = packed(x)
            assert_as_f_linear(got, want, packed, x, (rows, bias))


def test_a_packed_output_embedding_equals_f_linear_bit_for_bit_at_the_rows_a_pass_keeps_without_amx() -> None:
    if not packs_here():
        return  # an AVX2-only CPU: packing was refused by name instead
    # smollm2-135m's output embedding (49,152 x 576): the largest product a pass makes, of the
    # few rows it keeps (one for a first token, the continuation's for the exactness experiment).
    g = torch.Generator().manual_seed(49152)
    linear = torch.nn.Linear(576, 49152, bias=False).to(torch.bfloat16)
    packed = PackedLinear(linear)
    for rows in (1, 2, 7, 20, 50):
        x = torch.randn(1, rows, 576, generator=g).to(torch.bfloat16)  # [B, rows, hidden]
        with torch.no_grad():
            want = torch.nn.functional.linear(x, linear.weight)  # [B, rows, vocab]
            got = packed(x)
        assert_as_f_linear(got, want, packed, x, rows)


def test_a_packed_linear_refuses_weights_it_cannot_pack() -> None:
    with pytest.raises(TypeError, match="only bfloat16 CPU weights are packed, not torch.float32 on cpu"):
        PackedLinear(torch.nn.Linear(4, 4))


def test_the_bf16_profile_packs_every_linear_the_output_embedding_included(own_tiny: LoadedModel) -> None:
    if not packs_here():
        return  # an AVX2-only CPU: packing was refused by name instead
    module = own_tiny.module
    linears = sum(isinstance(m, torch.nn.Linear) for m in module.modules())
    x = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        plain = torch.nn.Module.to(module, dtype=torch.bfloat16)(input_ids=x).logits
    tied = module.get_input_embeddings().weight is module.get_output_embeddings().weight
    assert pack_linears(module) == linears
    assert isinstance(module.get_output_embeddings(), PackedLinear)
    # A tie stays a tie: the packed layer keeps the layer's own weight parameter.
    assert (module.get_input_embeddings().weight is module.get_output_embeddings().weight) == tied
    with torch.no_grad():
        packed = module(input_ids=x).logits
    assert torch.equal(packed, plain)
    # Packed once: a second call finds nothing left to pack.
    assert pack_linears(module) == 0


def test_placing_a_model_under_the_bf16_profile_packs_it(own_tiny: LoadedModel) -> None:
    if not bf16_runs_here("cpu-bf16-sdpa"):
        return  # an AVX2-only CPU: the profile was refused by name instead
    with applied(current_profile("cpu-bf16-sdpa")):
        placed(own_tiny.module)
    assert any(isinstance(m, PackedLinear) for m in own_tiny.module.modules())
