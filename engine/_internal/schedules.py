"""The same tokens under other schedules than capture and graft use: one forward pass over a
prefix and its continuation together, and several requests side by side in one batch.

Under the ``cpu-fp32-invariant`` profile every schedule gives the same bits for the same token
at the same position; under ``cpu-fp32`` they differ (that is what the profile fixes).
"""

from __future__ import annotations

import time

import torch
from transformers.cache_utils import DynamicCache

from kvgraft.schemas import DeterminismProfile

from . import invariant
from .errors import InputTextError
from .kernel_errors import ScheduleError
from .llamacpp import LlamaCppModel, LlamaCppState
from .models import LoadedModel
from .ops import AnyModel, Continuation
from .profiles import applied, placed


def prefill(model: LoadedModel, sequences: list[list[int]], *, keep_from: int = 0, pad_id: int = 0) -> list[torch.Tensor]:
    """Run each sequence from position 0, all side by side in one forward pass.

    Shorter sequences are right-padded with ``pad_id``: a causal model never lets a real token
    see the padding after it, so no mask is needed and the padding's own outputs are dropped.
    Returns, per sequence, float32 logits ``[len - keep_from, vocab]`` for positions
    ``[keep_from, len)``; the lm head runs only on those positions. Call it under ``applied``.
    """
    if not sequences or any(not s for s in sequences):
        raise ScheduleError("every sequence in a batch needs at least one token", hint="drop empty requests")
    longest = max(len(s) for s in sequences)
    if longest > model.spec.window:
        raise ScheduleError(f"{longest} positions exceed {model.spec.name}'s window of {model.spec.window}", hint="use shorter texts")
    if not 0 <= keep_from < min(len(s) for s in sequences):
        raise ScheduleError(f"keep_from {keep_from} is outside the shortest sequence", hint="keep_from must be below every length")
    device = placed(model.module).device
    input_ids = torch.full((len(sequences), longest), pad_id, dtype=torch.long, device=device)  # [B, longest]
    for i, s in enumerate(sequences):
        input_ids[i, :len(s)] = torch.tensor(s, dtype=torch.long, device=device)
    keep = torch.arange(keep_from, longest, device=device)  # positions whose logits the lm head computes
    cache = DynamicCache(config=model.module.config)
    with invariant.scoped_call(model.module, 0, len(sequences) * longest) as invariant_kwargs:
        out = model.module(input_ids=input_ids, cache=cache, use_cache=True, logits_to_keep=keep, **invariant_kwargs)
    logits = out.logits.to(device="cpu", dtype=torch.float32)  # [B, longest - keep_from, vocab], on the CPU
    return [logits[i, :len(s) - keep_from] for i, s in enumerate(sequences)]


def single_pass(model: AnyModel, profile: DeterminismProfile, prefix: str, text: str) -> Continuation:
    """Tokenize ``prefix`` as capture does and ``text`` as graft does, run both in one forward
    pass, and return the continuation's logits (what ``kvgraft single-pass`` prints)."""
    prefix_ids = model.tokenizer.encode(prefix, first=True)
    ids = model.tokenizer.encode(text, first=False)
    if not prefix_ids:
        raise InputTextError("the prefix text tokenizes to no tokens")
    if not ids:
        raise InputTextError("the continuation text tokenizes to no tokens")
    if len(prefix_ids) + len(ids) > model.spec.window:
        raise InputTextError(
            f"{len(prefix_ids) + len(ids)} positions exceed {model.spec.name}'s window of {model.spec.window}",
            hint="use shorter texts",
        )
    if isinstance(model, LlamaCppModel):
        # llama.cpp's one call: prefix and continuation in the same llama_decode batches.
        t0 = time.perf_counter()
        state = LlamaCppState(model)
        try:
            logits = state.extend(prefix_ids + ids, keep_last=len(ids))  # [len(ids), vocab]
        finally:
            state.close()
        return Continuation(logits, len(prefix_ids), ids, time.perf_counter() - t0)
    with applied(profile):
        t0 = time.perf_counter()
        (logits,) = prefill(model, [prefix_ids + ids], keep_from=len(prefix_ids))
        return Continuation(logits, len(prefix_ids), ids, time.perf_counter() - t0)
