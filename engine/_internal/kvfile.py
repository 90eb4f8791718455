"""Deterministic safetensors writing and strict reading.

The same tensors always give the same bytes: names sorted, header written as compact JSON
with sorted keys, padded with spaces to an 8-byte boundary, data laid out in name order.
Reading checks every offset, dtype and shape against the byte count before any tensor is made,
so a hostile header is refused with ``KvFileError`` instead of crashing or over-allocating.
The format is the one documented at https://github.com/huggingface/safetensors.
"""

from __future__ import annotations

import hashlib
import io
import json
import mmap
import os
import queue
import struct
import threading
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import torch

from kvgraft.schemas import Sha256Digest, Sha256Hex, prefixed

from .errors import KvFileError
from .memory import READ_BUFFERS

_DTYPES: dict[torch.dtype, tuple[str, int]] = {
    torch.float32: ("F32", 4),
    torch.float16: ("F16", 2),
    torch.bfloat16: ("BF16", 2),
    torch.int64: ("I64", 8),
    torch.int32: ("I32", 4),
}
_BY_NAME = {name: (dtype, size) for dtype, (name, size) in _DTYPES.items()}
#: A header larger than this is refused before it is read.
MAX_HEADER = 16 * 1024 * 1024


def serialize(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None) -> bytes:
    """The safetensors bytes of ``tensors`` (CPU, contiguous, little-endian), deterministically."""
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = dict(sorted(metadata.items()))
    blobs: list[bytes] = []
    offset = 0
    for name in sorted(tensors):
        t = tensors[name]
        if t.dtype not in _DTYPES:
            raise KvFileError(f"tensor {name} has dtype {t.dtype}, which kv files do not store", hint="a bug: report it")
        data = t.detach().to("cpu").contiguous().numpy().tobytes() if t.dtype != torch.bfloat16 else (
            t.detach().to("cpu").contiguous().view(torch.int16).numpy().tobytes()
        )
        header[name] = {"dtype": _DTYPES[t.dtype][0], "shape": list(t.shape), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    text = json.dumps(header, sort_keys=True, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + b"".join(blobs)


#: Bytes ``read_hashed`` reads per step: small enough that a step's bytes are still in the CPU's
#: cache when they are hashed, large enough that a step's overhead is noise.
READ_CHUNK = 8 * 1024 * 1024
#: ``madvise`` advice (Linux 5.14+) that maps a range's pages in, writable, in one call.
_MADV_POPULATE_WRITE = 23


def read_hashed(path: Path, *, each_chunk: Callable[[memoryview], None] | None = None) -> tuple[memoryview, Sha256Digest]:
    """``path``'s bytes, as a writable buffer the caller owns, and their SHA-256.

    The buffer is private anonymous memory read into directly (``bytes`` would be copied once
    more by ``deserialize``, a zeroed ``bytearray`` written once more before the read): handed
    to ``deserialize``, its tensors are views of it. It comes from ``memory.READ_BUFFERS``: the
    memory of an earlier read, already mapped in, once nothing views that read's bytes any more
    (new memory is mapped in chunk by chunk as it is read). A file larger than ``READ_CHUNK`` is
    read and hashed at once: a thread reads chunk after chunk while this one hashes the chunks
    already read, so the whole costs about the hash alone (``readinto`` and hashlib both release
    the GIL). The digest is of exactly the bytes in the buffer. Raises ``OSError`` when the file
    cannot be read, and ``KvFileError`` when it changes size while it is read (the bytes hashed
    would not be the file's).

    ``each_chunk``, if given, is called with each chunk of the buffer right after the chunk is
    hashed, on the hashing thread, while its bytes are still in the CPU's cache: chunks in
    order, the first at the buffer's first byte, each but the last ``READ_CHUNK`` bytes long.
    Nothing it learns may be acted on before the caller has compared the digest.
    """
    with path.open("rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        buffer = READ_BUFFERS.take(size)
        h = hashlib.sha256()
        if size <= READ_CHUNK:
            for start, end in _read_chunks(f, buffer.view, buffer.fresh, path):
                h.update(buffer.view[start:end])
                if each_chunk is not None:
                    each_chunk(buffer.view[start:end])
        else:
            _hash_while_reading(f, buffer.view, buffer.fresh, path, h, each_chunk)
    return buffer.view, prefixed(Sha256Hex(h.hexdigest()))


def _read_chunks(f: io.FileIO, buf: memoryview, memory: mmap.mmap | None, path: Path) -> Iterator[tuple[int, int]]:
    """Read ``f`` into ``buf`` (exactly its size) ``READ_CHUNK`` bytes at a time, yielding each
    chunk's ``[start, end)`` once it is read; ``memory`` (``buf``'s new mapping, None when its
    pages are mapped in already) has each chunk's pages mapped in before it is read (a fresh page
    faulted in one by one costs microseconds on a VM)."""
    size = len(buf)
    done = 0
    while done < size:
        end = min(size, done + READ_CHUNK)
        if memory is not None:
            _populate(memory, done, end - done)
        start = done
        while done < end:
            n = f.readinto(buf[done:end])
            if not n:
                raise KvFileError(f"{path} shrank from {size} to {done} bytes while it was read",
                                  hint="something is writing the file: read it again once it is complete")
            done += n
        yield start, end
    if f.read(1):
        raise KvFileError(f"{path} grew past {size} bytes while it was read",
                          hint="something is writing the file: read it again once it is complete")


def _hash_while_reading(
    f: io.FileIO, buf: memoryview, memory: mmap.mmap | None, path: Path, h: hashlib._Hash,
    each_chunk: Callable[[memoryview], None] | None = None,
) -> None:
    """``_read_chunks`` on a thread of its own, this one hashing each chunk it hands over (and
    handing it to ``each_chunk`` after).

    The reader stops at the first chunk after ``stop`` is set, so an error here (or an
    interrupt) never leaves it reading into a buffer nobody owns; its own error is raised here.
    """
    ready: queue.SimpleQueue[tuple[int, int] | BaseException | None] = queue.SimpleQueue()
    stop = threading.Event()

    def read() -> None:
        try:
            for chunk in _read_chunks(f, buf, memory, path):
                if stop.is_set():
                    return
                ready.put(chunk)
            ready.put(None)
        except BaseException as e:  # handed to the hashing thread, which raises it
            ready.put(e)

    reader = threading.Thread(target=read, name="kvgraft-read", daemon=True)
    reader.start()
    try:
        while (item := ready.get()) is not None:
            if isinstance(item, BaseException):
                raise item
            h.update(buf[item[0]:item[1]])
            if each_chunk is not None:
                each_chunk(buf[item[0]:item[1]])
    finally:
        stop.set()
        reader.join()


def _populate(memory: mmap.mmap, start: int, length: int) -> None:
    """Map ``[start, start + length)`` of ``memory`` in, writable, in one call where the kernel
    can (``MADV_POPULATE_WRITE``); elsewhere the read faults the pages in as it writes them."""
    try:
        memory.madvise(_MADV_POPULATE_WRITE, start, length)
    except (OSError, ValueError):
        pass  # an older kernel: the pages fault in as they are read, the same bytes


def deserialize(data: bytes | memoryview, *, source: str = "kv file") -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Parse safetensors bytes strictly; return (tensors, metadata).

    From ``bytes`` (or a read-only buffer) each tensor gets a copy of its bytes, which it owns:
    the caller's bytes stay immutable. From a writable buffer (``read_hashed``'s) the tensors
    are views of it where their data is aligned to their element size (a copy otherwise): the
    caller hands the buffer over and must not write it afterwards. Either way no two tensors
    share a byte (the spans are checked disjoint).
    """
    owned = isinstance(data, memoryview) and not data.readonly
    if len(data) < 8:
        raise KvFileError(f"{source} is {len(data)} bytes, too short for a safetensors header")
    (n,) = struct.unpack("<Q", data[:8])
    if n > MAX_HEADER or n > len(data) - 8:
        raise KvFileError(f"{source} declares a {n}-byte header but holds {len(data) - 8} bytes after the length")
    raw_header = bytes(data[8 : 8 + n])
    # A safetensors header is one object of tensor objects (and __metadata__): never deeper
    # than 3 levels. Refusing deeper nesting up front keeps json.loads from recursing until
    # RecursionError on a header like "[[[[...".
    depth = _max_depth(raw_header)
    if depth > _MAX_HEADER_DEPTH:
        raise KvFileError(f"{source} has a header nested {depth} levels deep; a safetensors header has at most {_MAX_HEADER_DEPTH}")
    try:
        header = json.loads(raw_header.decode("utf-8"), object_pairs_hook=_unique)
    except KvFileError as e:
        raise KvFileError(f"{source} has an unreadable header: {e.message}") from e
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        # ValueError covers JSONDecodeError and integers past sys.get_int_max_str_digits().
        raise KvFileError(f"{source} has an unreadable header: {e}") from e
    if not isinstance(header, dict):
        raise KvFileError(f"{source} header is not a JSON object")
    body = memoryview(data)[8 + n :]
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise KvFileError(f"{source} __metadata__ must map strings to strings")
    spans: list[tuple[int, int, str]] = []
    tensors: dict[str, torch.Tensor] = {}
    for name, info in header.items():
        dtype, shape, (start, end) = _entry(name, info, source)
        spans.append((start, end, name))
        count = 1
        for dim in shape:
            count *= dim
        size = _DTYPES[dtype][1]
        if end - start != count * size or end > len(body):
            raise KvFileError(
                f"{source}: tensor {name} of shape {shape} and dtype {info['dtype']} needs "
                f"{count * size} bytes, but its offsets [{start}, {end}) do not fit the {len(body)}-byte body"
            )
        raw: bytes | bytearray | memoryview
        if owned and (8 + n + start) % size == 0:
            raw, offset = data, 8 + n + start  # a view of the handed-over buffer
        else:
            raw, offset = bytearray(body[start:end]), 0  # one copy, which the tensor owns (and may write)
        as_type = torch.int16 if dtype == torch.bfloat16 else dtype
        t = torch.frombuffer(raw, dtype=as_type, count=count, offset=offset) if count else torch.empty(0, dtype=as_type)
        tensors[name] = t.view(dtype).reshape(shape)
    spans.sort()
    cursor = 0
    for start, end, name in spans:
        if start != cursor:
            raise KvFileError(f"{source}: tensor {name} starts at {start}, expected {cursor} (overlap or gap)")
        cursor = end
    if cursor != len(body):
        raise KvFileError(f"{source}: {len(body) - cursor} trailing bytes after the last tensor")
    return tensors, dict(metadata)


_MAX_HEADER_DEPTH = 3


def _max_depth(text: bytes) -> int:
    """The deepest nesting of JSON arrays and objects in ``text``, brackets in strings not counted."""
    depth = deepest = 0
    in_string = escaped = False
    for byte in text:
        if in_string:
            if escaped:
                escaped = False
            elif byte == 0x5C:  # backslash
                escaped = True
            elif byte == 0x22:  # quote
                in_string = False
        elif byte == 0x22:
            in_string = True
        elif byte in (0x5B, 0x7B):  # [ {
            depth += 1
            if depth > deepest:
                deepest = depth
                if deepest > _MAX_HEADER_DEPTH:
                    return deepest
        elif byte in (0x5D, 0x7D):  # ] }
            depth -= 1
    return deepest


def _unique(pairs: list[tuple[str, object]]) -> dict[str, object]:
    out: dict[str, object] = {}
    for k, v in pairs:
        if k in out:
            raise KvFileError(f"duplicate tensor name {k!r}")
        out[k] = v
    return out


def _entry(name: str, info: object, source: str) -> tuple[torch.dtype, list[int], tuple[int, int]]:
    if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
        raise KvFileError(f"{source}: tensor {name} must have exactly dtype, shape and data_offsets")
    if not isinstance(info["dtype"], str) or info["dtype"] not in _BY_NAME:
        raise KvFileError(f"{source}: tensor {name} has unsupported dtype {info['dtype']!r}")
    shape, offsets = info["shape"], info["data_offsets"]
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 2**40 for d in shape):
        raise KvFileError(f"{source}: tensor {name} has an invalid shape {shape!r}")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
        or not 0 <= offsets[0] <= offsets[1]
    ):
        raise KvFileError(f"{source}: tensor {name} has invalid data_offsets {offsets!r}")
    return _BY_NAME[info["dtype"]][0], shape, (offsets[0], offsets[1])


def read_kv_file(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Read and parse a kv.safetensors file."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise KvFileError(f"cannot read {path}: {e.strerror}") from e
    return deserialize(data, source=str(path))
