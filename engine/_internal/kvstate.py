"""The KV state: one object holding a model's attention cache after some tokens, with one update
path (``extend``) and exact export and import of every layer's state.

The layers run in the model's own transformers module (Llama, Gemma 3 or Qwen2, whose q/k/v
projections add their bias before RoPE); the cache holds keys and values exactly as the next
pass reads them, so an artifact stores them as they are, whatever the architecture.

Full-attention layers hold keys and values for every position. Sliding-window layers (Gemma 3's
local layers) hold only their last ``window - 1`` positions plus a count of tokens seen; both
parts are captured, because re-inserting the tensors alone would give the layer a wrong count
and so a wrong attention mask.

The cache stores keys and values in the applied profile's cache dtype (``profiles.kv_dtype``):
float32 as computed, or rounded to float16 as they enter the cache (``_RoundedLayer``, in
the same pass that computes them, so the pass's own attention already reads the rounded
values). The cache's tensors stay in the profile's compute dtype (float32 on the CPU) for the
arithmetic; an artifact stores them in the cache dtype, which loses nothing, and a restore widens
them back exactly. The state lives on the profile's device (``profiles.placed``).

Full-attention layers append in place (``_GrowingLayer``): their keys and values are views of
buffers with ``ROOM`` positions past the end, so a pass writes only its own positions instead of
copying the whole cache, as transformers' concatenating layer does; attention reads the views by
stride, with the same bits (tested against the concatenating layer).

A restore writes every artifact of a chain, at its own positions, into a paged pool through
the graft kernels (``kvpool.LayerPool``: ``kernels.scatter_kv``, then ``kernels.gather_kv``
straight into the layer's buffers, widening a half-precision pool exactly), and a shifted
restore re-rotates keys with ``kernels.rerotate``: Triton where it runs, the torch references
elsewhere, equal bit for bit.

Tensors in an artifact, per layer ``i`` (shape ``[1, kv_heads, tokens, head_dim]``, the
profile's cache dtype; ``seen`` int64):
- full layers: ``layers.{i}.keys`` / ``layers.{i}.values`` for the artifact's own positions
  ``[start, end)`` only; the parent chain supplies ``[0, start)``;
- sliding layers: the layer's whole held window at ``end`` and ``layers.{i}.seen`` (= ``end``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer

from ..kernels import rerotate
from . import invariant
from .errors import ArtifactError
from .kvpool import LayerPool
from .models import LoadedModel
from .profiles import DEFAULT_PROFILE, applied_kv_dtype, applied_placement, pass_attention, placed


@dataclass(frozen=True)
class Segment:
    """One artifact's contribution to a chain: its tensors and the positions it covers."""

    tensors: dict[str, torch.Tensor]
    start: int
    end: int
    token_ids: tuple[int, ...]


class KVState:
    """A model's attention state after ``len(token_ids)`` tokens.

    Build one empty (``KVState(model)``) or from artifact segments (``KVState.restore``), then
    ``extend`` it; nothing else mutates the cache.
    """

    def __init__(self, model: LoadedModel) -> None:
        self.model = model
        #: Where the model runs and in which dtype, and the dtype keys and values are stored in:
        #: the profile applied when the state was made (the module is moved there, ``placed``).
        self.device, self.compute_dtype = applied_placement()
        self.kv_dtype = applied_kv_dtype()
        placed(model.module)
        self.cache = _new_cache(model, self.kv_dtype, self.compute_dtype)
        self.token_ids: list[int] = []
        #: Positions the state was moved by (approximate shifted grafts only; 0 is exact).
        self.shift = 0

    @property
    def end(self) -> int:
        """The number of positions the state covers."""
        return len(self.token_ids)

    def extend(self, ids: list[int], *, chunk: int | None = None, keep_last: int | None = None) -> torch.Tensor:
        """Run ``ids`` at positions ``[end, end + len(ids))``: in one forward pass, or in forward
        passes of ``chunk`` tokens each (chunked prefill).

        Returns their logits, float32 ``[len(ids), vocab]`` (or only the last ``keep_last``
        positions', the lm head running on those only); the cache grows in place.
        """
        if not ids:
            raise ArtifactError("cannot run an empty token sequence", hint="pass text that tokenizes to tokens")
        if chunk is not None and chunk < 1:
            raise ArtifactError(f"chunk size {chunk} is not a positive number of tokens",
                                hint="pass chunk=None for one pass")
        if self.end + len(ids) > self.model.spec.window:
            raise ArtifactError(
                f"{self.end + len(ids)} positions exceed {self.model.spec.name}'s window of {self.model.spec.window}",
                hint="use a shorter text",
            )
        if keep_last is not None and not 0 < keep_last <= len(ids):
            raise ArtifactError(f"keep_last {keep_last} is not within the {len(ids)} tokens run",
                                hint="pass 1..len(ids) or None")
        step = chunk or len(ids)
        first_kept = len(ids) - (keep_last or len(ids))
        parts = [self._forward(ids[i:i + step], max(0, first_kept - i)) for i in range(0, len(ids), step)]
        return parts[0] if len(parts) == 1 else torch.cat(parts)  # chunks' [n_i, vocab] -> [n, vocab]

    def _forward(self, ids: list[int], first_kept: int = 0) -> torch.Tensor:
        input_ids = torch.tensor([ids], dtype=torch.long, device=self.device)  # [1, n]
        extra: dict[str, object] = {}
        if first_kept:
            # Positions (within this pass) whose logits are wanted; may be none.
            extra["logits_to_keep"] = torch.arange(min(first_kept, len(ids)), len(ids), device=self.device)
        if self.shift:
            # Only RoPE sees the moved positions; masks still count the tokens actually held.
            first = self.end + self.shift
            extra["position_ids"] = torch.arange(first, first + len(ids), dtype=torch.long, device=self.device)[None, :]  # [1, n]
        # Under a schedule-invariant profile this names the invariant attention for the pass.
        with pass_attention(self.model.module), invariant.scoped_call(self.model.module, self.end, len(ids)) as invariant_kwargs:
            out = self.model.module(input_ids=input_ids, cache=self.cache, use_cache=True, **extra, **invariant_kwargs)
        self.token_ids.extend(ids)
        return out.logits[0].to(device="cpu", dtype=torch.float32)  # [1, n, vocab] -> [n, vocab], on the CPU

    def export(self, since: int) -> dict[str, torch.Tensor]:
        """The tensors an artifact covering ``[since, end)`` stores (see the module docstring)."""
        tensors: dict[str, torch.Tensor] = {}
        for i, layer in enumerate(_layers(self.cache)):
            if layer.keys is None or layer.values is None:
                raise ArtifactError(f"layer {i} holds no state to export", hint="run some tokens first")
            if isinstance(layer, DynamicSlidingWindowLayer):
                tensors[f"layers.{i}.keys"] = _stored(layer.keys, self.kv_dtype)
                tensors[f"layers.{i}.values"] = _stored(layer.values, self.kv_dtype)
                tensors[f"layers.{i}.seen"] = torch.tensor([layer.cumulative_length], dtype=torch.int64)
            else:
                tensors[f"layers.{i}.keys"] = _stored(layer.keys[:, :, since:, :], self.kv_dtype)  # [1, h, end - since, d]
                tensors[f"layers.{i}.values"] = _stored(layer.values[:, :, since:, :], self.kv_dtype)
        return tensors

    @classmethod
    def restore(cls, model: LoadedModel, chain: list[Segment], *, shift: int = 0) -> KVState:
        """Rebuild the state at ``chain[-1].end`` from a root-first chain of segments.

        Every shape and count is checked against the model before the cache is touched. A
        non-zero ``shift`` moves the state by re-rotating cached keys with RoPE: approximate,
        measured, never exact.
        """
        state = cls(model)
        state.shift = shift
        _check_chain(model, chain, state.kv_dtype)
        last = chain[-1]
        kv_heads, head_dim = _kv_shape(model)
        # One pool per layer size (a sliding layer holds its window, a full one the chain), each
        # cleared and refilled layer after layer.
        pools: dict[int, LayerPool] = {}
        for i, layer in enumerate(_layers(state.cache)):
            # The layer's restored positions, written into a paged pool through the graft
            # kernels and read back dense (kvpool.py): a sliding layer its held window, a full
            # layer every segment of the chain at its own positions.
            sliding = isinstance(layer, DynamicSlidingWindowLayer)
            if sliding:
                parts = [(last.tensors[f"layers.{i}.keys"], last.tensors[f"layers.{i}.values"], 0)]
            else:
                parts = [(s.tensors[f"layers.{i}.keys"], s.tensors[f"layers.{i}.values"], s.start) for s in chain]
            positions = sum(k.shape[2] for k, _, _ in parts)
            pool = pools.get(positions)
            if pool is None:
                pool = pools[positions] = LayerPool(positions, kv_heads, head_dim, state.kv_dtype, state.device)
            pool.clear()
            for keys, values, start in parts:
                pool.write(keys.to(state.device), values.to(state.device), start)
            # Widened back exactly: the cache holds the compute dtype whatever it stores.
            if sliding:
                keys, values = (t.to(state.compute_dtype) for t in pool.read())  # [1, h, held, d] each
                layer.lazy_initialization(keys, values)
                layer.keys, layer.values = keys, values
                layer.cumulative_length = int(last.tensors[f"layers.{i}.seen"][0])
            else:
                # Straight into the growing layer's buffers, with room for what runs next.
                reserved = _growing(layer).reserve((1, kv_heads, pool.positions, head_dim), state.compute_dtype, state.device)
                keys, values = pool.read(out=reserved)
            if shift:
                # The graft kernels' re-rotation: Triton where it runs, else its torch reference (equal bit for bit).
                keys.copy_(rerotate(keys, *_rotation(model, i, shift, keys)))  # [1, h, held, d]
        state.token_ids = [t for s in chain for t in s.token_ids]
        return state


class KVBatch:
    """Several sequences' states run together, one token per row per forward pass: how an
    evaluation decodes many problems per pass (``ops.decode_batch``), where one sequence at a
    time would read every weight once per token.

    A row joins as a ``KVState`` that was prefilled alone (``add``: its cache is copied in; the
    state itself is left as it was) and leaves when its decoding ends (``remove``). The rows'
    caches are stacked along the batch dimension, each left-padded to the longest; a padded
    slot is masked out of attention and each row's token runs at the row's own next position
    (RoPE sees ``ends[r]``, never the padded length), so every row computes what it would alone
    up to the kernels' reduction order, which depends on the batch's shape. Results are
    therefore reproducible for the same schedule of joins and leaves, not equal bit for bit
    to a one-row run: no exactness claim rests on a batch, and no artifact is captured from one.

    ``step`` is the one update path. Only full-attention models batch: a sliding-window layer
    counts padded slots as positions seen.
    """

    def __init__(self, model: LoadedModel) -> None:
        if model.sliding_window is not None:
            raise ArtifactError(
                f"{model.spec.name} has sliding-window layers, which cannot hold left-padded rows",
                hint="decode it one problem at a time (batch 1)",
            )
        self.model = model
        self.device, self.compute_dtype = applied_placement()
        self.kv_dtype = applied_kv_dtype()
        placed(model.module)
        self._reset()

    def _reset(self) -> None:
        """No rows: an empty cache and mask."""
        self.cache = _new_cache(self.model, self.kv_dtype, self.compute_dtype)
        #: 1 where a row holds a real position, 0 where it is padded: ``[rows, held]``.
        self.mask = torch.zeros(0, 0, dtype=torch.long, device=self.device)
        #: Each row's own length: the position its next token runs at.
        self.ends: list[int] = []

    def __len__(self) -> int:
        return len(self.ends)

    def add(self, state: KVState) -> None:
        """Append ``state`` as the last row (its shift must be 0: batches run at own positions)."""
        if state.shift:
            raise ArtifactError("a shifted state cannot join a batch", hint="decode shifted grafts one at a time")
        if (state.kv_dtype, state.device, state.compute_dtype) != (self.kv_dtype, self.device, self.compute_dtype):
            raise ArtifactError(f"a state on {state.device} computing {state.compute_dtype} and storing {state.kv_dtype} "
                                f"cannot join a batch on {self.device} computing {self.compute_dtype} and storing {self.kv_dtype}",
                                hint="make the batch and its rows under the same profile")
        if state.end + 1 > self.model.spec.window:
            raise ArtifactError(f"a state of {state.end} positions has no room left in the window",
                                hint="decode it alone; it can take no token")
        rows, held = self.mask.shape
        width = max(held, state.end)
        for mine, theirs in zip(_layers(self.cache), _layers(state.cache), strict=True):
            if theirs.keys is None or theirs.values is None:
                raise ArtifactError("an empty state cannot join a batch", hint="run its prompt first")
            if not rows:
                mine.lazy_initialization(theirs.keys, theirs.values)
            for part in ("keys", "values"):
                setattr(mine, part, _stacked(mine, part, getattr(mine, part) if rows else None, getattr(theirs, part), width))
        row = torch.cat([torch.zeros(width - state.end, dtype=torch.long, device=self.device),
                         torch.ones(state.end, dtype=torch.long, device=self.device)])  # [width]
        self.mask = torch.cat([_left_pad(self.mask, width, dim=1), row[None, :]])  # [rows + 1, width]
        self.ends.append(state.end)

    def remove(self, rows: list[int]) -> None:
        """Drop ``rows`` (indices into the current rows); the rest keep their order. Columns no
        remaining row holds are dropped from the left."""
        gone = set(rows)
        keep = [r for r in range(len(self.ends)) if r not in gone]
        if len(keep) == len(self.ends):
            return
        if not keep:
            self._reset()
            return
        index = torch.tensor(keep, dtype=torch.long, device=self.device)
        mask = self.mask.index_select(0, index)  # [rows, held] -> [kept, held]
        first = int(mask.any(dim=0).nonzero()[0])  # the first column a kept row holds
        for layer in _layers(self.cache):
            for part in ("keys", "values"):
                held = getattr(layer, part)
                if held is None:
                    continue
                # The kept rows' kept columns, written once into a buffer with room: the next
                # step appends in place instead of copying the batch again.
                columns = held[:, :, first:, :]  # [rows, h, held, d] -> [rows, h, held - first, d]
                out = _buffer(layer, part, (len(keep), *columns.shape[1:]), columns.dtype, columns.device)
                setattr(layer, part, torch.index_select(columns, 0, index, out=out))  # [kept, h, held - first, d]
        self.mask = mask[:, first:]
        self.ends = [self.ends[r] for r in keep]

    def step(self, tokens: list[int]) -> torch.Tensor:
        """Run ``tokens[r]`` on row ``r`` at position ``ends[r]``, all rows in one forward pass.

        Returns the rows' logits, float32 ``[rows, vocab]``.
        """
        if len(tokens) != len(self.ends) or not tokens:
            raise ArtifactError(f"{len(tokens)} tokens for a batch of {len(self.ends)} rows",
                                hint="pass one token per row")
        if max(self.ends) + 1 > self.model.spec.window:
            raise ArtifactError(f"a row would pass {self.model.spec.name}'s window of {self.model.spec.window}",
                                hint="remove rows that have reached the window")
        rows = len(tokens)
        input_ids = torch.tensor(tokens, dtype=torch.long, device=self.device)[:, None]  # [rows, 1]
        position_ids = torch.tensor(self.ends, dtype=torch.long, device=self.device)[:, None]  # [rows, 1]
        mask = torch.cat([self.mask, torch.ones(rows, 1, dtype=torch.long, device=self.device)], dim=1)  # [rows, held + 1]
        with pass_attention(self.model.module):
            out = self.model.module(input_ids=input_ids, cache=self.cache, attention_mask=mask, position_ids=position_ids,
                                    use_cache=True)
        self.mask = mask
        self.ends = [e + 1 for e in self.ends]
        return out.logits[:, -1].to(device="cpu", dtype=torch.float32)  # [rows, 1, vocab] -> [rows, vocab], on the CPU


def _stacked(layer: DynamicLayer, part: str, held: torch.Tensor | None, row: torch.Tensor, width: int) -> torch.Tensor:
    """The batch's ``held`` ``[rows, h, n, d]`` (None: no rows yet) with ``row`` ``[1, h, m, d]``
    below it, each left-padded with zeros to ``width`` positions: ``[rows + 1, h, width, d]``,
    written once into a new buffer with room (``_buffer``), so the steps that follow append in
    place."""
    rows = 0 if held is None else held.shape[0]
    _, h, _, d = row.shape
    out = _buffer(layer, part, (rows + 1, h, width, d), row.dtype, row.device)
    for target, source in ((out[:rows], held), (out[rows:], row)):
        if source is not None:
            n = source.shape[2]
            target[:, :, :width - n].zero_()
            target[:, :, width - n:] = source  # [r, h, n, d] right-aligned after zeros
    return out


def _left_pad(t: torch.Tensor, width: int, dim: int = -2) -> torch.Tensor:
    """``t`` with zeros prepended along ``dim`` up to ``width`` (itself when already that wide)."""
    missing = width - t.shape[dim]
    if missing == 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([t.new_zeros(shape), t], dim=dim)


#: Positions of room a full-attention layer keeps past its end when it (re)allocates: a question,
#: or that many decode steps, append in place before the next copy.
ROOM = 256


class _GrowingLayer(DynamicLayer):
    """A full-attention cache layer that appends in place.

    ``keys``/``values`` are views of the first ``n`` positions of buffers ``[B, h, capacity, d]``
    with room past ``n``: a pass writes only its new positions, where transformers'
    ``DynamicLayer`` copies the whole cache into a new tensor every pass (at 4K positions that
    copy cost a graft's continuation more than its attention). When the room runs out, or
    ``keys`` is no longer a view of the buffers (``KVBatch`` sets it directly), the held
    positions are copied once into new buffers with ``ROOM`` more. The views hold the same values
    a concatenation would (attention reads them by stride; its bits do not depend on the stride,
    tested), so the exactness contract is untouched. Positions below ``n`` are never written
    again: a view handed out earlier (an export) keeps its values.
    """

    # No new slots: an existing layer's class is swapped for this one, which needs the same
    # memory layout (the buffers live in the layer's own ``__dict__``).
    __slots__ = ()

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.keys = _appended(self, "keys", key_states)
        self.values = _appended(self, "values", value_states)
        return self.keys, self.values

    def reserve(self, shape: tuple[int, int, int, int], dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Make the layer hold ``shape`` ``[B, h, n, d]`` keys and values in new buffers with
        ``ROOM`` past them, and return both for the caller to fill before any pass reads them
        (a restore's gather writes them)."""
        keys, values = _buffer(self, "keys", shape, dtype, device), _buffer(self, "values", shape, dtype, device)
        self.lazy_initialization(keys, values)
        self.keys, self.values = keys, values
        return keys, values


def _growing(layer: DynamicLayer) -> _GrowingLayer:
    """``layer``, a full-attention layer of a cache ``_new_cache`` made: always a ``_GrowingLayer``."""
    if not isinstance(layer, _GrowingLayer):
        raise TypeError(f"full-attention cache layer {type(layer).__name__} is not one _new_cache makes")
    return layer


def _buffer(layer: DynamicLayer, part: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A new buffer for ``shape`` ``[B, h, n, d]`` with ``ROOM`` more positions, kept on ``layer``
    as ``_room_<part>``: the view of its first ``n`` (uninitialised)."""
    b, h, n, d = shape
    buffer = torch.empty(b, h, n + ROOM, d, dtype=dtype, device=device)
    setattr(layer, f"_room_{part}", buffer)
    return buffer[:, :, :n]  # [B, h, n + ROOM, d] -> [B, h, n, d]


def _appended(layer: DynamicLayer, part: str, new: torch.Tensor) -> torch.Tensor:
    """The layer's ``part`` followed by ``new`` along positions: ``[B, h, n, d]`` + ``[B, h, q, d]``
    -> ``[B, h, n + q, d]``, written into the room past ``n`` when the buffer has it, else both
    copied once into a new buffer with room (``_buffer``)."""
    held: torch.Tensor = getattr(layer, part)
    # A layer nothing has entered yet holds an empty placeholder, not a [B, h, 0, d] tensor.
    started = held.dim() == 4
    n, q = (held.shape[-2] if started else 0), new.shape[-2]
    buffer: torch.Tensor | None = layer.__dict__.get(f"_room_{part}")
    if (
        buffer is not None and started and buffer.dtype == new.dtype
        and held.data_ptr() == buffer.data_ptr() and held.stride() == buffer.stride()
        and held.shape[:2] == new.shape[:2] == buffer.shape[:2] and n + q <= buffer.shape[2]
    ):
        buffer[:, :, n:n + q] = new
        return buffer[:, :, :n + q]  # [B, h, capacity, d] -> [B, h, n + q, d]
    b, h, _, d = new.shape
    dtype = torch.promote_types(held.dtype, new.dtype) if started else new.dtype
    view = _buffer(layer, part, (b, h, n + q, d), dtype, new.device)
    # torch.cat checks the shapes agree and writes straight into the view: one copy of each.
    return torch.cat([held, new], dim=-2, out=view) if started else view.copy_(new)


class _RoundedLayer(_GrowingLayer):
    """A full-attention cache layer whose keys and values are rounded to ``dtype`` as they
    enter (then held as float32, which represents them exactly)."""

    __slots__ = ()
    dtype: torch.dtype

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        return super().update(*_rounded_pair(key_states, value_states, self.dtype), *args, **kwargs)


class _RoundedSlidingLayer(DynamicSlidingWindowLayer):
    """``_RoundedLayer`` for a sliding-window layer."""

    __slots__ = ()
    dtype: torch.dtype

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        return super().update(*_rounded_pair(key_states, value_states, self.dtype), *args, **kwargs)


def _new_cache(model: LoadedModel, kv_dtype: torch.dtype, compute_dtype: torch.dtype) -> DynamicCache:
    """An empty cache for ``model`` storing ``kv_dtype``: its full-attention layers growing in
    place (``_GrowingLayer``), and rounding ones (``_RoundedLayer``, ``_RoundedSlidingLayer``)
    when the dtype is narrower than the model computes in; sliding layers otherwise
    transformers' own (they hold only their window)."""
    cache = DynamicCache(config=model.module.config)
    rounding = kv_dtype != compute_dtype
    for layer in _layers(cache):
        if isinstance(layer, DynamicSlidingWindowLayer):
            if rounding:
                layer.__class__ = _RoundedSlidingLayer
        else:
            layer.__class__ = _RoundedLayer if rounding else _GrowingLayer
        if rounding:
            layer.dtype = kv_dtype  # type: ignore[attr-defined]
    return cache


def _rounded_pair(keys: torch.Tensor, values: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """What a rounding layer stores of a pass's new keys and values (both rounded layers' one rule)."""
    return _rounded(keys, dtype), _rounded(values, dtype)


def _rounded(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    narrow = t.to(dtype)
    # One pass in the common case: only an infinity after rounding can mean an overflow, and only
    # then is the wide tensor looked at (it may have held the infinity itself).
    if bool(torch.isinf(narrow).any()) and bool(torch.isfinite(t).all()):
        raise ArtifactError(f"a key or value of {float(t.abs().max()):.4g} is beyond {dtype}'s range",
                            hint=f"use a float32 profile (--profile {DEFAULT_PROFILE}) for this model")
    return narrow.to(t.dtype)


def _stored(t: torch.Tensor, kv_dtype: torch.dtype) -> torch.Tensor:
    """``t`` as an artifact stores it: a copy in the cache dtype (exact: the cache holds only
    values that dtype represents)."""
    return t.to(kv_dtype) if kv_dtype != t.dtype else t.clone()


def _layers(cache: DynamicCache) -> list[DynamicLayer]:
    """The cache's layers, typed: for the architectures kvgraft runs, ``DynamicCache`` builds only
    ``DynamicLayer`` (full attention) and its subclass ``DynamicSlidingWindowLayer``, never the
    linear-attention or placeholder layers its ``layers`` list may also hold for other models."""
    layers = []
    for i, layer in enumerate(cache.layers):
        if not isinstance(layer, DynamicLayer):
            raise TypeError(f"cache layer {i} is a {type(layer).__name__}, which kvgraft cannot export or restore")
        layers.append(layer)
    return layers


def _kv_shape(model: LoadedModel) -> tuple[int, int]:
    """``(kv_heads, head_dim)`` of ``model``'s cache layers."""
    config = model.module.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return int(config.num_key_value_heads), int(head_dim)


def _check_chain(model: LoadedModel, chain: list[Segment], kv_dtype: torch.dtype) -> None:
    if not chain:
        raise ArtifactError("no artifact to restore")
    config = model.module.config
    n_layers = config.num_hidden_layers
    kv_heads, head_dim = _kv_shape(model)
    layer_kinds = _layers(DynamicCache(config=config))
    cursor = 0
    for seg in chain:
        if seg.start != cursor:
            raise ArtifactError(
                f"artifact covering [{seg.start}, {seg.end}) does not continue its parent, which ends at {cursor}"
            )
        if seg.end - seg.start != len(seg.token_ids):
            raise ArtifactError(f"artifact covering [{seg.start}, {seg.end}) lists {len(seg.token_ids)} token ids")
        expected = set()
        for i, kind in enumerate(layer_kinds):
            expected |= {f"layers.{i}.keys", f"layers.{i}.values"}
            if isinstance(kind, DynamicSlidingWindowLayer):
                expected.add(f"layers.{i}.seen")
        if set(seg.tensors) != expected:
            extra, missing = sorted(set(seg.tensors) - expected)[:3], sorted(expected - set(seg.tensors))[:3]
            raise ArtifactError(
                f"kv file does not fit a {n_layers}-layer {model.spec.name}: missing {missing}, unexpected {extra}"
            )
        for i, kind in enumerate(layer_kinds):
            if isinstance(kind, DynamicSlidingWindowLayer):
                seen = seg.tensors[f"layers.{i}.seen"]
                if seen.shape != (1,) or int(seen[0]) != seg.end:
                    raise ArtifactError(
                        f"layer {i} says it has seen {seen.tolist()} tokens; the artifact ends at {seg.end}"
                    )
                held = min(seg.end, kind.sliding_window - 1)
            else:
                held = seg.end - seg.start
            for part in ("keys", "values"):
                t = seg.tensors[f"layers.{i}.{part}"]
                if tuple(t.shape) != (1, kv_heads, held, head_dim) or t.dtype != kv_dtype:
                    raise ArtifactError(
                        f"layers.{i}.{part} has shape {tuple(t.shape)} and dtype {t.dtype}; "
                        f"{model.spec.name} needs (1, {kv_heads}, {held}, {head_dim}) {str(kv_dtype).removeprefix('torch.')} "
                        "under this profile"
                    )
        cursor = seg.end


def _rotation(model: LoadedModel, layer: int, shift: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # The model's own rotary module gives cos/sin for an angle of `shift` positions, with the
    # right base for the layer: Gemma 3's local and global layers use different bases; Llama's
    # and Qwen2's layers share one (Qwen2.5's theta of 1e6 comes from its GGUF, via the config).
    rotary = model.module.model.rotary_emb
    # In the keys' dtype, on their device: the angles are what the model's own RoPE would apply there.
    x = torch.zeros(1, dtype=like.dtype, device=like.device)
    pos = torch.tensor([[shift]], dtype=torch.long, device=like.device)  # [1, 1]
    if model.spec.architecture == "gemma3":
        cos, sin = rotary(x, pos, model.module.config.layer_types[layer])
    else:  # "llama", "qwen2"
        cos, sin = rotary(x, pos)
    return cos[:, None], sin[:, None]  # [1, 1, d] -> [1, 1, 1, d], broadcast over heads and tokens
