"""The graft path through the graft kernels: ``KVState.restore`` writes every artifact of a chain
into a paged pool with ``scatter_kv`` and reads it back with ``gather_kv`` (kvpool.py), the
torch references on the CPU and the Triton kernels under ``TRITON_INTERPRET=1``, the same bits
either way; the pool refuses a write outside it and a read of a position nothing wrote.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kvgraft.engine import KVState, LoadedArtifact, LoadedModel, applied, capture, load_artifact, trust_signer
from kvgraft.engine._internal import kvpool
from kvgraft.engine._internal.errors import ArtifactError
from kvgraft.engine._internal.kvpool import LayerPool
from kvgraft.engine.kernels import BLOCK_SIZE, triton_available
from kvgraft.schemas import DeterminismProfile

# Three links whose boundaries fall inside blocks, so the scatters share blocks.
_TEXTS = ["Instructions: answer every question briefly and check it twice.\n", "Q: what is 17 times 3?\n", "A: it is"]


@pytest.fixture()
def chain(tiny: LoadedModel, profile: DeterminismProfile, key: Path, tmp_path: Path) -> LoadedArtifact:
    parent = None
    for n, text in enumerate(_TEXTS):
        capture(tiny, profile, text, tmp_path / str(n), key=key, parent=parent)
        parent = load_artifact(tmp_path / str(n), tiny, profile, trusted=trust_signer(key))
    assert parent is not None
    return parent


def _counting(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[str]]:
    """Wrap the pool's kernel entry points, recording the backend each call resolved to."""
    calls: dict[str, list[str]] = {"scatter_kv": [], "gather_kv": []}
    for name in calls:
        real = getattr(kvpool, name)

        def spy(*args: Any, _real: Any = real, _name: str = name, **kwargs: Any) -> Any:
            calls[_name].append(kwargs.get("backend", "auto"))
            return _real(*args, **kwargs)

        monkeypatch.setattr(kvpool, name, spy)
    return calls


def test_restore_writes_every_segment_through_the_kernels(
    tiny: LoadedModel, profile: DeterminismProfile, chain: LoadedArtifact, monkeypatch: pytest.MonkeyPatch
) -> None:
    segments = chain.segments()
    assert len(segments) == 3 and any(s.start % BLOCK_SIZE for s in segments[1:])
    calls = _counting(monkeypatch)
    state = KVState.restore(tiny, segments)
    layers = tiny.module.config.num_hidden_layers
    # One scatter per segment per layer, one gather per layer: no other path builds the cache.
    assert len(calls["scatter_kv"]) == 3 * layers and len(calls["gather_kv"]) == layers
    for i, layer in enumerate(state.cache.layers):
        joined = torch.cat([s.tensors[f"layers.{i}.keys"] for s in segments], dim=-2)  # [1, h, end, d]
        assert torch.equal(layer.keys, joined)
        assert torch.equal(layer.values, torch.cat([s.tensors[f"layers.{i}.values"] for s in segments], dim=-2))


@pytest.mark.skipif(not triton_available(), reason="triton is not installed: only the torch references ran")
def test_restore_under_the_triton_interpreter_gives_the_same_bits(
    tiny: LoadedModel, profile: DeterminismProfile, chain: LoadedArtifact, monkeypatch: pytest.MonkeyPatch
) -> None:
    continuation = tiny.tokenizer.encode(" fifty-one.", first=False)
    with applied(profile):
        reference = KVState.restore(tiny, chain.segments())
        expected = reference.extend(continuation)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with applied(profile):
        through_triton = KVState.restore(tiny, chain.segments())
        got = through_triton.extend(continuation)
    assert torch.equal(got, expected)
    # A shifted restore re-rotates through the Triton kernel: the same bits as its reference.
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    shifted_torch = KVState.restore(tiny, chain.segments(), shift=5)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    shifted_triton = KVState.restore(tiny, chain.segments(), shift=5)
    for a, b in zip(shifted_torch.cache.layers, shifted_triton.cache.layers, strict=True):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def test_pool_spans_blocks_and_keeps_the_stored_dtype() -> None:
    pool = LayerPool(40, 2, 8, torch.float16, torch.device("cpu"))
    assert tuple(pool.keys.shape) == (3, BLOCK_SIZE, 2, 8) and pool.keys.dtype == torch.float16
    gen = torch.Generator().manual_seed(0)
    first = torch.randn(1, 2, 17, 8, generator=gen).half(), torch.randn(1, 2, 17, 8, generator=gen).half()
    rest = torch.randn(1, 2, 23, 8, generator=gen).half(), torch.randn(1, 2, 23, 8, generator=gen).half()
    pool.write(*first, 0)
    pool.write(*rest, 17)
    keys, values = pool.read()
    assert keys.dtype == torch.float16 and torch.equal(keys, torch.cat([first[0], rest[0]], dim=-2))
    assert torch.equal(values, torch.cat([first[1], rest[1]], dim=-2))


def test_pool_refuses_a_write_past_its_end_and_a_read_of_an_unwritten_position() -> None:
    pool = LayerPool(20, 2, 8, torch.float32, torch.device("cpu"))
    with pytest.raises(ArtifactError, match="at position 15 do not fit a pool of 20 positions"):
        pool.write(torch.zeros(1, 2, 6, 8), torch.zeros(1, 2, 6, 8), 15)
    pool.write(torch.zeros(1, 2, 10, 8), torch.zeros(1, 2, 10, 8), 0)
    with pytest.raises(ArtifactError, match="position 10 of the 20 restored was never written") as e:
        pool.read()
    assert e.value.hint == "the chain must cover every position from 0"
    with pytest.raises(ArtifactError, match="is not a size"):
        LayerPool(-1, 2, 8, torch.float32, torch.device("cpu"))


def test_a_cleared_pool_takes_the_next_layer_and_refuses_what_only_the_last_layer_wrote() -> None:
    # A restore refills one pool layer after layer: a position the next layer does not write
    # must be refused, never read back with the previous layer's values.
    pool = LayerPool(20, 2, 8, torch.float32, torch.device("cpu"))
    layer0 = torch.full((1, 2, 20, 8), 1.0), torch.full((1, 2, 20, 8), 2.0)
    pool.write(*layer0, 0)
    assert torch.equal(pool.read()[0], layer0[0])
    pool.clear()
    layer1 = torch.full((1, 2, 12, 8), 3.0), torch.full((1, 2, 12, 8), 4.0)
    pool.write(*layer1, 0)
    with pytest.raises(ArtifactError, match="position 12 of the 20 restored was never written"):
        pool.read()
    pool.write(torch.full((1, 2, 8, 8), 5.0), torch.full((1, 2, 8, 8), 6.0), 12)
    keys, values = pool.read()
    assert torch.equal(keys[:, :, :12], layer1[0]) and bool((keys[:, :, 12:] == 5.0).all())
    assert torch.equal(values[:, :, :12], layer1[1]) and bool((values[:, :, 12:] == 6.0).all())
    # The same span's slots are computed once and reused.
    assert pool.slots(0, 12) is pool.slots(0, 12)
