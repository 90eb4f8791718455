"""The fast own-position attention: ``torch.nn.functional.scaled_dot_product_attention`` on the
cache's keys and values as they are, grouped-query heads included (``enable_gqa``), so the
repeated keys and values of grouped-query attention are never materialised (eager attention and
transformers' ``sdpa`` both copy them with ``repeat_kv`` for a pass of more than one query).

Registered in transformers' ``AttentionInterface`` as ``kvgraft_sdpa_gqa``, with transformers'
own SDPA mask builder for its masks (a causal prefill gets no mask and runs ``is_causal``; a pass
on a cache gets the boolean mask of its offset; Gemma 3's sliding layers get their window's),
each turned into the additive mask SDPA would make of it once per pass, not once per layer
(``additive_mask``).

Exact by construction, not by numerics: a graft and its fresh computation run this same kernel on
the same shapes for every pass they share (the continuation on the cache), so their logits are
equal bit for bit; the prefix's pass may take another SDPA path than eager attention would, which
is why this is a profile of its own (``cpu-fp32-sdpa``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .errors import InputTextError

#: The name in transformers' ``AttentionInterface`` (and mask interface).
ATTENTION_NAME = "kvgraft_sdpa_gqa"


def sdpa_gqa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention of ``query`` ``[B, Hq, q, d]`` over ``key``/``value`` ``[B, Hkv, k, d]``
    (``Hq`` a multiple of ``Hkv``); ``attention_mask`` a boolean ``[B or 1, 1, q, k]`` mask (True:
    attend) or None for a causal pass with ``q == k``. Returns ``[B, q, Hq, d]`` as eager
    attention does."""
    if kwargs.get("softcap") is not None:
        raise InputTextError("the SDPA profile cannot soft-cap attention scores", hint="use --profile cpu-fp32 for this model")
    if dropout:
        raise InputTextError("dropout in attention is not deterministic", hint="call model.eval()")
    q, k = query.shape[2], key.shape[2]
    if attention_mask is not None:
        attention_mask = additive_mask(attention_mask, query.dtype, query.device)[:, :, :, :k]
    # Without a mask the pass is a causal prefill from an empty cache (the mask builder drops the
    # mask only then); a single query needs no causal mask at all.
    causal = attention_mask is None and q > 1
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=0.0, is_causal=causal, scale=scaling,
        enable_gqa=query.shape[1] != key.shape[1],
    )  # [B, Hq, q, d]
    return out.transpose(1, 2).contiguous(), None  # [B, Hq, q, d] -> [B, q, Hq, d]


#: Additive masks by the boolean mask they were made from (by identity, held weakly; one per
#: mask a pass builds, so Gemma 3's sliding and full masks each keep theirs): (its version
#: counter, dtype, the additive mask).
_ADDITIVE = WeakIdKeyDictionary()


def additive_mask(mask: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``mask`` as the CPU SDPA kernels read it: a boolean mask (True: attend) becomes 0 where it
    attends and -inf elsewhere, in ``dtype``, made once per mask and reused by every layer of the
    pass; any other mask, or a mask on another device, is returned as it is.

    The same values SDPA makes of a boolean mask itself (``zeros``, ``masked_fill_`` of -inf),
    once per layer; handing it over made ready changes no bit of any output (tested, fully
    masked rows included) and saved 3-11 ms in 30 layers at 8K positions. An inference tensor
    has no version counter to tell a rewrite by, so its conversion is not kept.
    """
    if mask.dtype != torch.bool or device.type != "cpu":
        return mask
    kept = not mask.is_inference()
    if kept:
        known = _ADDITIVE.get(mask)
        if known is not None and known[0] == mask._version and known[1] == dtype:
            ready: torch.Tensor = known[2]
            return ready
    ready = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(mask.logical_not(), float("-inf"))
    if kept:
        _ADDITIVE[mask] = (mask._version, dtype, ready)
    return ready


def register() -> None:
    """Make ``kvgraft_sdpa_gqa`` known to transformers (idempotent); a model uses it when its
    config names it (``KVState`` does, for one pass, under a profile that says so)."""
    if ALL_ATTENTION_FUNCTIONS.get(ATTENTION_NAME) is not sdpa_gqa_attention:
        ALL_ATTENTION_FUNCTIONS[ATTENTION_NAME] = sdpa_gqa_attention
    if ALL_MASK_ATTENTION_FUNCTIONS._global_mapping.get(ATTENTION_NAME) is not sdpa_mask:
        ALL_MASK_ATTENTION_FUNCTIONS._global_mapping[ATTENTION_NAME] = sdpa_mask
