"""The paged KV pool a graft restores into, through the graft kernels (``engine/kernels``).

A restore writes each artifact's keys and values at their own positions into a pool of fixed
blocks, then reads the layer's positions back out as the dense tensors attention reads. A pool
holds one layer at a time: a restore fills it with a layer, reads it out, ``clear``s it and
fills it with the next (so a restore holds one layer's pool beside the cache, and computes each
segment's slots once, not once per layer), laid out as vLLM lays out its paged cache::

    keys, values   [num_blocks, BLOCK_SIZE, kv_heads, head_dim]   the artifact's stored dtype
    block_table    [num_blocks] int64                               block i of the sequence

Position ``p`` lives in slot ``block_table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE``
(``kernels.slot_mapping``). The writes are ``kernels.scatter_kv`` and the read
``kernels.gather_kv``: the Triton kernels on a GPU (or on the CPU under ``TRITON_INTERPRET=1``),
their torch references otherwise, equal bit for bit (pure copies). A chain of artifacts is joined
by the scatters themselves: each segment lands at its own positions, so no concatenation of the
chain exists besides this one.

Why the dense read: on the CPU, SDPA copies strided K/V, so attention reading the blocks in place
ran a 4K-token decode step 15-25% slower than reading one dense tensor (measured on SmolLM2, one
thread). The pool is therefore where a restore lands, and the cache attention reads is its gather.
"""

from __future__ import annotations

import torch

from ..kernels import BLOCK_SIZE, Backend, gather_kv, scatter_kv, slot_mapping
from .errors import ArtifactError


class LayerPool:
    """One layer's paged pool for ``positions`` positions of ``kv_heads`` heads of ``head_dim``.

    Blocks are allocated in order (block table ``0, 1, ...``); a position written twice keeps
    the last write; ``read`` refuses a position nothing wrote since the pool was made or last
    cleared.
    """

    def __init__(
        self, positions: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
        *, backend: Backend = "auto",
    ) -> None:
        if positions < 0:
            raise ArtifactError(f"a pool of {positions} positions is not a size", hint="pass the positions to restore (>= 0)")
        blocks = -(-positions // BLOCK_SIZE)
        self.positions = positions
        self.backend: Backend = backend
        self.keys = torch.empty(blocks, BLOCK_SIZE, kv_heads, head_dim, dtype=dtype, device=device)
        self.values = torch.empty_like(self.keys)
        self.block_table = torch.arange(blocks, dtype=torch.int64, device=device)
        #: Which positions hold a written key and value.
        self._written = torch.zeros(positions, dtype=torch.bool)
        #: Slot mappings by (start, length): every layer of a restore writes the same spans.
        self._slots: dict[tuple[int, int], torch.Tensor] = {}

    def clear(self) -> None:
        """Forget every write (the memory stays, its bytes unread until written again): the
        pool then takes another layer."""
        self._written.zero_()

    def slots(self, start: int, n: int) -> torch.Tensor:
        """The slots of positions ``[start, start + n)`` (``kernels.slot_mapping``, computed once)."""
        slots = self._slots.get((start, n))
        if slots is None:
            slots = self._slots[(start, n)] = slot_mapping(self.block_table, start, n)
        return slots

    def write(self, keys: torch.Tensor, values: torch.Tensor, start: int) -> None:
        """Write ``keys``/``values`` ``[1, kv_heads, n, head_dim]`` at positions ``[start, start + n)``."""
        n = keys.shape[2] if keys.dim() == 4 else -1
        if n < 0 or start < 0 or start + n > self.positions:
            raise ArtifactError(f"keys of shape {tuple(keys.shape)} at position {start} do not fit a pool of "
                                f"{self.positions} positions", hint="restore segments at their own positions")
        scatter_kv(keys, values, self.keys, self.values, self.slots(start, n), backend=self.backend)
        self._written[start:start + n] = True

    def read(self, out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Every position's keys and values, dense: ``[1, kv_heads, positions, head_dim]`` each,
        new, or written into ``out`` (``kernels.gather_kv``'s: a float32 ``out`` widens a
        half-precision pool exactly) and returned."""
        if not bool(self._written.all()):
            first = int((~self._written).nonzero()[0])
            raise ArtifactError(f"position {first} of the {self.positions} restored was never written",
                                hint="the chain must cover every position from 0")
        return gather_kv(self.keys, self.values, self.slots(0, self.positions), out=out, backend=self.backend)
