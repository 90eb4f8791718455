"""The process's memory: the read buffers kv files are read into (``memory.ReadBuffers``)."""

from __future__ import annotations

import gc
from pathlib import Path

import numpy as np
import pytest
import torch

from kvgraft.engine._internal import kvfile, memory
from kvgraft.engine._internal.memory import ReadBuffers
from kvgraft.schemas import sha256_bytes

MIB = 1 << 20


def _address(view: memoryview) -> int:
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


def test_a_read_buffer_is_reused_only_once_no_view_or_tensor_of_it_is_left() -> None:
    buffers = ReadBuffers()
    first = buffers.take(5000)
    assert first.fresh is not None and len(first.view) == 5000 and not first.view.readonly
    first.view[:] = b"a" * 5000
    address = _address(first.view)
    # A tensor made from a slice of the view keeps the buffer: a second take gets other memory.
    tensor = torch.frombuffer(first.view[100:200], dtype=torch.uint8)
    del first
    gc.collect()
    second = buffers.take(5000)
    assert _address(second.view) != address and second.fresh is not None
    second.view[:] = b"b" * 5000
    assert bytes(tensor.numpy()) == b"a" * 100
    # Once the tensor (and views of it) are gone the first buffer comes back, mapped in already.
    view_of_tensor = tensor[10:]
    del tensor
    gc.collect()
    assert buffers.free_bytes() == 0
    del view_of_tensor
    gc.collect()
    assert buffers.free_bytes() == memory._allocation(5000)
    third = buffers.take(4000)
    assert _address(third.view) == address and third.fresh is None and len(third.view) == 4000


def test_read_buffers_keep_the_newest_free_buffers_up_to_their_budget() -> None:
    buffers = ReadBuffers(keep=2 * MIB)
    taken = [buffers.take(MIB) for _ in range(4)]
    del taken
    gc.collect()
    assert buffers.free_bytes() == 4 * MIB  # trimmed at the next take, not on the freeing thread
    reused = buffers.take(MIB)
    assert reused.fresh is None
    assert buffers.free_bytes() == 2 * MIB
    # A size no free buffer fits gets new memory and leaves the free list as it is.
    big = buffers.take(3 * MIB)
    assert big.fresh is not None and buffers.free_bytes() == 2 * MIB


def test_buffers_are_allocated_in_size_classes_that_files_of_nearly_one_size_share() -> None:
    assert memory._allocation(1) == MIB and memory._allocation(MIB) == MIB and memory._allocation(MIB + 1) == 2 * MIB
    # 47,191,448 bytes: between 32 and 64 MiB, so a multiple of 4 MiB.
    assert memory._allocation(47_191_448) == 48 * MIB
    assert memory._allocation(46 * MIB) == 48 * MIB
    assert memory.ReadBuffers().take(0).view.nbytes == 0


@pytest.mark.parametrize("chunk", [None, 4096])
def test_a_smaller_file_read_into_a_reused_buffer_gives_exactly_its_own_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, chunk: int | None
) -> None:
    # The reused buffer still holds the larger file's bytes past the smaller one's end: only the
    # smaller file's bytes may be seen, hashed or returned.
    buffers = ReadBuffers()
    monkeypatch.setattr(kvfile, "READ_BUFFERS", buffers)
    if chunk is not None:
        monkeypatch.setattr(kvfile, "READ_CHUNK", chunk)
    big, small = tmp_path / "big", tmp_path / "small"
    big.write_bytes(bytes(range(256)) * 80)
    small.write_bytes(b"kv" * 7000)
    data, digest = kvfile.read_hashed(big)
    assert digest == sha256_bytes(big.read_bytes())
    address = _address(data)
    del data
    gc.collect()
    data, digest = kvfile.read_hashed(small)
    assert _address(data) == address
    assert bytes(data) == b"kv" * 7000 and digest == sha256_bytes(b"kv" * 7000)
