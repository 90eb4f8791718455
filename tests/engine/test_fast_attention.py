"""The fast own-position attention (``fast_attention.py``): the additive mask it hands SDPA in
place of a boolean one changes no bit of the output, and is made once per mask and made anew
when the mask is rewritten."""

from __future__ import annotations

import pytest
import torch

from kvgraft.engine._internal.fast_attention import additive_mask, sdpa_gqa_attention

F = torch.nn.functional


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bits as integers: equal bits compare equal, NaNs included."""
    return t.view({torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[t.dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("hq", "hkv", "d"), [(9, 3, 64), (4, 1, 256), (14, 2, 64)])
@pytest.mark.parametrize(("q", "n"), [(1, 300), (20, 1024), (7, 77), (33, 600)])
def test_an_additive_mask_gives_sdpa_the_same_bits_as_the_boolean_mask(
    dtype: torch.dtype, hq: int, hkv: int, d: int, q: int, n: int
) -> None:
    g = torch.Generator().manual_seed(q * 1000 + n)
    k = n + q
    query = torch.randn(1, q, hq, d, generator=g).to(dtype).transpose(1, 2)  # [1, Hq, q, d], strided as a model's
    key, value = (torch.randn(1, hkv, k, d, generator=g).to(dtype) for _ in range(2))
    mask = torch.ones(q, k, dtype=torch.bool).tril(n)[None, None]  # [1, 1, q, k]: the cache, then causal
    mask[..., 3:40] = False  # a window's hole
    mask[..., q // 2, :] = False  # and a row that sees nothing
    expected = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, enable_gqa=True)
    got = F.scaled_dot_product_attention(query, key, value, attn_mask=additive_mask(mask, dtype, query.device), enable_gqa=True)
    assert torch.equal(_bits(got), _bits(expected))


def test_the_attention_function_with_a_wider_mask_equals_sdpa_on_the_boolean_mask() -> None:
    g = torch.Generator().manual_seed(4)
    query = torch.randn(1, 20, 9, 64, generator=g).transpose(1, 2)  # [1, 9, 20, 64]
    key, value = (torch.randn(1, 3, 500, 64, generator=g) for _ in range(2))
    mask = torch.ones(20, 520, dtype=torch.bool).tril(480)[None, None]  # wider than the keys: sliced to 500
    out, _ = sdpa_gqa_attention(torch.nn.Module(), query, key, value, mask, scaling=0.125)
    expected = F.scaled_dot_product_attention(query, key, value, attn_mask=mask[..., :500], enable_gqa=True, scale=0.125)
    assert torch.equal(out, expected.transpose(1, 2))


def test_an_additive_mask_is_made_once_per_mask_and_per_dtype() -> None:
    mask = torch.ones(1, 1, 4, 8, dtype=torch.bool).tril(4)
    first = additive_mask(mask, torch.float32, mask.device)
    assert additive_mask(mask, torch.float32, mask.device) is first
    half = additive_mask(mask, torch.bfloat16, mask.device)
    assert half.dtype == torch.bfloat16 and torch.equal(half.float(), first)
    assert first[0, 0, 0].tolist() == [0.0] * 5 + [float("-inf")] * 3


def test_a_boolean_mask_rewritten_in_place_gets_a_new_additive_mask() -> None:
    mask = torch.ones(1, 1, 2, 3, dtype=torch.bool)
    assert additive_mask(mask, torch.float32, mask.device).eq(0).all()
    mask[0, 0, 1, 2] = False
    assert additive_mask(mask, torch.float32, mask.device)[0, 0].tolist() == [[0.0, 0.0, 0.0], [0.0, 0.0, float("-inf")]]


def test_an_inference_mode_mask_is_converted_every_time_and_right() -> None:
    with torch.inference_mode():
        mask = torch.ones(1, 1, 2, 2, dtype=torch.bool)
        assert additive_mask(mask, torch.float32, mask.device).eq(0).all()
        mask[0, 0, 0, 1] = False
        assert additive_mask(mask, torch.float32, mask.device)[0, 0, 0].tolist() == [0.0, float("-inf")]


def test_a_float_mask_passes_through_untouched() -> None:
    mask = torch.zeros(1, 1, 2, 2)
    assert additive_mask(mask, torch.float32, mask.device) is mask
