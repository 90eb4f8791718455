"""kv.safetensors: deterministic bytes, compatibility with the safetensors library, and strict
refusal of hostile headers."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors.torch import load as st_load

from kvgraft.engine import KvFileError, deserialize, serialize


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
