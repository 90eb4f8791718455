"""kv.safetensors: deterministic bytes, compatibility with the safetensors library, and strict
refusal of hostile headers."""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load as st_load

from kvgraft.engine import KvFileError, deserialize, serialize
from kvgraft.engine._internal import kvfile
from kvgraft.engine._internal.kvfile import read_hashed
from kvgraft.schemas import sha256_bytes


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {
        "layers.1.keys": torch.randn(1, 2, 5, 4, generator=g),
        "layers.0.keys": torch.randn(1, 2, 5, 4, generator=g),
        "layers.0.seen": torch.tensor([5], dtype=torch.int64),
        "empty": torch.empty(1, 2, 0, 4),
    }


def test_same_tensors_same_bytes_in_any_insertion_order() -> None:
    t = _tensors()
    a = serialize(t, {"format": "x"})
    b = serialize(dict(reversed(list(t.items()))), {"format": "x"})
    assert a == b
    (n,) = struct.unpack("<Q", a[:8])
    assert n % 8 == 0


def test_round_trip_and_safetensors_library_reads_it() -> None:
    t = _tensors()
    data = serialize(t, {"format": "x"})
    back, meta = deserialize(data)
    assert meta == {"format": "x"}
    assert set(back) == set(t)
    for name in t:
        assert torch.equal(back[name], t[name]) and back[name].dtype == t[name].dtype
    lib = st_load(data)
    for name in t:
        assert torch.equal(lib[name], t[name])


def _with_header(header: dict, body: bytes) -> bytes:  # type: ignore[type-arg]
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + body


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"\x01\x02", "too short"),
        (struct.pack("<Q", 2**62) + b"{}", "declares a"),
        (struct.pack("<Q", 4) + b"nope", "unreadable header"),
        (_with_header({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, b"\0" * 12), "overlap or gap"),
        (_with_header({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"\0" * 8), "needs 12 bytes"),
        (_with_header({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 4), "do not fit"),
        (_with_header({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 12), "4 trailing bytes"),
        (_with_header({"a": {"dtype": "Q4", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8), "unsupported dtype"),
        (_with_header({"a": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, b"\0" * 8), "invalid shape"),
        (_with_header({"a": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}}, b"\0" * 8), "invalid data_offsets"),
        (_with_header({"a": {"dtype": "F32", "shape": [2]}}, b""), "exactly dtype, shape and data_offsets"),
        (_with_header({"__metadata__": {"k": 1}}, b""), "__metadata__ must map strings"),
        (struct.pack("<Q", 60) + b'{"a":{"dtype":"F32","shape":[],"data_offsets":[0,4]},"a":{}}' + b"\0" * 4, "duplicate tensor name"),
    ],
)
def test_hostile_headers_are_refused(data: bytes, message: str) -> None:
    with pytest.raises(KvFileError, match=message):
        deserialize(data)
    # The same from a buffer handed over (read_hashed's), whose tensors would be views.
    with pytest.raises(KvFileError, match=message):
        deserialize(memoryview(bytearray(data)))


def _inside(t: torch.Tensor, buf: memoryview) -> bool:
    base = torch.frombuffer(buf, dtype=torch.uint8).data_ptr()
    return base <= t.data_ptr() < base + len(buf)


def test_read_hashed_gives_the_files_digest_and_tensors_that_view_its_buffer(tmp_path: Path) -> None:
    t = {**_tensors(), "layers.2.keys": torch.randn(1, 2, 3, 4).to(torch.bfloat16), "layers.3.keys": torch.randn(3).half()}
    data = serialize(t)
    (tmp_path / "kv.safetensors").write_bytes(data)
    buf, digest = read_hashed(tmp_path / "kv.safetensors")
    assert bytes(buf) == data and digest == sha256_bytes(data)
    back, _ = deserialize(buf)
    copied, _ = deserialize(data)
    for name in t:
        assert torch.equal(back[name], t[name]) and back[name].dtype == t[name].dtype
        assert _inside(back[name], buf) == (t[name].numel() > 0), name  # views, not copies
        assert not _inside(copied[name], buf)



def test_a_file_of_many_chunks_is_read_and_hashed_whole_while_it_is_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Small chunks so that a small file takes the large file's path: a reader thread, this
    # thread hashing behind it, an odd-sized last chunk.
    monkeypatch.setattr(kvfile, "READ_CHUNK", 4096)
    g = torch.Generator().manual_seed(2)
    t = {f"layers.{i}.keys": torch.randn(1, 2, 97, 8, generator=g) for i in range(5)}
    data = serialize(t)
    assert len(data) > 5 * 4096 and len(data) % 4096
    (tmp_path / "kv.safetensors").write_bytes(data)
    buf, digest = read_hashed(tmp_path / "kv.safetensors")
    assert bytes(buf) == data and digest == sha256_bytes(data)
    back, _ = deserialize(buf)
    for name in t:
        assert torch.equal(back[name], t[name]) and _inside(back[name], buf)


@pytest.mark.parametrize("delta", [+5000, -3])
def test_a_file_whose_size_changes_while_it_is_read_raises_where_it_is_hashed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, delta: int
) -> None:
    # The reader thread reads as many bytes as the file had when it was opened: a buffer of
    # another size stands for a file that shrank (longer buffer) or grew (shorter) meanwhile.
    monkeypatch.setattr(kvfile, "READ_CHUNK", 4096)
    path = tmp_path / "kv.safetensors"
    path.write_bytes(bytes(range(256)) * 64)  # 16,384 bytes
    buf = memoryview(bytearray(16384 + delta))
    with path.open("rb", buffering=0) as f, pytest.raises(KvFileError) as e:
        kvfile._hash_while_reading(f, buf, None, path, hashlib.sha256())
    word = "shrank from 21384 to 16384 bytes" if delta > 0 else "grew past 16381 bytes"
    assert f"{path} {word} while it was read" in e.value.message
    assert "read it again once it is complete" in (e.value.hint or "")

def test_a_misaligned_tensor_in_a_handed_over_buffer_is_copied_not_viewed() -> None:
    # A header a byte longer than the 8-byte padding leaves every F32 tensor at an odd address.
    header = json.dumps({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}).encode() + b" "
    header += b" " * ((-len(header) % 8) + 1)
    buf = memoryview(bytearray(struct.pack("<Q", len(header)) + header + struct.pack("<2f", 1.5, -2.0)))
    back, _ = deserialize(buf)
    assert back["a"].tolist() == [1.5, -2.0] and not _inside(back["a"], buf)
