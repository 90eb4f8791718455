"""Schedule-invariant computation (on the CPU in float32, and the same fixed shapes on a GPU in bfloat16 for
``cuda-bf16-invariant``): the same token at the same position gets the same bits whatever the chunking,
the batch it rides in and the thread count.

Default CPU kernels are not row-invariant: a matmul with one row (the GEMV path) rounds
differently from the same row inside a 16-row matmul, an activation's scalar tail loop rounds
differently from its vector body, and attention over a different number of keys sums in a
different order. Under the invariant profile:

- **linear layers** run as batches of fixed-shape GEMMs: the rows are padded to a multiple of
  ``tile`` (T) and cut into ``[T, K]`` tiles, the weight into fixed ``column_block``-wide slices,
  and every tile times every slice is one ``[T, K] x [K, N_c]`` GEMM. The M=1 path is never
  taken; every call has the same shape, whatever the number of tokens.
- **activations** (SiLU, tanh-GELU, sigmoid) run in fixed 16,384-element pieces of rows padded
  to a multiple of 64 elements, so every element takes the vectorized path on one thread.
- **attention** is ``kvgraft_invariant``, registered in transformers' ``AttentionInterface``:
  keys are laid out in blocks aligned to absolute positions (block ``j`` holds positions
  ``[j * key_block, (j + 1) * key_block)``); scores are fixed-shape GEMMs of a T-row query tile
  and one key block; the row maximum is exact (order-free); exponentials are elementwise; the
  probability-weighted values and the softmax denominator (a column of ones appended to the
  values) come from fixed-shape GEMMs per block and are summed in ascending block order. A key
  that is masked or absent (beyond the chunk, before a sliding window's held keys) contributes
  an exact zero in every schedule.
- norms and everything else are row-wise already (reductions over the last dimension do not
  depend on the number of rows; tested).

Everything is installed for the span of :func:`installed` (a thread-local torch function mode
plus a named ``AttentionInterface`` entry, both removed on exit); a model uses the attention only
inside :func:`scoped_call`, which names it in the model's config for one forward pass.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, PreTrainedModel

from .kernel_errors import ScheduleError

#: The name the attention is registered under in transformers' ``AttentionInterface``.
ATTENTION_NAME = "kvgraft_invariant"
#: The keyword the engine passes through a forward pass: the cache index of the first query.
QUERY_START_KWARG = "kvgraft_query_start"
#: Bumped whenever a change below could change a bit; recorded in the profile.
DESIGN_VERSION = "1"

#: Elements per activation call: a multiple of every vector width, below ATen's grain size
#: (32,768) so that no call is split across threads.
_ACT_PIECE = 16384
#: Rows of an activation input are padded to a multiple of this, so a row never ends mid-vector.
_ACT_ALIGN = 64
#: Query rows times keys held at once in attention: bounds memory, never changes a bit.
_SCORE_BUDGET = 1 << 22


@dataclass(frozen=True)
class InvariantSettings:
    """The fixed shapes of the invariant kernels; all of them are part of the profile."""

    #: Rows per GEMM of a linear layer (the fixed M tile); a forward pass of at most this
    #: many rows runs on one thread.
    tile: int = 16
    #: Query rows per attention GEMM (a kv group's query heads, position-major, padded).
    query_tile: int = 16
    #: Keys per attention block; blocks are aligned to absolute positions.
    key_block: int = 64
    #: Output columns per GEMM of a linear layer (the weight is cut in fixed slices).
    column_block: int = 2048

    def describe(self) -> str:
        """The settings as recorded in a profile's ``kernel_versions``."""
        return (f"v{DESIGN_VERSION}; m-tile={self.tile}; n-block={self.column_block}; "
                f"query-tile={self.query_tile}; key-block={self.key_block}")


def tiling_name(settings: InvariantSettings) -> str:
    """The profile's ``matmul_tiling`` for ``settings``, e.g. ``fixed-m-16``."""
    return f"fixed-m-{settings.tile}"


def settings_from_tiling(matmul_tiling: str) -> InvariantSettings:
    """Parse ``fixed-m-<T>``; anything else is refused."""
    prefix = "fixed-m-"
    if not matmul_tiling.startswith(prefix) or not matmul_tiling[len(prefix):].isdigit() or int(matmul_tiling[len(prefix):]) < 1:
        raise ScheduleError(f"matmul tiling {matmul_tiling!r} is not 'fixed-m-<rows>'", hint="use the cpu-fp32-invariant profile")
    return InvariantSettings(tile=int(matmul_tiling[len(prefix):]))


# --- the active settings, per thread ----------------------------------------------------------

_LOCAL = threading.local()


def active() -> InvariantSettings | None:
    """The invariant settings installed in this thread, or ``None``."""
    stack: list[InvariantSettings] = getattr(_LOCAL, "stack", [])
    return stack[-1] if stack else None


# --- linear layers and activations -------------------------------------------------------------


def tiled_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, settings: InvariantSettings) -> torch.Tensor:
    """``x @ weight.T + bias`` as fixed-shape ``[T, K] x [K, N_c]`` GEMMs, whatever ``x``'s rows."""
    k = x.shape[-1]
    n = weight.shape[0]
    lead = x.shape[:-1]
    rows = x.reshape(-1, k)  # [..., K] -> [M, K]
    m = rows.shape[0]
    t = settings.tile
    tiles = -(-m // t)
    if m == 0:
        return x.new_zeros(*lead, n)
    if m % t:
        padded = rows.new_zeros(tiles * t, k)
        padded[:m] = rows
    else:
        padded = rows.contiguous()
    a = padded.view(tiles, t, k)  # [tiles * T, K] -> [tiles, T, K]
    out = rows.new_empty(tiles, t, n)
    with _threads_at_most(tiles):
        for c in range(0, n, settings.column_block):
            w = weight[c:c + settings.column_block]  # [N_c, K]
            # One batched call of `tiles` identical-shape GEMMs; expand shares the slice, no copy.
            out[:, :, c:c + w.shape[0]] = torch.bmm(a, w.t().expand(tiles, k, w.shape[0]))
    y = out.view(tiles * t, n)[:m]  # [tiles, T, N] -> [M, N]
    if bias is not None:
        # Added after the GEMM (not as its beta term), elementwise: the same in every schedule.
        y = y + bias
    return y.reshape(*lead, n)  # [M, N] -> [..., N]


@contextlib.contextmanager
def _threads_at_most(n: int) -> Iterator[None]:
    """The span on at most ``n`` threads (at least one); the count before comes back after.

    The invariant kernels' one thread rule: no unit of fixed shape is shared between threads,
    since how a library cuts one GEMM between threads (along K too, which changes the sum order)
    is its own choice, not promised to match the one-thread result. So a batch of ``gemms``
    GEMMs runs on at most ``gemms`` threads (``tiled_linear``: a multi-tile pass keeping few rows,
    the lm head of ``keep_last <= tile`` after a long prefill; CI once saw Qwen2.5's greedy decode,
    one thread, differ from its 44-token prefill keeping 5 rows, two threads, one lm-head tile),
    and a pass of at most one tile runs on one (``scoped_call``: a decode step, whose activations
    and attention are too small to share as well). The bits never depend on the thread count.
    """
    threads = torch.get_num_threads()
    if n >= threads:
        yield
        return
    torch.set_num_threads(max(1, n))
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def tiled_elementwise(fn: Callable[..., torch.Tensor], x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """Apply an elementwise ``fn`` so that every element takes the vectorized path on one thread.

    ``inplace=True`` writes the result back into ``x``, as the activation would.
    """
    kwargs = dict(kwargs)
    inplace = bool(kwargs.pop("inplace", False))
    width = x.shape[-1]
    padded_width = -(-width // _ACT_ALIGN) * _ACT_ALIGN
    rows = x.reshape(-1, width)  # [..., W] -> [R, W]
    if padded_width != width:
        wide = rows.new_zeros(rows.shape[0], padded_width)
        wide[:, :width] = rows
    else:
        wide = rows.contiguous()
    flat = wide.view(-1)  # [R, W_pad] -> [R * W_pad]
    out = torch.empty_like(flat)
    for s in range(0, flat.numel(), _ACT_PIECE):
        out[s:s + _ACT_PIECE] = fn(flat[s:s + _ACT_PIECE], *args, **kwargs)
    result = out.view(-1, padded_width)[:, :width].reshape(x.shape)  # [R * W_pad] -> [..., W]
    return x.copy_(result) if inplace else result


#: The dtypes the fixed-shape routing covers: float32 on the CPU, bfloat16 on a GPU (cuda-bf16-invariant).
_FLOATS = (torch.float32, torch.bfloat16)
_ACTIVATIONS: frozenset[Callable[..., Any]] = frozenset({F.silu, F.gelu, torch.sigmoid, torch.Tensor.sigmoid, F.sigmoid})


class _InvariantMode(TorchFunctionMode):
    """Routes linear layers and activations to their fixed-shape versions (this thread only)."""

    def __init__(self, settings: InvariantSettings) -> None:
        super().__init__()
        self.settings = settings

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if func is F.linear:
            x = args[0] if args else kwargs["input"]
            weight = args[1] if len(args) > 1 else kwargs["weight"]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            if x.dtype in _FLOATS and weight.dtype == x.dtype and weight.dim() == 2:
                return tiled_linear(x, weight, bias, self.settings)
        elif func in _ACTIVATIONS and args and isinstance(args[0], torch.Tensor) and args[0].dtype in _FLOATS and args[0].dim() >= 1:
            base = torch.sigmoid if func is torch.Tensor.sigmoid else func
            return tiled_elementwise(base, args[0], *args[1:], **kwargs)
        return func(*args, **kwargs)


# --- attention ---------------------------------------------------------------------------------


def invariant_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Causal (optionally sliding-window) GQA attention whose bits do not depend on the schedule.

    ``query`` is ``[B, Hq, q, d]`` for cache indices ``[start, start + q)``; ``key``/``value`` are
    ``[B, Hkv, S, d]`` as the cache returns them: every position for a full layer, the held
    window plus the new keys for a sliding layer. ``attention_mask`` may be a 2-D key padding
    mask over cache indices, or ``None``. Returns ``[B, q, Hq, d]`` like eager attention.
    """
    # Nothing in here needs the linear/activation routing: skip the mode's per-op dispatch.
    with torch._C.DisableTorchFunction():
        return _attention(module, query, key, value, attention_mask, scaling, dropout, sliding_window, softcap, kwargs)


def _attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None,
    dropout: float,
    sliding_window: int | None,
    softcap: float | None,
    kwargs: dict[str, Any],
) -> tuple[torch.Tensor, None]:
    settings = active() or InvariantSettings()
    if dropout:
        raise ScheduleError("dropout in attention is not deterministic", hint="call model.eval()")
    b, hq, q, d = query.shape
    hkv, s = key.shape[1], key.shape[2]
    groups = hq // hkv
    bh = b * hkv
    start = kwargs.get(QUERY_START_KWARG)
    if start is None:
        # Called outside the engine: RoPE positions are cache indices when nothing is shifted.
        position_ids = kwargs.get("position_ids")
        start = int(position_ids[0, 0]) if position_ids is not None else s - q
    start = int(start)
    key_start = start - (s - q)  # cache index of key 0: the cache held s - q keys before this pass
    if key_start < 0:
        raise ScheduleError(f"attention got {s} keys for {q} queries starting at {start}", hint="a bug: report it")
    if scaling is None:
        scaling = float(getattr(module, "head_dim", d)) ** -0.5
    t, kb = settings.query_tile, settings.key_block

    # Keys and values in blocks aligned to absolute positions (block j holds [j*kb, (j+1)*kb));
    # positions this pass does not hold are zeros and masked, exactly like masked ones.
    first_block = key_start // kb
    n_blocks = (key_start + s - 1) // kb - first_block + 1
    offset = key_start - first_block * kb
    keys = key.new_zeros(b, hkv, n_blocks * kb, d)
    keys[:, :, offset:offset + s] = key
    # A column of ones after the values: the same GEMMs sum the probabilities (the denominator).
    values = value.new_zeros(b, hkv, n_blocks * kb, d + 1)
    values[:, :, offset:offset + s, :d] = value
    values[:, :, :, d] = 1.0
    keys_t = keys.view(bh, n_blocks, kb, d).transpose(-1, -2)  # [B, Hkv, width, d] -> [B*Hkv, blocks, d, kb]
    values_b = values.view(bh, n_blocks, kb, d + 1)  # [B, Hkv, width, d+1] -> [B*Hkv, blocks, kb, d+1]
    key_pos = (first_block * kb + torch.arange(n_blocks * kb, device=key.device)).view(n_blocks, kb)  # cache index of each slot: [width] -> [blocks, kb]
    key_ok = ((key_pos >= key_start) & (key_pos < key_start + s)).expand(b, n_blocks, kb)  # [B, blocks, kb]
    if attention_mask is not None:
        if attention_mask.dim() != 2:
            raise ScheduleError("the invariant attention takes a 2-D key padding mask or none", hint="pass attention_mask=None")
        cols = key_pos.clamp(0, attention_mask.shape[-1] - 1)
        key_ok = key_ok & attention_mask.to(torch.bool)[:, cols]  # [B, blocks, kb]
    key_ok = key_ok[:, None].expand(b, hkv, n_blocks, kb).reshape(bh, n_blocks, kb)  # [B, Hkv, blocks, kb] -> [B*Hkv, ...]

    # Query rows position-major: query i of head g in kv group h is row i * G + g, so a tile of
    # T rows covers consecutive positions; padded to whole tiles (padding rows have position -1).
    rows = query.view(b, hkv, groups, q, d).transpose(2, 3).reshape(bh, q * groups, d)  # [B, Hq, q, d] -> [B*Hkv, q*G, d]
    n_rows = q * groups
    n_tiles = -(-n_rows // t)
    q_tiles = query.new_zeros(bh, n_tiles * t, d)
    q_tiles[:, :n_rows] = rows
    q_tiles = q_tiles.view(bh, n_tiles, t, d)  # [B*Hkv, rows, d] -> [B*Hkv, tiles, T, d]
    row_pos = torch.full((n_tiles * t,), -1, dtype=torch.long, device=query.device)
    row_pos[:n_rows] = (start + torch.arange(q, device=query.device)).repeat_interleave(groups)
    row_pos = row_pos.view(n_tiles, t)  # [rows] -> [tiles, T]

    # The (tile, block) pairs that hold a key some row of the tile may see, in (tile, block)
    # order; a pair left out would only have added exact zeros.
    tile_hi = row_pos.amax(dim=1)
    tile_lo = torch.where(row_pos >= 0, row_pos, torch.full_like(row_pos, 1 << 62)).amin(dim=1)
    block_lo, block_hi = key_pos[:, 0], key_pos[:, -1]
    need = block_lo[None, :] <= tile_hi[:, None]  # [tiles, blocks]
    if sliding_window is not None:
        need = need & (block_hi[None, :] > tile_lo[:, None] - sliding_window)
    pairs = need.nonzero()  # [P, 2], row-major: ascending block within each tile
    ti, bi = pairs[:, 0], pairs[:, 1]
    n_pairs = pairs.shape[0]

    # One GEMM of shape [T, d] x [d, kb] per pair, all in one batched call.
    qa = q_tiles[:, ti].reshape(-1, t, d)  # [B*Hkv, P, T, d] -> [B*Hkv*P, T, d]
    ka = keys_t[:, bi].reshape(-1, d, kb)  # [B*Hkv, P, d, kb] -> [B*Hkv*P, d, kb]
    scores = torch.bmm(qa, ka).view(bh, n_pairs, t, kb) * scaling  # [B*Hkv*P, T, kb] -> [B*Hkv, P, T, kb]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    pos = row_pos[ti].view(1, n_pairs, t, 1)  # [P, T] -> [1, P, T, 1]
    kpos = key_pos[bi].view(1, n_pairs, 1, kb)  # [P, kb] -> [1, P, 1, kb]
    ok = (kpos <= pos) & (pos >= 0) & key_ok[:, bi].view(bh, n_pairs, 1, kb)  # [B*Hkv, P, kb] -> [B*Hkv, P, 1, kb]
    if sliding_window is not None:
        ok = ok & (kpos > pos - sliding_window)
    scores = scores.masked_fill(~ok, float("-inf"))
    # The row maximum over every pair of the row's tile: exact, a maximum has no order.
    top = torch.full((bh, n_tiles, t), float("-inf"), dtype=scores.dtype, device=scores.device)
    # Each pair's row maxima [B*Hkv, P, T] go to its tile: index [P] -> [1, P, 1] -> [B*Hkv, P, T].
    top = top.scatter_reduce(1, ti.view(1, n_pairs, 1).expand(bh, n_pairs, t), scores.amax(dim=-1), "amax")  # [B*Hkv, tiles, T]
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    probs = torch.exp(scores - top[:, ti, :, None])  # masked -> exactly 0
    va = values_b[:, bi].reshape(-1, kb, d + 1)  # [B*Hkv, P, kb, d+1] -> [B*Hkv*P, kb, d+1]
    # GEMMs [T, kb] x [kb, d+1]: probs [B*Hkv, P, T, kb] -> [B*Hkv*P, T, kb]; out -> [B*Hkv, P, T, d+1].
    parts = torch.bmm(probs.view(-1, t, kb), va).view(bh, n_pairs, t, d + 1)

    # Sum each tile's pairs in ascending absolute block order. table[tile, r] is the tile's r-th
    # pair, or a zero part past its last: adding an exact zero changes nothing.
    first_pair = torch.searchsorted(ti, torch.arange(n_tiles, device=ti.device))
    counts = torch.bincount(ti, minlength=n_tiles)
    depth = int(counts.max())
    r = torch.arange(depth, device=ti.device)
    table = torch.where(r[None, :] < counts[:, None], first_pair[:, None] + r[None, :], torch.full_like(r[None, :], n_pairs))  # [tiles, depth]
    parts = torch.cat([parts, parts.new_zeros(bh, 1, t, d + 1)], dim=1)[:, table]  # [B*Hkv, tiles, depth, T, d+1]
    out = parts[:, :, 0]
    for j in range(1, depth):
        out = out + parts[:, :, j]
    out = out.view(bh, n_tiles * t, d + 1)[:, :n_rows]  # [B*Hkv, tiles, T, d+1] -> [B*Hkv, q*G, d+1]
    denom = out[..., d:]
    denom = torch.where(denom > 0, denom, torch.ones_like(denom))
    result = out[..., :d] / denom  # [B*Hkv, q*G, d]
    result = result.view(b, hkv, q, groups, d).permute(0, 2, 1, 3, 4)  # -> [B, q, Hkv, G, d]
    return result.reshape(b, q, hq, d).contiguous(), None  # [B, q, Hkv, G, d] -> [B, q, Hq, d]


# --- installing and using ---------------------------------------------------------------------

_REGISTRY_LOCK = threading.Lock()
_REGISTRY_USERS = 0


def _register() -> None:
    global _REGISTRY_USERS
    with _REGISTRY_LOCK:
        if _REGISTRY_USERS == 0:
            if ATTENTION_NAME in ALL_ATTENTION_FUNCTIONS and ALL_ATTENTION_FUNCTIONS[ATTENTION_NAME] is not invariant_attention:
                raise ScheduleError(f"another attention is registered as {ATTENTION_NAME!r}", hint="remove it first")
            # The global instance's own mapping: models look attention up there, and `del` removes it.
            ALL_ATTENTION_FUNCTIONS[ATTENTION_NAME] = invariant_attention
        _REGISTRY_USERS += 1


def _unregister() -> None:
    global _REGISTRY_USERS
    with _REGISTRY_LOCK:
        _REGISTRY_USERS -= 1
        if _REGISTRY_USERS == 0:
            del ALL_ATTENTION_FUNCTIONS[ATTENTION_NAME]


def is_registered() -> bool:
    """Whether ``kvgraft_invariant`` is in transformers' ``AttentionInterface`` right now."""
    return ATTENTION_NAME in ALL_ATTENTION_FUNCTIONS


@contextlib.contextmanager
def installed(settings: InvariantSettings) -> Iterator[None]:
    """Install the invariant kernels for this thread for the span of a ``with`` block.

    On exit the torch function mode is popped, the attention registration removed (when no
    other thread still uses it) and nothing else was changed.
    """
    stack: list[InvariantSettings] = getattr(_LOCAL, "stack", None) or []
    _LOCAL.stack = stack
    _register()
    stack.append(settings)
    try:
        with _InvariantMode(settings):
            yield
    finally:
        stack.pop()
        _unregister()


@contextlib.contextmanager
def scoped_call(module: PreTrainedModel, start: int, rows: int) -> Iterator[dict[str, int]]:
    """For one forward pass of ``module`` over ``rows`` tokens per sequence (times the batch),
    whose first query sits at cache index ``start``.

    Under the invariant kernels, the model's config names ``kvgraft_invariant`` for the span and
    the yielded keyword arguments (to pass to the forward) carry ``start``; a pass of at most one
    tile of rows (a decode step) runs on one thread (``_threads_at_most``). Otherwise this yields
    no arguments and changes nothing.
    """
    settings = active()
    if settings is None:
        yield {}
        return
    config = module.config
    previous = config._attn_implementation
    config._attn_implementation = ATTENTION_NAME
    try:
        with _threads_at_most(1 if rows <= settings.tile else torch.get_num_threads()):
            yield {QUERY_START_KWARG: start}
    finally:
        config._attn_implementation = previous
